"""The cost of serving a LoRA adapter: ``python -m bench.chat --adapter``.

For each variant (``--optimize``), two engines load the same base the way the app does: one serves
the base alone, the other attaches a LoRA adapter to its copy (``ChatEngine.swap``, timed: the
attach without reloading the base). Replies are then timed in turns, base and adapter one after
the other for each prompt (which goes first alternates), so both meet the same load on a shared
machine: each figure pairs a base reply with the adapter reply made next to it. Also timed: the
base served by the adapter engine with no adapter active (the base's cost once adapters share it).

The adapter is ``--adapter_path`` (a LoRA adapter of ``--model``) or, by default, one made here
with peft on every projection (``chat.adapters.LORA_TARGETS``) at rank ``--adapter_r``, with
random non-zero weights: a reply costs the same whatever the weights say, and every reply is
forced to ``--reply_tokens`` new tokens anyway.
"""

from __future__ import annotations

import json
import statistics
import tempfile
import time
from dataclasses import replace
from pathlib import Path

import torch
from peft import LoraConfig, get_peft_model

from bench.common import md_table, percentile
from chat.adapters import FINGERPRINT_KEY, LORA_TARGETS, model_fingerprint
from chat.batching import graph_mode
from chat.engine import BASE_PREFIX, GENERATION_PRESETS, ChatEngine, Conversation, load_apart
from chat.layout import FINAL, TRAINING_ARGS_FILE
from chat.lora import ServedLoraLinear
from chat.model import load_model, load_tokenizer, resolve


def make_adapter(spec: str, r: int, root: Path, seed: int = 0, name: str = "bench-lora") -> Path:
    """A LoRA adapter of ``spec`` in peft's layout, as training writes one (``root/NAME/final``);
    each ``seed`` another one."""
    model = load_model(resolve(spec))
    fingerprint = model_fingerprint(model)
    torch.manual_seed(seed)
    config = LoraConfig(r=r, lora_alpha=2 * r, target_modules=list(LORA_TARGETS), init_lora_weights=False)
    peft_model = get_peft_model(model, config)
    with torch.no_grad():  # small B: replies stay words, the cost is the same
        for name, param in peft_model.named_parameters():
            if ".lora_B." in name:
                param.mul_(0.01)
    peft_model.peft_config["default"].base_model_name_or_path = spec
    final = root / name / FINAL
    peft_model.save_pretrained(final, save_embedding_layers=False)  # (no Hub lookup of the base)
    load_tokenizer(resolve(spec)).save_pretrained(final)
    args = {"adapter": "lora", "lora_r": r, "source_prefix": BASE_PREFIX, "max_source_length": 128}
    (final / TRAINING_ARGS_FILE).write_text(json.dumps({**args, FINGERPRINT_KEY: fingerprint}))
    return final


def _timed(engine: ChatEngine, conv: Conversation, message: str, settings) -> tuple[float, float | None, float]:
    """Seconds to the whole reply, to its first text (streaming presets), and the process's CPU
    seconds meanwhile (on a machine others share, CPU time moves less than wall time: with one
    thread, it is the reply's own work)."""
    t0, c0 = time.perf_counter(), time.process_time()
    first = None
    if not settings.streams:
        engine.reply(conv, message, settings)
    else:
        stream = engine.stream(conv, message, settings)
        next(stream)
        first = time.perf_counter() - t0
        for _ in stream:
            pass
    return time.perf_counter() - t0, first, time.process_time() - c0


def bench_adapter(spec: str, variant: str, folder: Path, prompts, reply_tokens: int, repeats: int) -> dict:
    """Base against base + adapter in one variant (``optimize[:graphs]``), interleaved."""
    optimize, _, graphs = variant.partition(":")
    base = ChatEngine(load_apart(spec, optimize=optimize), f"bench {spec}")
    served = ChatEngine(load_apart(spec, optimize=optimize), f"bench {spec} + adapter", batcher=base._batcher)
    if graphs:
        base._batcher.cuda_graphs = graph_mode(graphs)
    t0 = time.perf_counter()
    served.swap(str(folder))  # the base is held: attach only
    attach_s = time.perf_counter() - t0
    adapter, wrapped = served.current, served.base
    assert adapter.model is wrapped.model, "the adapter must share the base model object"
    base.warm_up()
    served.warm_up(adapter)
    served.warm_up(wrapped)
    sides = {"base": (base, None), "adapter": (served, adapter.id), "base_beside_adapters": (served, wrapped.id)}
    result = {
        "optimize": optimize,
        "graphs": base._batcher.cuda_graphs,
        "device": str(wrapped.model.device),
        "attach_seconds": attach_s,
        "adapter_mb": served.base.host.adapter_bytes() / 2**20,
    }
    for name, preset in GENERATION_PRESETS.items():
        settings = replace(preset, min_new_tokens=reply_tokens, max_new_tokens=reply_tokens)
        times: dict[str, list[tuple[float, float | None, float]]] = {side: [] for side in sides}
        for repeat in range(repeats + 1):  # the first round warms up
            for i, (conv, message) in enumerate(prompts):
                order = list(sides) if (i + repeat) % 2 == 0 else list(reversed(sides))
                for side in order:
                    engine, model = sides[side]
                    timing = _timed(engine, replace(conv, model=model), message, settings)
                    if repeat:
                        times[side].append(timing)
        figures = {}
        for side, timings in times.items():
            whole, first = [t for t, _, _ in timings], [f for _, f, _ in timings if f is not None]
            figures[side] = {
                "p50": percentile(whole, 50),
                "p95": percentile(whole, 95),
                "first_text_p50": percentile(first, 50) if first else None,
                "cpu_p50": percentile([c for _, _, c in timings], 50),
            }
        pairs = [a[0] / b[0] for a, b in zip(times["adapter"], times["base"])]
        figures["adapter_overhead_p50"] = figures["adapter"]["p50"] / figures["base"]["p50"] - 1
        figures["adapter_overhead_paired_median"] = statistics.median(pairs) - 1
        figures["adapter_overhead_cpu_p50"] = figures["adapter"]["cpu_p50"] / figures["base"]["cpu_p50"] - 1
        result[name] = figures
    return result


def run(
    spec: str,
    variants: list[str],
    prompts,
    reply_tokens: int,
    repeats: int,
    r: int,
    path: str | None,
    peft: bool = False,
) -> list:
    """``bench_adapter`` for each variant; ``peft``: every LoRA layer through peft's own forward
    (``chat.lora.ServedLoraLinear.lean`` off), to compare with the straight path."""
    ServedLoraLinear.lean = not peft
    try:
        with tempfile.TemporaryDirectory() as tmp:
            folder = Path(path) if path else make_adapter(spec, r, Path(tmp))
            results = [bench_adapter(spec, v, folder, prompts, reply_tokens, repeats) for v in variants]
    finally:
        ServedLoraLinear.lean = True
    for result in results:
        result["lora_forward"] = "peft" if peft else "lean"
    return results


def table(results: list[dict]) -> str:
    header = [
        "variant",
        "attach",
        "adapter MB",
        "fast p50: base → adapter",
        "fast overhead (p50 / paired median / CPU time)",
        "fast: base beside adapters",
        "first text p50: base → adapter",
        "faithful p50: base → adapter",
        "faithful overhead (p50 / paired median / CPU time)",
    ]
    rows = []
    for r in results:
        f, b = r["fast"], r["faithful"]
        rows.append(
            [
                f"{r['optimize']}, graphs {r['graphs']} ({r['device']}), LoRA forward: {r['lora_forward']}",
                f"{r['attach_seconds']:.2f} s",
                f"{r['adapter_mb']:.1f}",
                f"{f['base']['p50']:.3f} → {f['adapter']['p50']:.3f} s",
                f"{100 * f['adapter_overhead_p50']:+.1f}% / {100 * f['adapter_overhead_paired_median']:+.1f}%"
                f" / {100 * f['adapter_overhead_cpu_p50']:+.1f}%",
                f"{f['base_beside_adapters']['p50']:.3f} s",
                f"{f['base']['first_text_p50']:.3f} → {f['adapter']['first_text_p50']:.3f} s",
                f"{b['base']['p50']:.3f} → {b['adapter']['p50']:.3f} s",
                f"{100 * b['adapter_overhead_p50']:+.1f}% / {100 * b['adapter_overhead_paired_median']:+.1f}%"
                f" / {100 * b['adapter_overhead_cpu_p50']:+.1f}%",
            ]
        )
    return "\n".join(md_table(header, rows))
