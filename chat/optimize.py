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
    it gets alone, all rows in one kernel call (``rows_apart``, ``int8_call``). The projections
    that read one input (an attention's query, key and value) are one int8 call (``share_inputs``:
    the same numbers, fewer calls). The quantized modules are read-only at inference: concurrent
    calls from several threads are safe, if slow (see below).

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
import itertools
import os
import threading
import warnings
from array import array
from contextlib import contextmanager

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
    holds (an int8 model is never saved).

    ``columns``: this layer's (start, stop) output columns of ``quantized``, a module it shares with
    the layers that read the same input (``share_inputs``); None when the module is its own."""

    def __init__(self, quantized: nn.Module, columns: tuple[int, int] | None = None):
        nn.Module.__init__(self)  # not nn.Linear's: it would allocate an fp32 weight
        self.in_features = quantized.in_features
        self.out_features = quantized.out_features if columns is None else columns[1] - columns[0]
        self.weight = nn.Parameter(torch.empty(0), requires_grad=False)
        self.bias = None  # the bias is packed with the int8 weight
        self.__dict__["quantized"] = quantized
        self.__dict__["columns"] = columns

    @classmethod
    def from_float(cls, mod: nn.Linear, use_precomputed_fake_quant: bool = False) -> Int8Linear:
        """``quantize_dynamic``'s hook: torch.ao quantizes ``mod``, this wraps the result."""
        from torch.ao.nn.quantized.dynamic import Linear as DynamicLinear

        return cls(DynamicLinear.from_float(mod, use_precomputed_fake_quant=use_precomputed_fake_quant))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.columns is None:
            return int8_call(self.quantized, x)
        return _shared_call(self.quantized, x, self.columns)

    def int8_bytes(self) -> int:
        """Bytes of this layer's int8 weight (biases and scales are small)."""
        return self.in_features * self.out_features

    def extra_repr(self) -> str:
        shared = "" if self.columns is None else f", columns {self.columns[0]}:{self.columns[1]} of a shared call"
        return f"in_features={self.in_features}, out_features={self.out_features}, int8 (dynamic){shared}"


def share_inputs(model: nn.Module) -> int:
    """Make the int8 projections that read one input one after another a single int8 call each time:
    an attention's query, key and value, and a cross-attention's (``encoder_attn``, BART's and
    BlenderBot's name) key and value. Their int8 weights become the rows of one weight (per-channel
    scales: each output column is computed exactly as before, bit for bit); the first of them called
    on a tensor computes every column, the others take their columns of that result. Inside
    ``rows_apart`` a row's quantizing (``int8_call``) is then done once per input, not per projection:
    on two CPU cores 24 fewer quantized calls of the 97 in a 400M decoder step. Returns the groups made."""
    cross = {id(m.encoder_attn) for m in model.modules() if isinstance(getattr(m, "encoder_attn", None), nn.Module)}
    made = 0
    for module in model.modules():
        names = ("k_proj", "v_proj") if id(module) in cross else ("q_proj", "k_proj", "v_proj")
        layers = [getattr(module, name, None) for name in names]
        if not all(isinstance(layer, Int8Linear) and layer.columns is None for layer in layers):
            continue
        fused = _fused([layer.quantized for layer in layers])
        if fused is None:
            continue
        bounds = list(itertools.accumulate((layer.out_features for layer in layers), initial=0))
        fused.__dict__["_parts"] = frozenset(zip(bounds, bounds[1:]))
        for layer, columns in zip(layers, zip(bounds, bounds[1:])):
            layer.__dict__["quantized"], layer.__dict__["columns"] = fused, columns
        made += 1
    return made


def _fused(parts: list[nn.Module]) -> nn.Module | None:
    """One torch.ao dynamic int8 linear whose output columns are ``parts``' in order; None unless
    they read the same features and have per-channel weights without zero points."""
    from torch.ao.nn.quantized.dynamic import Linear as DynamicLinear

    weights = [part.weight() for part in parts]
    if len({part.in_features for part in parts}) != 1 or any(
        w.qscheme() != torch.per_channel_affine or w.q_per_channel_axis() != 0 or w.q_per_channel_zero_points().any()
        for w in weights
    ):
        return None
    weight = torch._make_per_channel_quantized_tensor(
        torch.cat([w.int_repr() for w in weights]),
        torch.cat([w.q_per_channel_scales() for w in weights]),
        torch.cat([w.q_per_channel_zero_points() for w in weights]),
        0,
    )
    biases = [part.bias() for part in parts]
    bias = None
    if any(b is not None for b in biases):
        bias = torch.cat([torch.zeros(len(w)) if b is None else b.detach().float() for b, w in zip(biases, weights)])
    fused = DynamicLinear(parts[0].in_features, weight.shape[0], dtype=torch.qint8)
    fused.set_weight_bias(weight, bias)
    return fused


# The last shared call's result in this thread, for the layers that take their columns of it next:
# (module, input, rows_apart's setting, result, the columns not yet taken).
_SHARED = threading.local()


def _shared_call(quantized: nn.Module, x: torch.Tensor, columns: tuple[int, int]) -> torch.Tensor:
    """``columns`` of ``int8_call(quantized, x)``, computed once for the layers sharing ``quantized``
    when they are called on the same tensor one after another (as attention calls them). Each
    layer's columns are handed out once per result (a layer called twice, or called on another
    tensor, computes afresh), so no caller sees columns another caller changed in place."""
    apart = _ROWS_APART.get()
    last = getattr(_SHARED, "last", None)
    if last is not None and last[0] is quantized and last[1] is x and last[2] == apart and columns in last[4]:
        out = last[3]
        last[4].discard(columns)
        if not last[4]:
            _SHARED.last = None
    else:
        out = int8_call(quantized, x)
        _SHARED.last = (quantized, x, apart, out, set(quantized.__dict__["_parts"]) - {columns})
    return out[..., columns[0] : columns[1]]


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
    special case."""
    columns = _row_columns(x2, groups)
    if columns is None:
        return None
    (scale, _, _), (zero, inverse) = columns[0][:, :, None], columns[1][:, :, None].float()
    return scale, zero, inverse


def _row_columns(x2: torch.Tensor, groups: tuple[int, ...] | None) -> tuple[torch.Tensor, torch.Tensor] | None:
    """``row_qparams`` for ``int8_call``: each row's scale, ``1 - scale`` and ``-scale * zero`` (its
    rescaling) as the float32 rows of one tensor, its zero point and inverse scale (its quantizing)
    as the float64 rows of another, a column per row of ``x2``. aten's ChooseQuantizationParams in
    plain Python: its doubles are Python floats, its float32 roundings ``array("f")``'s (a loop over
    a step's few rows costs microseconds where tensor or numpy operations cost tens; torch.aminmax
    is several times slower than amin and amax)."""
    low, high = x2.amin(1).tolist(), x2.amax(1).tolist()
    if groups:  # a group's range is its rows'
        bounds = list(itertools.accumulate(groups, initial=0))
        low = [min(low[a:b]) for a, b in zip(bounds, bounds[1:])]
        high = [max(high[a:b]) for a, b in zip(bounds, bounds[1:])]
    low, high = [min(v, 0.0) for v in low], [max(v, 0.0) for v in high]
    scales = array("f", [(hi - lo) / QMAX for lo, hi in zip(low, high)]).tolist()  # aten keeps the float32
    if min(scales) < SMALL_SCALE:
        return None
    zeros = []
    for lo, hi, scale in zip(low, high, scales):
        # aten takes the zero point from the end whose term is smaller: -|lo / s| < QMAX - |hi / s|
        # (lo <= 0 <= hi here, so that is from_min's negation against from_max).
        from_min, from_max = -lo / scale, QMAX - hi / scale
        zero = from_min if -from_min < from_max else from_max
        zeros.append(round(min(max(zero, 0.0), QMAX)))  # Python's round: half to even, as aten's
    # 1 / scale in doubles rounded to float32 is the float32 division fbgemm makes (double rounding
    # is exact for a division when the wider format has over twice the bits).
    inverses = array("f", [1.0 / scale for scale in scales]).tolist()
    rescale = [scales, [1.0 - s for s in scales], [-s * z for s, z in zip(scales, zeros)]]
    quantize = [zeros, inverses]
    if groups:  # each group's values for each of its rows
        rescale, quantize = (
            [[v for v, n in zip(c, groups) for _ in range(n)] for c in cs] for cs in (rescale, quantize)
        )
    return torch.tensor(rescale), torch.tensor(quantize, dtype=torch.float64)


def _row_terms(quantized: nn.Module) -> torch.Tensor | None:
    """The layer's bias and its weight's per-output-channel sums times their scales (what a row's
    zero point subtracts), as the rows of one (2, out) tensor computed once per layer; None for
    weights with zero points (not handled)."""
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
        terms = torch.stack([bias, weight.int_repr().float().sum(1) * scales]) if ok else False
        quantized.__dict__["_row_terms"] = terms
    return None if terms is False else terms


def int8_call(quantized: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """``quantized(x)`` (torch.ao's dynamic int8 linear); inside ``rows_apart``, each row (or group
    of rows) quantized on its own, still in one call of the kernel.

    Each row is scaled and shifted onto the grid it would be quantized to alone (``row_qparams``;
    x / scale + zero point as fbgemm computes it for a row alone: one fused multiply-add); the int8
    kernel then rounds it (half to even) and clamps it to 0..255 as it does a row alone, and
    multiplies those integers (torch's quantized linear with the input's scale 1 and zero point 0);
    each row's output is scaled back and its zero point's share (weight sums x zero point) taken
    off. The integers multiplied are those of the row alone (chat/tests: but where the zero point
    itself is on a rounding tie); the float rescaling differs from the kernel's only in rounding
    (about 1e-6 of the output's size). Rows whose scale needs aten's small-scale case, and int8
    engines without that kernel, go one call per row (or group)."""
    apart = _ROWS_APART.get()
    groups = None if apart is True else apart
    if not apart or x.shape[0] == 1 or (groups is not None and len(groups) == 1):
        return quantized(x)
    if groups is not None and sum(groups) != x.shape[0]:
        raise ValueError(f"row groups {groups} do not add up to the input's {x.shape[0]} rows")
    terms = _row_terms(quantized)
    columns = _row_columns(x.reshape(x.shape[0], -1), groups) if terms is not None else None
    out = None
    if columns is not None:  # columns of a value per row, broadcast over the row's positions
        shape = (x.shape[0],) + (1,) * (x.dim() - 1)
        (scale, keep, take), (zero, inverse) = columns[0].view(3, *shape), columns[1].view(2, *shape)
        # x * inverse + zero rounded once, as fbgemm's fused multiply-add: the float64 product of two
        # float32 is exact, and its sum with the integer zero point rounds (float64, then float32)
        # to the fused result but within 2^-53 of a float32 half-way point.
        out = _on_grid(quantized, torch.addcmul(zero, x, inverse).float())
    if out is None:
        bounds = list(itertools.accumulate(groups or (1,) * x.shape[0], initial=0))
        return torch.cat([quantized(x[a:b]) for a, b in zip(bounds, bounds[1:])])
    # out = bias + weight sums . grid; the row alone: bias + scale * weight sums . (grid - zero),
    # = scale * out + (1 - scale) * bias - scale * zero * weight sums (keep = 1 - scale, take = -scale * zero).
    bias, sums = terms
    return torch.addcmul(torch.addcmul(bias * keep, take, sums), scale, out)


def _on_grid(quantized: nn.Module, grid: torch.Tensor) -> torch.Tensor | None:
    """The int8 product of ``grid`` quantized with scale 1 and zero point 0 (rounded half to even,
    clamped to 0..255), bias added: fbgemm's (the x86 and fbgemm engines') quantized linear with
    float input and output; None where the int8 engine has no such kernel."""
    try:
        return torch.ops.quantized.linear_with_input_q_dq_qweight_dq_output_fp32(
            grid, 1.0, 0, quantized._packed_params._packed_params
        )
    except (RuntimeError, NotImplementedError, AttributeError):
        return None


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
    share_inputs(model)
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
