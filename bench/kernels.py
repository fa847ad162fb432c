"""Two training levers measured kernel by kernel on the shapes of a fixed 128/64 step.

    python -m bench.kernels --out /tmp/kernels             # one GPU, batch 1,600
    python -m bench.kernels --smoke --out /tmp/kernels     # CPU check, tiny shapes (tests/bench)

* ``attention``: forward + backward of the three attentions a BlenderBot-400M step runs (encoder
  self-attention 128 x 128, causal decoder self-attention 64 x 64, cross-attention 64 x 128; 32
  heads of 40) through each SDPA backend, with the padding mask the step uses and without one,
  and through FlashAttention's variable-length form (``torch.nn.attention.varlen``) over the
  flattened rows, one sequence per dialogue and one per padding run (no mask at all).
* ``linear``: forward + backward of every linear layer shape of the step (the LM head aside)
  in bf16 against fp8 (e4m3 activations and weights, e5m2 gradients, one dynamic scale per tensor,
  ``torch._scaled_mm``), the casts eager and compiled, summed over a step's layers.

Each row's time is the median of ``--repeats`` calls after two warm-ups (CUDA events on a GPU).
A backend that cannot run a case records its error instead of a time.
"""

from __future__ import annotations

import argparse
import time

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from bench.common import command_line, device_name, md_table, versions, write_json

E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2
BACKENDS = {
    "flash": SDPBackend.FLASH_ATTENTION,
    "efficient": SDPBackend.EFFICIENT_ATTENTION,
    "cudnn": SDPBackend.CUDNN_ATTENTION,
    "math": SDPBackend.MATH,
}


def median_ms(fn, repeats: int) -> float:
    """Median milliseconds of ``fn()`` over ``repeats`` calls, after two warm-up calls."""
    cuda = torch.cuda.is_available()
    for _ in range(2):
        fn()
    times = []
    for _ in range(repeats):
        if cuda:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            torch.cuda.synchronize()
            times.append(start.elapsed_time(end))
        else:
            t0 = time.perf_counter()
            fn()
            times.append((time.perf_counter() - t0) * 1000)
    return sorted(times)[len(times) // 2]


def attempt(fn, repeats: int) -> float | str:
    try:
        return median_ms(fn, repeats)
    except Exception as err:  # a backend that does not take this case: recorded, not fatal
        return f"{type(err).__name__}: {str(err).splitlines()[0][:160]}" if str(err) else type(err).__name__


def cumulative(runs: list[list[int]], device) -> tuple[torch.Tensor, int]:
    """Cumulative sequence starts of the flattened rows (``runs``: each row's sequence lengths, in
    order) and the longest sequence, as the variable-length kernel takes them."""
    flat = [n for row in runs for n in row]
    starts = torch.tensor([0, *flat], dtype=torch.int64).cumsum(0).to(torch.int32)
    return starts.to(device), max(flat)


def attention_part(rows: int, heads: int, dim: int, source: int, target: int, repeats: int, device) -> dict:
    """Every case's forward + backward milliseconds; sources fill ``source - 4 .. source`` tokens
    and replies ``target - 4 .. target`` (the fixed rows' spread), right-padded."""
    g = torch.Generator().manual_seed(0)
    src = torch.randint(source - 4, source + 1, (rows,), generator=g)
    tgt = torch.randint(target - 4, target + 1, (rows,), generator=g)
    s = torch.arange(source)[None] < src[:, None]
    t = torch.arange(target)[None] < tgt[:, None]
    causal = torch.ones(target, target, dtype=torch.bool).tril()
    cases = {  # name: (query length, key length, the step's mask, causal without a mask)
        "encoder": (source, source, s[:, :, None] == s[:, None, :], False),
        "decoder": (target, target, (t[:, :, None] == t[:, None, :]) & causal, True),
        "cross": (target, source, (t[:, :, None] & s[:, None, :]) | (~t)[:, :, None], False),
    }
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32

    def projections(q_len: int, k_len: int) -> list[torch.Tensor]:
        # As the model lays them out: (rows, tokens, heads x dim) viewed as (rows, heads, tokens, dim).
        return [
            torch.randn(rows, n, heads * dim, device=device, dtype=dtype)
            .view(rows, n, heads, dim)
            .transpose(1, 2)
            .requires_grad_()
            for n in (q_len, k_len, k_len)
        ]

    sequences = {  # per row: the dialogue, then its padding (a sequence of its own; none if full)
        "encoder": ([[n, source - n] if n < source else [n] for n in src.tolist()],) * 2,
        "decoder": ([[target]] * rows,) * 2,  # causal: padding queries only ever follow the dialogue
        # Decoder padding rides with its dialogue; encoder padding is a sequence with no queries.
        "cross": (
            [[target, 0] if n < source else [target] for n in src.tolist()],
            [[n, source - n] if n < source else [n] for n in src.tolist()],
        ),
    }
    out = {}
    for name, (q_len, k_len, mask, is_causal) in cases.items():
        q, k, v = projections(q_len, k_len)
        mask = mask[:, None].to(device)
        for backend, which in BACKENDS.items():
            for masked in (True, False):
                run = _sdpa(q, k, v, mask if masked else None, is_causal and not masked, which)
                out[f"{name} {backend} {'mask' if masked else 'no mask'}"] = attempt(run, repeats)
        out[f"{name} varlen flash"] = attempt(_varlen(q, k, v, *sequences[name], name == "decoder"), repeats)
    return out


def _sdpa(q, k, v, mask, is_causal: bool, backend):
    def run() -> None:
        with sdpa_kernel(backend):
            o = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=is_causal)
        o.backward(torch.ones_like(o))

    return run


def _varlen(q, k, v, q_runs, k_runs, causal: bool):
    heads, dim = q.shape[1], q.shape[3]
    cq, max_q = cumulative(q_runs, q.device)
    ck, max_k = cumulative(k_runs, q.device)

    def run() -> None:
        from torch.nn.attention.varlen import varlen_attn

        flat = [t.transpose(1, 2).reshape(-1, heads, dim) for t in (q, k, v)]  # (rows x tokens, heads, dim)
        o = varlen_attn(*flat, cq, ck, max_q, max_k, **({"window_size": (-1, 0)} if causal else {}))
        o.backward(torch.ones_like(o))

    return run


def fp8_cast(x: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``x`` scaled into ``dtype``'s range and cast (one scale for the tensor), the same transposed
    (``_scaled_mm`` wants its second operand column-major) and the scale that undoes it."""
    top = torch.finfo(dtype).max
    scale = top / x.abs().amax().float().clamp(min=1e-12)
    y = (x.float() * scale).clamp(-top, top).to(dtype)
    return y, y.t().contiguous(), scale.reciprocal()


class Fp8Linear(torch.autograd.Function):
    """``F.linear(x, weight, bias)`` with fp8 matrix multiplications: e4m3 forward, e5m2
    gradients; what is saved for backward is fp8 (half the bf16 activations)."""

    @staticmethod
    def forward(ctx, x, weight, bias, cast):
        x8, x8t, x_scale = cast(x, E4M3)
        w8, w8t, w_scale = cast(weight, E4M3)
        y = torch._scaled_mm(x8, w8.t(), scale_a=x_scale, scale_b=w_scale, bias=bias, out_dtype=x.dtype)
        ctx.save_for_backward(x8t, x_scale, w8t, w_scale)
        ctx.cast = cast
        return y

    @staticmethod
    def backward(ctx, grad):
        x8t, x_scale, w8t, w_scale = ctx.saved_tensors
        g8, g8t, g_scale = ctx.cast(grad.contiguous(), E5M2)
        grad_x = torch._scaled_mm(g8, w8t.t(), scale_a=g_scale, scale_b=w_scale, out_dtype=grad.dtype)
        grad_w = torch._scaled_mm(g8t, x8t.t(), scale_a=g_scale, scale_b=x_scale, out_dtype=grad.dtype)
        return grad_x, grad_w, grad.sum(0), None


def step_linears(rows: int, source: int, target: int, d: int, ffn: int, encoder: int, decoder: int) -> dict:
    """(tokens, in, out) of every linear layer of a step (the LM head aside) and how many there are."""
    enc, dec = rows * source, rows * target
    return {
        (enc, d, d): encoder * 4 + decoder * 2,  # encoder q/k/v/o; each decoder layer's cross k/v
        (enc, d, ffn): encoder,
        (enc, ffn, d): encoder,
        (dec, d, d): decoder * 6,  # self q/k/v/o, cross q/o
        (dec, d, ffn): decoder,
        (dec, ffn, d): decoder,
    }


def linear_part(shapes: dict, repeats: int, device, compiled: bool) -> dict:
    """bf16 and fp8 forward + backward milliseconds per shape, the fp8 output's relative error,
    and the totals over a step."""
    casts = {"fp8 eager casts": fp8_cast}
    if compiled:
        torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, 64)  # a graph per shape
        casts["fp8 compiled casts"] = torch.compile(fp8_cast, dynamic=False)
    rows, totals = {}, dict.fromkeys(["bf16", *casts], 0.0)
    for (m, k, n), count in shapes.items():
        x = torch.randn(m, k, device=device, dtype=torch.bfloat16, requires_grad=True)
        w = (torch.randn(n, k, device=device, dtype=torch.bfloat16) / k**0.5).requires_grad_()
        b = torch.zeros(n, device=device, dtype=torch.bfloat16, requires_grad=True)
        g = torch.randn(m, n, device=device, dtype=torch.bfloat16)
        row = {"count": count, "bf16": attempt(_linear(F.linear, x, w, b, g), repeats)}
        for name, cast in casts.items():
            row[name] = attempt(_linear(lambda *a, cast=cast: Fp8Linear.apply(*a, cast), x, w, b, g), repeats)
        with torch.no_grad():
            exact = F.linear(x, w, b).float()
            error = (Fp8Linear.apply(x, w, b, fp8_cast).float() - exact).norm() / exact.norm()
        row["fp8 relative error"] = error.item()
        for name in totals:
            totals[name] = totals[name] + row[name] * count if isinstance(row[name], float) else None
        rows[f"{m}x{k}x{n}"] = row
    return {"per_shape_ms": rows, "step_total_ms": totals}


def _linear(linear, x, w, b, g):
    return lambda: linear(x, w, b).backward(g)


def report(result: dict) -> str:
    lines = [f"{result['device']} · batch {result['batch']}"]
    if "attention" in result:
        cases = [[case, _ms(ms)] for case, ms in result["attention"].items()]
        lines += md_table(["attention, forward + backward", "ms"], cases, "lr")
    if "linear" in result:
        linear = result["linear"]
        names = list(linear["step_total_ms"])
        rows = [
            [shape, r["count"], *(_ms(r[n]) for n in names), f"{r['fp8 relative error']:.3f}"]
            for shape, r in linear["per_shape_ms"].items()
        ]
        rows.append(["per step", "", *(_ms(linear["step_total_ms"][n]) for n in names), ""])
        lines += md_table(["tokens x in x out", "layers", *names, "fp8 error"], rows, "lr" + "r" * (len(names) + 1))
    return "\n".join(lines)


def _ms(value) -> str:
    return f"{value:.2f}" if isinstance(value, float) else str(value)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.kernels", description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", required=True, help="folder for kernels.json")
    parser.add_argument("--parts", default="attention,linear", help="attention, linear (comma-separated)")
    parser.add_argument("--batch", type=int, default=1600, help="rows of 128/64 tokens (the tuned batch)")
    parser.add_argument("--repeats", type=int, default=8)
    parser.add_argument("--smoke", action="store_true", help="tiny shapes on the CPU (what the tests run)")
    args = parser.parse_args(argv)
    if args.batch < 1 or args.repeats < 1:
        parser.error("--batch and --repeats must be at least 1")
    parts = set(args.parts.split(","))
    if parts - {"attention", "linear"}:
        parser.error(f"unknown parts: {', '.join(sorted(parts - {'attention', 'linear'}))}")
    device = torch.device("cuda" if torch.cuda.is_available() and not args.smoke else "cpu")
    torch.manual_seed(0)
    if args.smoke:  # BlenderBot-400M's proportions, shrunk
        rows, heads, dim, source, target, d, ffn = 4, 2, 8, 16, 8, 32, 128
    else:
        rows, heads, dim, source, target, d, ffn = args.batch, 32, 40, 128, 64, 1280, 5120
    result = {"command": command_line("bench.kernels", argv), "device": device_name(), "batch": rows, **versions()}
    if "attention" in parts:
        result["attention"] = attention_part(rows, heads, dim, source, target, args.repeats, device)
    if "linear" in parts:
        shapes = step_linears(rows, source, target, d, ffn, encoder=2, decoder=12)
        result["linear"] = linear_part(shapes, args.repeats, device, compiled=device.type == "cuda")
    write_json(f"{args.out}/kernels.json", result)
    print(report(result))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
