"""CPU serving optimizations for the chat model, chosen by measurement (docs/cpu-inference-notes.md).

``optimize_for_cpu(model, mode, *, num_threads=None) -> model`` prepares a loaded
``BlenderbotForConditionalGeneration`` (fp32 or bf16, on the CPU) for inference and returns it.
It works in place (no second copy of the weights) and also returns the model, so
``model = optimize_for_cpu(model, "int8")`` reads naturally; after "bf16" or "int8" do not keep
using an fp32 reference to the same object.

Modes (effect measured on a 2-core AMD EPYC with AVX512-BF16/VNNI, torch 2.13, the
blenderbot-400M-distill shape, 64-token prompt, 24-token reply; ``python -m chat.bench_variants``)

``"none"``
    fp32 as trained (a bf16-loaded model is cast back to fp32). The reference: greedy ~1.7 s,
    beam-10 "faithful" ~3.5 s, RSS ~1.6 GiB.
``"bf16"``
    Every weight and activation in bfloat16 (oneDNN AVX512-BF16 kernels). ~2.5x faster than fp32
    (greedy ~0.7 s, beam-10 ~1.2 s), half the weight memory, logits within ~1 % of fp32. The
    first call at each new shape is slow (oneDNN primitive creation): warm up once after loading.
    Loading straight in bf16 (``load_model(path, dtype=torch.bfloat16)``) avoids the transient
    fp32 copy; this function accepts such a model as is.
``"int8"``
    Dynamic int8 quantization of every ``nn.Linear`` (weights int8 with per-output-channel scales,
    activations quantized per call; fbgemm/x86 VNNI kernels) via
    ``torch.ao.quantization.quantize_dynamic``. ~5x faster than fp32 (greedy ~0.33 s, beam-10
    ~0.7 s) and the smallest footprint; logits within ~5 % of fp32 (relative L2 norm on random
    weights), which can flip near-tied beam choices. Embeddings, LayerNorms and attention stay fp32.
    The fastest mode and the CPU default. ``quantize_dynamic`` is *deprecated* (torch.ao says it
    moves to torchao's ``quantize_``) but still present and working in torch 2.13; the deprecation
    warning is silenced here. Quantizing takes ~3 s; peak RSS during it is the fp32 model plus the
    int8 copy being built. Quantized modules are read-only at inference, so concurrent calls from
    several threads are safe (but see threads below).

``num_threads``: sets ``torch.set_num_threads`` (process-wide) when given. With as many threads
as cores (torch's default) a reply is fastest on an idle machine, but OpenMP's busy-waiting makes
it 3-6x slower as soon as anything else competes for a core (another reply generated at the same
time, tests, a tokenizer). One thread per generation degrades gracefully (measured on int8: greedy
0.35-0.42 s busy vs 0.97-1.17 s with 2 threads; beam-10 1.0-1.9 s vs 2.9-4.5 s). So: serialize
generate calls (one at a time, batching concurrent requests) and keep the default, or use
``num_threads=1`` when the CPU is shared.

Tried and not kept: ``torch.compile`` (dynamic shapes: 68 s compile, no gain on bf16 greedy),
``cache_implementation="static"`` (no gain), eager attention instead of SDPA (no difference at
these lengths), int8 weight-only with bf16 activations (``torch._weight_int8pack_mm``, a private
op; between bf16 and int8 on speed and accuracy), keeping ``lm_head`` in fp32 (costs ~15 % of
greedy time for a small accuracy gain).
"""

from __future__ import annotations

import gc
import os
import warnings

import torch
from torch import nn

OPTIMIZE_MODES = ("none", "bf16", "int8")
# Fastest by a wide margin and meets every latency and memory target (docs/cpu-inference-notes.md).
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
        quantize_dynamic(model, {nn.Linear: qconfig}, inplace=True)
    _detach_from_checkpoint_file(model)


def _detach_from_checkpoint_file(model: nn.Module) -> None:
    """Copy the tensors quantization left as they were (embeddings, LayerNorms, final_logits_bias).

    ``from_pretrained`` memory-maps model.safetensors, and the whole mapping stays alive while any
    tensor still points into it. Quantizing reads every weight, so without this the full fp32
    file (1.4 GiB for the 400M model) would stay resident next to the int8 copy.
    """
    seen: set[int] = set()
    for module in model.modules():
        for name, param in module._parameters.items():
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
