"""Evaluation's generate() alone: one batch with the seed's generation settings, variants side by
side in one process, each checked against the first for identical sequences.

    python -m bench.eval_generate --batch 500 --variants fastgen,graphs --profile fastgen --out /tmp/eg

Rows are the sample generator's fixed 128-token sources (``bench.train.write_data``'s "fixed" rows,
as the training benchmark's evaluation uses); every reply is forced to ``--new_tokens`` tokens so
timing does not depend on the (random) weights. Variants:

* ``plain``: transformers' generate() as it comes (its n-gram loops and beam cache);
* ``fastgen``: ``chat.fastgen.fast_kwargs``, what ``finetune.evaluate`` uses (its n-gram
  processors and ``BeamCache``: cross-attention never reordered, self-attention reordered lazily);
* ``graphs``: fastgen plus ``chat.graphs.StepGraphs`` (the decoder step replayed as a CUDA graph);
* ``grouped``: fastgen with beam-grouped cross-attention (``--eval_attention grouped``), its
  keys/values projected and cached once per input rather than once per beam.

``--profile NAME`` profiles that variant's timed call (kernels grouped by kind, ``bench.profile``)
and writes ``profile-NAME.json`` to ``--out``.
"""

from __future__ import annotations

import argparse
import json
import time
from contextlib import nullcontext
from pathlib import Path

import torch

from bench.common import device_name, quiet_transformers, versions, write_json
from bench.profile import idle_gaps, summarize
from bench.train_runs import PREFIX
from chat.fastgen import fast_kwargs, grouped_beams
from chat.graphs import StepGraphs
from chat.model import load_model, load_tokenizer
from finetune.config import TrainConfig
from finetune.evaluate import generation_kwargs


def source_batch(tokenizer, rows: int, device, folder: Path) -> dict:
    """``rows`` fixed-length sources (the training benchmark's "fixed" data), padded to 128."""
    from bench.train import write_data

    if not (folder / "fixed_train.jsonl").exists():
        write_data(folder, smoke=tokenizer.vocab_size < 8000)
    lines = (folder / "fixed_train.jsonl").read_text().splitlines()
    texts = [json.loads(lines[i % len(lines)])["texts"] for i in range(rows)]
    batch = tokenizer(
        [PREFIX + t for t in texts], max_length=128, truncation=True, padding="max_length", return_tensors="pt"
    )
    return {k: v.to(device) for k, v in batch.items()}


def run(model, batch, kwargs: dict, variant: str, graphs: StepGraphs) -> torch.Tensor:
    ids = batch["input_ids"]
    step = graphs.decoding(model, ids, kwargs) if variant == "graphs" else nullcontext({})
    grouped = grouped_beams(model, kwargs["num_beams"]) if variant == "grouped" else nullcontext()
    with torch.inference_mode(), step as cache, grouped:
        gen = kwargs if variant == "plain" else fast_kwargs({**kwargs, **cache}, ids)
        return model.generate(**batch, **gen)


def sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def profiled(fn, out: Path, name: str):
    activities = [torch.profiler.ProfilerActivity.CPU]
    activities += [torch.profiler.ProfilerActivity.CUDA] if torch.cuda.is_available() else []
    sync()
    start = time.perf_counter()
    with torch.profiler.profile(activities=activities) as prof:
        result = fn()
        sync()
    wall_ms = (time.perf_counter() - start) * 1000
    kernels, spans, cpu = {}, [], {}
    for e in prof.events():
        if e.device_type == torch.autograd.DeviceType.CUDA:
            kernels[e.name] = kernels.get(e.name, 0.0) + e.device_time / 1000
            spans.append((e.time_range.start, e.time_range.end, e.name))
        elif not e.cpu_children:
            cpu[e.name] = cpu.get(e.name, 0.0) + e.self_cpu_time_total / 1000
    report = summarize(kernels, wall_ms, 1)
    report["kernels"] = len(spans)
    report["idle_gaps"] = idle_gaps(spans)
    report["top_cpu_ms"] = sorted(cpu.items(), key=lambda kv: -kv[1])[:25]
    write_json(out / f"profile-{name}.json", report)
    return result


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.eval_generate", description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="random-400M")
    parser.add_argument("--batch", type=int, default=500, help="rows per generate() call (the tuned eval batch)")
    parser.add_argument("--new_tokens", type=int, default=64, help="forced reply length (the seed's max target)")
    parser.add_argument(
        "--variants", default="fastgen,grouped", help="comma-separated: plain, fastgen, graphs, grouped"
    )
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
    parser.add_argument("--attention", default="eager", help="the evaluation attention (TrainConfig.eval_attention)")
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--profile", default="", help="variant to profile (one more timed call)")
    parser.add_argument("--out", default="/tmp/bench-eval-generate")
    args = parser.parse_args(argv)
    quiet_transformers()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    tokenizer = load_tokenizer(args.model)
    model = load_model(args.model, dtype=getattr(torch, args.dtype)).to(device).eval()
    model.set_attn_implementation(args.attention)
    batch = source_batch(tokenizer, args.batch, device, out / "data")
    cfg = TrainConfig(val_max_target_length=args.new_tokens, val_min_target_length=args.new_tokens)
    kwargs = generation_kwargs(cfg)
    graphs = StepGraphs()
    results, first = {}, None
    for variant in args.variants.split(","):
        run(model, {k: v[:2] for k, v in batch.items()}, kwargs, variant, StepGraphs())  # warm-up, small
        times = []
        for _ in range(args.repeats):
            sync()
            start = time.perf_counter()
            seqs = run(model, batch, kwargs, variant, graphs)
            sync()
            times.append(time.perf_counter() - start)
        if variant == args.profile:
            profiled(lambda v=variant, g=graphs: run(model, batch, kwargs, v, g), out, variant)
        first = seqs if first is None else first
        rows_same = float((seqs == first).all(-1).float().mean()) if seqs.shape == first.shape else 0.0
        results[variant] = {
            "seconds": min(times),
            "all_seconds": times,
            "rows_per_s": args.batch / min(times),
            "rows_same_as_first": rows_same,
            "graph_replays": graphs.replays if variant == "graphs" else None,
            "peak_gib": torch.cuda.max_memory_allocated() / 2**30 if device == "cuda" else None,
        }
        print(variant, json.dumps(results[variant]), flush=True)
        del seqs
        graphs = StepGraphs()  # frees the graphed variant's caches before the next variant
        if device == "cuda":
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats()
    env = versions()
    header = (
        f"{args.model} {args.dtype}, batch {args.batch} x {kwargs['num_beams']} beams, "
        f"{args.new_tokens} tokens, {device_name()}"
    )
    write_json(
        out / "eval_generate.json", {"header": header, "environment": env, "args": vars(args), "results": results}
    )
    print(header)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
