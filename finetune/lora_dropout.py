"""LoRA's dropped down projection, ``h = dropout(x) @ A^T``, as three Triton kernels on a GPU.

Dropout before a rank-r projection is cheap in arithmetic (r = 8: almost no work) and expensive in
memory traffic: PyTorch writes the dropped copy of ``x`` and its mask, reads them back for the
product, and the backward pass needs them again (finetune/lora_layer.py recomputes them instead of
keeping them). For a 400M model in bf16 those passes made a LoRA run with dropout 0.05 run at 0.87x
full fine-tuning's samples/s, against 1.02x without dropout; with these kernels 0.92x
(docs/benchmarks.md: they are bound by the hash, not by memory).

Here the mask is never stored: each kernel reads ``x`` once and draws every element's keep/drop
decision from a keyed 32-bit integer hash of its index (the seed is the key), so the three kernels
agree on the mask without sharing memory:

* forward: ``h = (x * keep) @ A^T / (1 - p)``, accumulated in fp32;
* ``dA = grad_h^T @ (x * keep) / (1 - p)``, reduced in fp32 over row blocks (split for parallelism);
* ``dx = (grad_h @ A) * keep / (1 - p)``.

The seed is drawn from PyTorch's CPU generator, so ``torch.manual_seed`` (and a resumed run's saved
RNG state) makes the masks repeat. The masks are not PyTorch's own (another random stream), the
distribution is the same: each element kept with probability 1 - p and scaled by 1 / (1 - p).
``available(x, weight)`` says when this path applies (a CUDA tensor, Triton importable, no autocast,
matching float dtypes, element indices within int32); otherwise the caller uses PyTorch's.
"""

from __future__ import annotations

import torch

try:  # Triton comes with PyTorch's CUDA builds; the CPU build has none (and needs none)
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - depends on the install
    triton = None

MAX_ELEMENTS = 2**31 - 1  # the kernels index elements (and draw their random numbers) in int32
DTYPES = (torch.bfloat16, torch.float16, torch.float32)


def available(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether ``dropped_down`` can run on these tensors (else use dropout and a Linear)."""
    return (
        triton is not None
        and x.is_cuda
        and weight.is_cuda
        and x.dtype == weight.dtype
        and x.dtype in DTYPES
        and not torch.is_autocast_enabled("cuda")
        and x.numel() <= MAX_ELEMENTS
    )


if triton is not None:

    @triton.jit
    def _mix(x):
        """lowbias32 (C. Wellons' 32-bit integer hash): every output bit depends on every input bit."""
        x ^= x >> 16
        x *= 0x7FEB352D
        x ^= x >> 15
        x *= 0x846CA68B
        x ^= x >> 16
        return x

    @triton.jit
    def _keep(seed, rows, cols, n_cols, p):
        """The keep decision of elements (rows, cols), the same in every kernel: a keyed hash of the
        element's index (two rounds, the key between them), its top 24 bits as a uniform in [0, 1)."""
        index = (rows[:, None] * n_cols + cols[None, :]).to(tl.uint32)
        bits = _mix(_mix(index) ^ seed.to(tl.uint32))
        return (bits >> 8).to(tl.float32) * (1.0 / 16777216.0) >= p

    @triton.jit(do_not_specialize=["seed"])
    def _forward(
        x_ptr,
        a_ptr,
        h_ptr,
        n_rows,
        seed,
        p,
        scale,
        n_cols: tl.constexpr,
        rank: tl.constexpr,
        PRECISION: tl.constexpr,
        BLOCK_M: tl.constexpr,
        BLOCK_K: tl.constexpr,
        R: tl.constexpr,
    ):
        rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
        ranks = tl.arange(0, R)
        acc = tl.zeros((BLOCK_M, R), dtype=tl.float32)
        for start in range(0, n_cols, BLOCK_K):
            cols = start + tl.arange(0, BLOCK_K)
            inside = (rows[:, None] < n_rows) & (cols[None, :] < n_cols)
            x = tl.load(x_ptr + rows[:, None] * n_cols + cols[None, :], mask=inside, other=0.0)
            x = tl.where(_keep(seed, rows, cols, n_cols, p), x, tl.zeros_like(x))
            a_t = tl.load(  # A^T's (BLOCK_K, R) tile; ranks past ``rank`` read as 0
                a_ptr + ranks[None, :] * n_cols + cols[:, None],
                mask=(ranks[None, :] < rank) & (cols[:, None] < n_cols),
                other=0.0,
            )
            acc += tl.dot(x, a_t, input_precision=PRECISION)
        out = (acc * scale).to(h_ptr.dtype.element_ty)
        tl.store(
            h_ptr + rows[:, None] * rank + ranks[None, :], out, mask=(rows[:, None] < n_rows) & (ranks[None, :] < rank)
        )

    @triton.jit(do_not_specialize=["seed"])
    def _grad_weight(
        x_ptr,
        g_ptr,
        out_ptr,
        n_rows,
        seed,
        p,
        scale,
        n_cols: tl.constexpr,
        rank: tl.constexpr,
        PRECISION: tl.constexpr,
        BLOCK_M: tl.constexpr,
        BLOCK_K: tl.constexpr,
        R: tl.constexpr,
        SPLIT_BLOCKS: tl.constexpr,
    ):
        # Program (column block, split): its rows' share of grad_h^T @ dropped x, into out[split].
        cols = tl.program_id(0) * BLOCK_K + tl.arange(0, BLOCK_K)
        split = tl.program_id(1)
        ranks = tl.arange(0, R)
        acc = tl.zeros((R, BLOCK_K), dtype=tl.float32)
        for block in range(SPLIT_BLOCKS):  # this split's row blocks
            rows = (split * SPLIT_BLOCKS + block) * BLOCK_M + tl.arange(0, BLOCK_M)
            live = rows < n_rows
            x = tl.load(
                x_ptr + rows[:, None] * n_cols + cols[None, :], mask=live[:, None] & (cols[None, :] < n_cols), other=0.0
            )
            x = tl.where(_keep(seed, rows, cols, n_cols, p), x, tl.zeros_like(x))
            g = tl.load(
                g_ptr + rows[:, None] * rank + ranks[None, :], mask=live[:, None] & (ranks[None, :] < rank), other=0.0
            )
            acc += tl.dot(tl.trans(g), x, input_precision=PRECISION)
        inside = (ranks[:, None] < rank) & (cols[None, :] < n_cols)
        tl.store(out_ptr + split * rank * n_cols + ranks[:, None] * n_cols + cols[None, :], acc * scale, mask=inside)

    @triton.jit(do_not_specialize=["seed"])
    def _grad_input(
        g_ptr,
        a_ptr,
        dx_ptr,
        n_rows,
        seed,
        p,
        scale,
        n_cols: tl.constexpr,
        rank: tl.constexpr,
        PRECISION: tl.constexpr,
        BLOCK_M: tl.constexpr,
        BLOCK_K: tl.constexpr,
        R: tl.constexpr,
    ):
        rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
        cols = tl.program_id(1) * BLOCK_K + tl.arange(0, BLOCK_K)
        ranks = tl.arange(0, R)
        g = tl.load(
            g_ptr + rows[:, None] * rank + ranks[None, :],
            mask=(rows[:, None] < n_rows) & (ranks[None, :] < rank),
            other=0.0,
        )
        a = tl.load(
            a_ptr + ranks[:, None] * n_cols + cols[None, :],
            mask=(ranks[:, None] < rank) & (cols[None, :] < n_cols),
            other=0.0,
        )
        dx = tl.dot(g, a, input_precision=PRECISION) * scale
        dx = tl.where(_keep(seed, rows, cols, n_cols, p), dx, tl.zeros_like(dx))
        inside = (rows[:, None] < n_rows) & (cols[None, :] < n_cols)
        tl.store(dx_ptr + rows[:, None] * n_cols + cols[None, :], dx.to(dx_ptr.dtype.element_ty), mask=inside)


BLOCK_M, BLOCK_K, NUM_WARPS = 64, 64, 4
# The weight gradient sums over every row: each program sums SPLIT_BLOCKS row blocks of one column
# block (columns alone give too few programs to fill a GPU), then the splits' fp32 parts are added.
SPLIT_BLOCKS = 16


def _launch_args(x2: torch.Tensor, weight: torch.Tensor) -> dict:
    """The kernels' shared compile-time arguments for x (rows, features) and A (rank, features)."""
    rank, n_cols = weight.shape
    return {
        "n_cols": n_cols,
        "rank": rank,
        "R": max(16, triton.next_power_of_2(rank)),  # tl.dot wants 16 or more on every side
        # fp32 inputs multiply in full precision (as torch does by default), not TF32
        "PRECISION": "ieee" if x2.dtype == torch.float32 else "tf32",
        "BLOCK_M": BLOCK_M,
        "BLOCK_K": BLOCK_K,
        "num_warps": NUM_WARPS,
    }


class DroppedDown(torch.autograd.Function):
    """``dropout(x, p) @ weight^T`` with the mask drawn in the kernels (module docstring)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, weight: torch.Tensor, p: float, seed: int) -> torch.Tensor:
        rank, n_cols = weight.shape
        x2 = x.reshape(-1, n_cols).contiguous()
        weight = weight.contiguous()
        h = torch.empty(x2.shape[0], rank, dtype=x.dtype, device=x.device)
        grid = (triton.cdiv(x2.shape[0], BLOCK_M),)
        _forward[grid](x2, weight, h, x2.shape[0], seed, p, 1 / (1 - p), **_launch_args(x2, weight))
        ctx.save_for_backward(x2, weight)
        ctx.p, ctx.seed, ctx.shape = p, seed, x.shape
        return h.view(*x.shape[:-1], rank)

    @staticmethod
    def backward(ctx, grad_h: torch.Tensor):
        x2, weight = ctx.saved_tensors
        rank, n_cols = weight.shape
        g = grad_h.reshape(-1, rank).contiguous().to(x2.dtype)
        n_rows, scale = x2.shape[0], 1 / (1 - ctx.p)
        extra = _launch_args(x2, weight)
        grad_x = grad_w = None
        if ctx.needs_input_grad[0]:
            grad_x = torch.empty_like(x2)
            grid = (triton.cdiv(n_rows, BLOCK_M), triton.cdiv(n_cols, BLOCK_K))
            _grad_input[grid](g, weight, grad_x, n_rows, ctx.seed, ctx.p, scale, **extra)
            grad_x = grad_x.view(ctx.shape)
        if ctx.needs_input_grad[1]:
            splits = triton.cdiv(n_rows, SPLIT_BLOCKS * BLOCK_M)
            parts = torch.empty(splits, rank, n_cols, dtype=torch.float32, device=x2.device)
            grid = (triton.cdiv(n_cols, BLOCK_K), splits)
            _grad_weight[grid](x2, g, parts, n_rows, ctx.seed, ctx.p, scale, SPLIT_BLOCKS=SPLIT_BLOCKS, **extra)
            grad_w = parts.sum(0).to(weight.dtype)
        return grad_x, grad_w, None, None


def new_seed() -> int:
    """A mask seed from PyTorch's CPU generator (repeats under torch.manual_seed; no GPU sync)."""
    return int(torch.randint(0, 2**31 - 1, (1,)).item())


def dropped_down(x: torch.Tensor, weight: torch.Tensor, p: float, seed: int | None = None) -> torch.Tensor:
    """``dropout(x, p) @ weight^T`` (weight: LoRA's A, rank x features) on a GPU; see ``available``."""
    return DroppedDown.apply(x, weight, float(p), new_seed() if seed is None else int(seed))
