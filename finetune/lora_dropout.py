"""LoRA's dropped down projection, ``h = dropout(x) @ A^T``, as three Triton kernels on a GPU.

Dropout before a rank-r projection is cheap in arithmetic (r = 8: almost no work) and expensive in
memory traffic: PyTorch writes the dropped copy of ``x`` and its mask, reads them back for the
product, and the backward pass needs them again (finetune/lora_layer.py recomputes them instead of
keeping them). For a 400M model in bf16 those passes made a LoRA run with dropout 0.05 run at 0.87x
full fine-tuning's samples/s, against 1.02x without dropout; with these kernels (and
finetune/lora_layer.LoraLinear) 1.08-1.14x (docs/benchmarks.md).

Here the mask is never stored: each kernel reads ``x`` once and draws every element's keep/drop
decision from a keyed integer hash, so the three kernels agree on the mask without sharing memory.
The hash is what these kernels spend their time on, so one 32-bit hash (one lowbias32 round of the
pair's index xor the seed) decides two elements, 16 bits each: an element of a 64-column tile's left
half and its partner 32 columns to the right (so that each half-tile's mask is a plain elementwise
array, no interleaving). p is drawn in steps of 1/65,536 and the scale uses that exact probability:

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
    def _keep(seed, rows, block, n_cols, threshold, BLOCK_K: tl.constexpr):
        """The keep decisions of one (rows, BLOCK_K) tile, the same in every kernel, as its left and
        right halves: one hash of (pair index ^ seed) for each element of the left half and its partner
        BLOCK_K / 2 columns to the right, 16 bits each, an element kept when its bits >= threshold."""
        HALF: tl.constexpr = BLOCK_K // 2
        pairs_per_row = tl.cdiv(n_cols, BLOCK_K) * HALF
        index = (rows[:, None] * pairs_per_row + block * HALF + tl.arange(0, HALF)[None, :]).to(tl.uint32)
        bits = _mix(index ^ seed.to(tl.uint32))
        cut = threshold.to(tl.uint32)
        return (bits & 0xFFFF) >= cut, (bits >> 16) >= cut

    @triton.jit
    def _load_x(x_ptr, rows, cols, n_rows, n_cols):
        inside = (rows[:, None] < n_rows) & (cols[None, :] < n_cols)
        return tl.load(x_ptr + rows[:, None] * n_cols + cols[None, :], mask=inside, other=0.0)

    @triton.jit
    def _load_a_t(a_ptr, ranks, cols, rank, n_cols):
        """A^T's (len(cols), R) tile; ranks past ``rank`` read as 0."""
        inside = (ranks[None, :] < rank) & (cols[:, None] < n_cols)
        return tl.load(a_ptr + ranks[None, :] * n_cols + cols[:, None], mask=inside, other=0.0)

    @triton.jit
    def _store_dx(dx_ptr, dx, rows, cols, n_rows, n_cols):
        inside = (rows[:, None] < n_rows) & (cols[None, :] < n_cols)
        tl.store(dx_ptr + rows[:, None] * n_cols + cols[None, :], dx.to(dx_ptr.dtype.element_ty), mask=inside)

    @triton.jit(do_not_specialize=["seed", "threshold"])
    def _forward(
        x_ptr,
        a_ptr,
        h_ptr,
        n_rows,
        seed,
        threshold,
        scale,
        n_cols: tl.constexpr,
        rank: tl.constexpr,
        PRECISION: tl.constexpr,
        BLOCK_M: tl.constexpr,
        BLOCK_K: tl.constexpr,
        R: tl.constexpr,
    ):
        HALF: tl.constexpr = BLOCK_K // 2
        rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
        ranks = tl.arange(0, R)
        acc = tl.zeros((BLOCK_M, R), dtype=tl.float32)
        for block in range(0, tl.cdiv(n_cols, BLOCK_K)):
            left = block * BLOCK_K + tl.arange(0, HALF)
            right = left + HALF
            keep_left, keep_right = _keep(seed, rows, block, n_cols, threshold, BLOCK_K)
            x = _load_x(x_ptr, rows, left, n_rows, n_cols)
            x = tl.where(keep_left, x, tl.zeros_like(x))
            acc += tl.dot(x, _load_a_t(a_ptr, ranks, left, rank, n_cols), input_precision=PRECISION)
            x = _load_x(x_ptr, rows, right, n_rows, n_cols)
            x = tl.where(keep_right, x, tl.zeros_like(x))
            acc += tl.dot(x, _load_a_t(a_ptr, ranks, right, rank, n_cols), input_precision=PRECISION)
        out = (acc * scale).to(h_ptr.dtype.element_ty)
        tl.store(
            h_ptr + rows[:, None] * rank + ranks[None, :], out, mask=(rows[:, None] < n_rows) & (ranks[None, :] < rank)
        )

    @triton.jit(do_not_specialize=["seed", "threshold"])
    def _grad_weight(
        x_ptr,
        g_ptr,
        out_ptr,
        n_rows,
        seed,
        threshold,
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
        HALF: tl.constexpr = BLOCK_K // 2
        block = tl.program_id(0)
        split = tl.program_id(1)
        left = block * BLOCK_K + tl.arange(0, HALF)
        right = left + HALF
        ranks = tl.arange(0, R)
        acc_left = tl.zeros((R, HALF), dtype=tl.float32)
        acc_right = tl.zeros((R, HALF), dtype=tl.float32)
        for step in range(SPLIT_BLOCKS):  # this split's row blocks
            rows = (split * SPLIT_BLOCKS + step) * BLOCK_M + tl.arange(0, BLOCK_M)
            live = rows < n_rows
            g = tl.load(
                g_ptr + rows[:, None] * rank + ranks[None, :], mask=live[:, None] & (ranks[None, :] < rank), other=0.0
            )
            g_t = tl.trans(g)
            keep_left, keep_right = _keep(seed, rows, block, n_cols, threshold, BLOCK_K)
            x = _load_x(x_ptr, rows, left, n_rows, n_cols)
            acc_left += tl.dot(g_t, tl.where(keep_left, x, tl.zeros_like(x)), input_precision=PRECISION)
            x = _load_x(x_ptr, rows, right, n_rows, n_cols)
            acc_right += tl.dot(g_t, tl.where(keep_right, x, tl.zeros_like(x)), input_precision=PRECISION)
        out = out_ptr + split * rank * n_cols + ranks[:, None] * n_cols
        tl.store(out + left[None, :], acc_left * scale, mask=(ranks[:, None] < rank) & (left[None, :] < n_cols))
        tl.store(out + right[None, :], acc_right * scale, mask=(ranks[:, None] < rank) & (right[None, :] < n_cols))

    @triton.jit(do_not_specialize=["seed", "threshold"])
    def _grad_input(
        g_ptr,
        a_ptr,
        dx_ptr,
        n_rows,
        seed,
        threshold,
        scale,
        n_cols: tl.constexpr,
        rank: tl.constexpr,
        PRECISION: tl.constexpr,
        BLOCK_M: tl.constexpr,
        BLOCK_K: tl.constexpr,
        R: tl.constexpr,
    ):
        HALF: tl.constexpr = BLOCK_K // 2
        rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
        block = tl.program_id(1)
        ranks = tl.arange(0, R)
        g = tl.load(
            g_ptr + rows[:, None] * rank + ranks[None, :],
            mask=(rows[:, None] < n_rows) & (ranks[None, :] < rank),
            other=0.0,
        )
        keep_left, keep_right = _keep(seed, rows, block, n_cols, threshold, BLOCK_K)
        left = block * BLOCK_K + tl.arange(0, HALF)
        right = left + HALF
        dx = tl.dot(g, tl.trans(_load_a_t(a_ptr, ranks, left, rank, n_cols)), input_precision=PRECISION) * scale
        _store_dx(dx_ptr, tl.where(keep_left, dx, tl.zeros_like(dx)), rows, left, n_rows, n_cols)
        dx = tl.dot(g, tl.trans(_load_a_t(a_ptr, ranks, right, rank, n_cols)), input_precision=PRECISION) * scale
        _store_dx(dx_ptr, tl.where(keep_right, dx, tl.zeros_like(dx)), rows, right, n_rows, n_cols)


BLOCK_M, BLOCK_K, NUM_WARPS = 64, 64, 4
# The weight gradient sums over every row: each program sums SPLIT_BLOCKS row blocks of one column
# block (columns alone give too few programs to fill a GPU), then the splits' fp32 parts are added.
SPLIT_BLOCKS = 16
BITS = 16  # an element's share of its pair's 32-bit hash: p is drawn in steps of 1 / 65536


def threshold(p: float) -> tuple[int, float]:
    """The 16-bit threshold for dropout ``p`` (an element is kept when its bits are at or above it)
    and the scale 1 / (1 - the exact drop probability), so the expectation is unchanged."""
    cut = min(round(p * 2**BITS), 2**BITS - 1)
    return cut, 1 / (1 - cut / 2**BITS)


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


def down(x2: torch.Tensor, weight: torch.Tensor, p: float, seed: int) -> torch.Tensor:
    """``h = dropout(x2) @ weight^T`` for x2 (rows, features), weight (rank, features)."""
    h = torch.empty(x2.shape[0], weight.shape[0], dtype=x2.dtype, device=x2.device)
    grid = (triton.cdiv(x2.shape[0], BLOCK_M),)
    _forward[grid](x2, weight, h, x2.shape[0], seed, *threshold(p), **_launch_args(x2, weight))
    return h


def down_grad_input(g: torch.Tensor, weight: torch.Tensor, p: float, seed: int) -> torch.Tensor:
    """``dx = (g @ weight) * keep / (1 - p)`` for g (rows, rank): the gradient of ``down``'s x2."""
    n_rows, n_cols = g.shape[0], weight.shape[1]
    dx = torch.empty(n_rows, n_cols, dtype=weight.dtype, device=g.device)
    grid = (triton.cdiv(n_rows, BLOCK_M), triton.cdiv(n_cols, BLOCK_K))
    _grad_input[grid](g, weight, dx, n_rows, seed, *threshold(p), **_launch_args(dx, weight))
    return dx


def down_grad_weight(x2: torch.Tensor, g: torch.Tensor, weight: torch.Tensor, p: float, seed: int) -> torch.Tensor:
    """``dA = g^T @ (x2 * keep) / (1 - p)``: the gradient of ``down``'s weight."""
    (rank, n_cols), n_rows = weight.shape, x2.shape[0]
    splits = triton.cdiv(n_rows, SPLIT_BLOCKS * BLOCK_M)
    parts = torch.empty(splits, rank, n_cols, dtype=torch.float32, device=x2.device)
    grid = (triton.cdiv(n_cols, BLOCK_K), splits)
    extra = _launch_args(x2, weight)
    _grad_weight[grid](x2, g, parts, n_rows, seed, *threshold(p), SPLIT_BLOCKS=SPLIT_BLOCKS, **extra)
    return parts.sum(0).to(weight.dtype)


class DroppedDown(torch.autograd.Function):
    """``dropout(x, p) @ weight^T`` with the mask drawn in the kernels (module docstring)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, weight: torch.Tensor, p: float, seed: int) -> torch.Tensor:
        rank, n_cols = weight.shape
        x2 = x.reshape(-1, n_cols).contiguous()
        weight = weight.contiguous()
        h = down(x2, weight, p, seed)
        ctx.save_for_backward(x2, weight)
        ctx.p, ctx.seed, ctx.shape = p, seed, x.shape
        return h.view(*x.shape[:-1], rank)

    @staticmethod
    def backward(ctx, grad_h: torch.Tensor):
        x2, weight = ctx.saved_tensors
        g = grad_h.reshape(-1, weight.shape[0]).contiguous().to(x2.dtype)
        grad_x = grad_w = None
        if ctx.needs_input_grad[0]:
            grad_x = down_grad_input(g, weight, ctx.p, ctx.seed).view(ctx.shape)
        if ctx.needs_input_grad[1]:
            grad_w = down_grad_weight(x2, g, weight, ctx.p, ctx.seed)
        return grad_x, grad_w, None, None


def new_seed() -> int:
    """A mask seed from PyTorch's CPU generator (repeats under torch.manual_seed; no GPU sync)."""
    return int(torch.randint(0, 2**31 - 1, (1,)).item())


def dropped_down(x: torch.Tensor, weight: torch.Tensor, p: float, seed: int | None = None) -> torch.Tensor:
    """``dropout(x, p) @ weight^T`` (weight: LoRA's A, rank x features) on a GPU; see ``available``."""
    return DroppedDown.apply(x, weight, float(p), new_seed() if seed is None else int(seed))
