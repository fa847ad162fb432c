"""CPU serving optimizations for the chat model, chosen by measurement (docs/cpu-inference-notes.md).

``optimize_for_cpu(model, mode, *, num_threads=None) -> model`` prepares a loaded
``BlenderbotForConditionalGeneration`` (fp32 or bf16, on the CPU) for inference and returns it.
It works in place (no second copy of the weights) and also returns the model, so
``model = optimize_for_cpu(model, "int8")`` reads naturally; after "bf16" or "int8" do not keep
using an fp32 reference to the same object.

Modes (measured with ``python -m bench.cpu_variants --repeats 2`` on a 2-core AMD EPYC with
AVX512-BF16/VNNI, torch 2.13, the blenderbot-400M-distill shape with random weights, 64-token
prompt, 24-token reply; p50 of 16; greedy streamed through TextIteratorStreamer; idle machine.
Full table and caveats: docs/cpu-inference-notes.md)

``"none"``
    fp32 as trained (a bf16-loaded model is cast back to fp32). Greedy 1.74 s, beam-10 "faithful"
    3.91 s, first token 0.15 s. RSS 1.86 GiB, of which 1.47 GiB is the memory-mapped checkpoint.
``"bf16"``
    Every weight and activation in bfloat16 (oneDNN AVX512-BF16 kernels). Greedy 0.87 s (2.0x),
    beam-10 1.45 s (2.7x), first token 0.07 s; RSS 1.15 GiB. Logits within 1.2 % of fp32 (relative
    L2), teacher-forced top-1 99 %. The first call at each new shape is slow (oneDNN primitive
    creation): warm up once after loading. Peak RSS while converting: 2.43 GiB (the fp32 file pages
    plus the bf16 copy).
``"int8"``
    Dynamic int8 quantization of every ``nn.Linear`` (weights int8 with per-output-channel scales,
    activations quantized on the fly per call; fbgemm/x86 VNNI kernels) via
    ``torch.ao.quantization.quantize_dynamic``; embeddings, LayerNorms and attention stay fp32.
    Greedy 0.48 s (3.6x; 0.39 s with ``num_threads=1``), beam-10 0.78 s (5.0x), first token 0.04 s;
    RSS 0.92 GiB. Each quantized layer is an ``Int8Linear``: torch's dynamic int8 module inside an
    ``nn.Linear`` shell, so peft wraps it with LoRA like any Linear (the adapter's A and B stay fp32
    next to the int8 weight; see ``Int8Linear``). Logits within 4.6 % of fp32, teacher-forced top-1
    93 % on random weights (where top choices are near ties); on the trained demo model 7/8 greedy
    and 8/8 beam replies equal fp32's. Quantizing takes ~3.5 s; peak RSS while quantizing 2.22 GiB
    (1.47 GiB of it the checkpoint's file pages, which the kernel can drop). Caveats:
    ``quantize_dynamic`` is *deprecated* (torch.ao says to move to torchao's ``quantize_``) but
    present and working in torch 2.13 (its warnings are silenced here). Activations are quantized
    with one scale per call over the whole batch, so a row's result depends on the other rows:
    batching different requests together in one call would change their replies: chat/batching.py
    serves int8 requests alone, and chat.stepping's decoder steps quantize each row with the scale
    it gets alone, all rows in one kernel call (``rows_apart``, ``int8_call``). The quantized
    modules are read-only at inference: concurrent calls from several
    threads are safe, if slow (see below).

``num_threads`` sets ``torch.set_num_threads`` (process-wide) when given. torch's default (one
thread per core) is fastest for beam search on an idle machine, but OpenMP's busy-waiting makes
it several times slower as soon as anything else wants a core, including the consumer thread of
a streamer: streamed int8 greedy takes 0.45 s with 2 threads vs 0.37 s with 1 (unstreamed 0.31 vs
0.37 s). With one core taken by another process, int8 with 2 threads: greedy 0.92 s, beam-10 3.5 s;
with 1 thread: 0.73 s and 1.18 s. So run one generate at a time, and use 1 thread for streamed
greedy replies and whenever the CPU is shared.

Tried and not kept: ``torch.compile`` (dynamic shapes: 68 s to compile, no gain on bf16 greedy),
``cache_implementation="static"`` (no gain), eager attention instead of SDPA (no difference at
these lengths), int8 weight-only with bf16 activations (``torch._weight_int8pack_mm``, a private
op, or torchao's ``Int8WeightOnlyConfig``: between bf16 and int8 on speed and accuracy), keeping
``lm_head`` in fp32 (logits error 4.6 % -> 4.3 %, for an fp32 8008x1280 product per step).
"""

from __future__ import annotations

import contextvars
import gc
import os
import warnings
from contextlib import contextmanager

import numpy
import torch
from torch import nn

OPTIMIZE_MODES = ("none", "bf16", "int8")
# The engine's default mode on a CPU (CHAT_OPTIMIZE overrides it): ~2x faster per reply than bf16
# and the only mode that keeps the latency targets when the CPU is shared; served unbatched.
# The measured trade-off: docs/cpu-inference-notes.md.
CPU_DEFAULT = "int8"

_MARK = "_cpu_optimization"


def optimize_for_cpu(model: nn.Module, mode: str, *, num_threads: int | None = None) -> nn.Module:
    """Prepare ``model`` for CPU inference in ``mode`` ("none", "bf16" or "int8"); returns it.

    In place; puts the model in eval mode without gradients. Raises ``ValueError`` for an unknown
    mode, a model not on the CPU, or a model already optimized in a different mode (calling again
    with the same mode is a no-op). ``num_threads``: see the module docstring.
    """
    if mode not in OPTIMIZE_MODES:
        raise ValueError(f"mode must be one of {', '.join(OPTIMIZE_MODES)}, got {mode!r}")
    if num_threads is not None:
        if num_threads < 1:
            raise ValueError(f"num_threads must be >= 1, got {num_threads}")
        torch.set_num_threads(num_threads)
    done = getattr(model, _MARK, None)
    if done == mode:
        return model
    if done is not None:
        raise ValueError(f"model was already optimized for {done!r}; load it again to use {mode!r}")
    devices = {t.device.type for t in list(model.parameters()) + list(model.buffers())}
    if devices - {"cpu"}:
        raise ValueError(f"optimize_for_cpu needs a model on the CPU, found {', '.join(sorted(devices))}")

    model.eval()
    model.requires_grad_(False)
    if mode == "none":
        model.to(torch.float32)
    elif mode == "bf16":
        model.to(torch.bfloat16)
    else:
        model.to(torch.float32)  # dynamic quantization starts from fp32 weights
        _quantize_int8(model)
    setattr(model, _MARK, mode)
    gc.collect()  # free replaced tensors now (and with them the checkpoint's memory map)
    return model


class Int8Linear(nn.Linear):
    """A linear layer computed by torch's dynamic int8 module (``torch.ao``), shaped as an ``nn.Linear``.

    torch.ao's module is not an ``nn.Linear`` (its ``weight`` is a method returning the packed int8
    weight), so peft cannot put a LoRA adapter beside it, and ``load_state_dict`` of any partial
    state dict (an adapter's) fails inside it. As an ``nn.Linear`` with an empty fp32 ``weight``
    placeholder, peft wraps it like any other Linear: the adapter's A and B are created, loaded and
    kept in fp32 on the CPU (the placeholder's device and dtype), and the product stays int8. The
    torch.ao module is held outside ``_modules``: it is an implementation detail no state dict
    holds (an int8 model is never saved)."""

    def __init__(self, quantized: nn.Module):
        nn.Module.__init__(self)  # not nn.Linear's: it would allocate an fp32 weight
        self.in_features, self.out_features = quantized.in_features, quantized.out_features
        self.weight = nn.Parameter(torch.empty(0), requires_grad=False)
        self.bias = None  # the bias is packed with the int8 weight
        self.__dict__["quantized"] = quantized

    @classmethod
    def from_float(cls, mod: nn.Linear, use_precomputed_fake_quant: bool = False) -> Int8Linear:
        """``quantize_dynamic``'s hook: torch.ao quantizes ``mod``, this wraps the result."""
        from torch.ao.nn.quantized.dynamic import Linear as DynamicLinear

        return cls(DynamicLinear.from_float(mod, use_precomputed_fake_quant=use_precomputed_fake_quant))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return int8_call(self.quantized, x)

    def int8_bytes(self) -> int:
        """Bytes of the packed int8 weight (biases and scales are small)."""
        return self.quantized.weight().numel()

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, int8 (dynamic)"


# Inside ``rows_apart``: int8 layers quantize each row's (or group of rows') activations on their
# own (chat.stepping). True: every row apart; a tuple: the sizes of consecutive groups of rows.
_ROWS_APART = contextvars.ContextVar("int8_rows_apart", default=False)


@contextmanager
def rows_apart(groups: tuple[int, ...] | None = None):
    """Int8 layers called inside quantize every row (first dimension) of their input with its own
    scale and zero point, exactly those the row gets when served alone. (One plain call for the
    whole batch would scale all rows by the largest activation of any: a reply would depend on the
    requests beside it.) ``groups``: sizes of consecutive runs of rows quantized together instead,
    as one request's beams are when it is served alone (generate() runs its beams as one batch).
    ``int8_call`` says how, in one call of the int8 kernel for all rows."""
    token = _ROWS_APART.set(True if groups is None else tuple(groups))
    try:
        yield
    finally:
        _ROWS_APART.reset(token)


# torch's dynamic int8 linear (fbgemm, reduce_range=True) quantizes its input to 0..QMAX with one
# (scale, zero point) from the input's min and max, as aten's ChooseQuantizationParams chooses them.
QMAX = 127
SMALL_SCALE = 1e-4  # below this aten changes the min/max it chose (its 6.1e-5 cut-off): rows go one by one


def row_qparams(
    x2: torch.Tensor, groups: tuple[int, ...] | None = None
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None:
    """Each row's (scale, zero point) as ``torch.ops.quantized.linear_dynamic`` would choose them for
    that row alone (or for its group of ``groups`` alone), and the float32 reciprocal of the scale
    that its quantizing multiplies by, as float32 columns; None where a row needs aten's small-scale
    special case. (Python floats are IEEE doubles like aten's: a loop over a step's few rows costs
    microseconds, where the same arithmetic as tensor operations cost tens.)"""
    low, high = x2.amin(1).tolist(), x2.amax(1).tolist()  # (torch.aminmax is several times slower here)
    sizes = groups or (1,) * len(low)
    columns: list[list[float]] = [[], [], []]
    start = 0
    for size in sizes:
        lo, hi = min(0.0, *low[start : start + size]), max(0.0, *high[start : start + size])
        start += size
        scale = numpy.float32((hi - lo) / QMAX)  # aten keeps the float32 value
        if scale < SMALL_SCALE:
            return None
        from_min, from_max = -lo / float(scale), QMAX - hi / float(scale)
        zero = from_min if -abs(lo / float(scale)) < QMAX - abs(hi / float(scale)) else from_max
        for column, value in zip(columns, (scale, round(min(max(zero, 0.0), QMAX)), numpy.float32(1.0) / scale)):
            column += [value] * size  # zero: Python's round, half to even; inverse: a float32 division, as fbgemm's
    scale, zero, inverse = torch.tensor(numpy.array(columns, dtype=numpy.float32))[:, :, None]
    return scale, zero, inverse


def _row_terms(quantized: nn.Module) -> tuple[torch.Tensor, torch.Tensor | None] | None:
    """The weight's per-output-channel sums times its scales (what a row's zero point subtracts)
    and the bias, computed once per layer; None for weights with zero points (not handled)."""
    terms = quantized.__dict__.get("_row_terms")
    if terms is None:
        weight = quantized.weight()
        if weight.qscheme() in (torch.per_channel_affine, torch.per_channel_symmetric):
            scales, zeros = weight.q_per_channel_scales().float(), weight.q_per_channel_zero_points()
        else:
            scales, zeros = torch.tensor(weight.q_scale()), torch.tensor(weight.q_zero_point())
        ok = not bool(zeros.any())
        bias = quantized.bias()
        bias = torch.zeros(weight.shape[0]) if bias is None else bias.detach().float()
        terms = (weight.int_repr().float().sum(1) * scales, bias) if ok else False
        quantized.__dict__["_row_terms"] = terms
    return terms or None


def int8_call(quantized: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """``quantized(x)`` (torch.ao's dynamic int8 linear); inside ``rows_apart``, each row (or group
    of rows) quantized on its own, still in one call of the kernel.

    Each row goes onto the integer grid it would be quantized to alone (``row_qparams``), one more
    row holding 0 and QMAX makes the kernel's own choice for the batch exactly scale 1, zero point
    0 (so it quantizes the grid to itself), and each row's output is scaled back and its zero
    point's share (weight sums x zero point) taken off. The integers multiplied are those of the
    row alone; the float rescaling differs from the kernel's only in rounding (about 1e-6 of the
    output's size: chat/tests). Rows whose scale needs aten's small-scale case go one call each."""
    apart = _ROWS_APART.get()
    groups = None if apart is True else apart
    if not apart or x.shape[0] == 1 or (groups is not None and len(groups) == 1):
        return quantized(x)
    if groups is not None and sum(groups) != x.shape[0]:
        raise ValueError(f"row groups {groups} do not add up to the input's {x.shape[0]} rows")
    terms = _row_terms(quantized)
    x2 = x.reshape(x.shape[0], -1)
    qparams = row_qparams(x2, groups) if terms is not None else None
    if qparams is None:
        bounds = numpy.cumsum([0, *(groups or (1,) * x.shape[0])]).tolist()
        return torch.cat([quantized(x[a:b]) for a, b in zip(bounds, bounds[1:])])
    (scale, zero, inverse), (sums, bias) = qparams, terms
    grid = (x2 * inverse).add_(zero).round_().clamp_(0, QMAX).reshape(x.shape)
    pin = grid.new_zeros((1, *x.shape[1:]))
    pin.view(-1)[0] = QMAX
    out = quantized(torch.cat([grid, pin]))[:-1]
    # out = bias + weight sums . grid; the row alone: bias + scale * weight sums . (grid - zero)
    view = (x.shape[0],) + (1,) * (out.dim() - 1)
    scale, zero = scale.view(view), zero.view(view)
    offset = torch.addcmul(bias, scale, torch.addcmul(bias, zero, sums), value=-1)  # bias - s (bias + z sums)
    return torch.addcmul(offset, scale, out)


def _quantize_int8(model: nn.Module) -> None:
    from torch.ao.quantization import default_dynamic_qconfig, per_channel_dynamic_qconfig, quantize_dynamic

    # Per-channel weight scales: ~10 % lower error than per-tensor at the same speed on x86/fbgemm.
    per_channel = torch.backends.quantized.engine in ("x86", "fbgemm", "onednn")
    qconfig = per_channel_dynamic_qconfig if per_channel else default_dynamic_qconfig
    for module in model.modules():  # the int8 modules keep the bias tensor itself: see below
        if isinstance(module, nn.Linear) and module.bias is not None:
            module.bias.data = module.bias.data.clone()
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=r"torch\.ao\.quantization is deprecated")
        warnings.filterwarnings("ignore", message=r"torch\.quantize_per_tensor, torch\.quantize_per_channel")
        quantize_dynamic(model, {nn.Linear: qconfig}, mapping={nn.Linear: Int8Linear}, inplace=True)
    _detach_from_checkpoint_file(model)


def _detach_from_checkpoint_file(model: nn.Module) -> None:
    """Copy the tensors quantization left as they were (embeddings, LayerNorms, final_logits_bias).

    ``from_pretrained`` memory-maps model.safetensors, and the whole mapping stays alive while any
    tensor still points into it. Quantizing reads every weight, so without this the full fp32
    file (1.4 GiB for the 400M model) would stay resident next to the int8 copy.
    """
    seen: set[int] = set()
    for module in model.modules():
        for param in module._parameters.values():
            if param is not None and id(param) not in seen:
                seen.add(id(param))
                param.data = param.data.clone()
        for name, buf in list(module._buffers.items()):
            if buf is not None and id(buf) not in seen:
                clone = buf.clone()
                seen.add(id(clone))
                module._buffers[name] = clone
    gc.collect()  # the replaced fp32 modules sit in reference cycles that still hold the mapping


def optimization_of(model: nn.Module) -> str | None:
    """The mode ``optimize_for_cpu`` applied to ``model``, or None."""
    return getattr(model, _MARK, None)


def memory_mib() -> dict[str, float]:
    """This process's resident memory in MiB: ``rss`` now, ``peak`` (high-water mark) so far, and
    of ``rss`` the ``anon`` part (heap: real allocations) and the ``file`` part (memory-mapped
    files, e.g. an fp32 checkpoint still mapped; the kernel can drop those pages under pressure).

    Reads /proc/self/status on Linux, else psutil (there only ``rss`` is known; the rest are 0).
    """
    try:
        with open("/proc/self/status") as fh:
            fields = dict(line.split(":", 1) for line in fh if ":" in line)

        def mib(key: str) -> float:
            return int(fields[key].split()[0]) / 1024 if key in fields else 0.0

        return {"rss": mib("VmRSS"), "peak": mib("VmHWM"), "anon": mib("RssAnon"), "file": mib("RssFile")}
    except (OSError, ValueError):
        import psutil

        return {"rss": psutil.Process(os.getpid()).memory_info().rss / 2**20, "peak": 0.0, "anon": 0.0, "file": 0.0}
