"""Training and evaluation benchmark: the seed's recipe and the project's defaults, side by side.

    python -m bench.train --out runs/bench                 # every GPU of this machine
    python -m bench.train --out runs/bench --parts maxbatch,scaling
    python -m bench.train --smoke --out /tmp/bench         # CPU, tiny model, about a minute (CI)

Every measurement is a run of the project's own CLI (``accelerate launch ... -m finetune``),
so it times exactly what users run. Two recipes, always in the same invocation:

* ``seed``: the seed's ZeRO-2 JSON (fp16, torch Adam and WarmupDecayLR inside DeepSpeed), every
  row padded to 128/64, transformers' own n-gram blocking, no loader workers;
* ``tuned``: the project's defaults (configs/ds_zero2.json, bf16, fused AdamW, per-batch padding,
  tensorized n-gram blocking, loader workers).

Data: ``fixed`` rows are longer than 128/64 tokens, so every row is truncated to exactly the
seed's lengths and padding cannot matter; ``realistic`` rows come from the sample-data generator
(about 28 words of source and 10 of reply per row, close to MuDoConv's 26 / 10). The model is
the 400M architecture with random weights (``random-400M``): timing does not depend on weight
values when lengths are fixed, and a random model must not decide reply lengths, so evaluation
forces every reply to the full 64 tokens (min = max length) in both recipes.

Beside the CLI runs, ``seed compute`` (``bench/train_compute.py``) runs the seed's DeepSpeed JSON
and optimizer on batches already on the GPU, with no loader: every ratio also has that baseline.

Parts: ``train`` (samples/s, seconds per 10,000-sample epoch, peak memory, MFU, time to the
first logged step, evaluation of 1,000 rows with the seed's generation settings; seed, seed
compute and tuned), ``levers`` (tuned compute with one change each: DeepSpeed buckets, torch.compile
per layer; the seed's JSON in bf16), ``zero`` (tuned compute with other ZeRO settings for one GPU:
no side stream, stage 1, stage 0), ``profile`` (seed and tuned compute with their GPU time by
kernel kind, and tuned compute with the whole model compiled), ``attention`` (tuned compute with
each attention kernel, profiled), ``alloc`` (the allocator's expandable segments, compute and CLI), ``auto``
(``--per_device_train_batch_size auto``: the CLI and its compute),
``memory`` (second batch sizes for the memory model, finetune/memory.py), ``realistic`` (seed,
tuned, and tuned without packing),
``maxbatch`` (largest micro-batch per GPU: each probe is a short run; an out-of-memory probe
ends cleanly with the CLI's own error and the next size is tried) and ``scaling`` (1 GPU vs all).
Results: ``OUT/results.json`` and ``OUT/results.md``.

This file plans the runs, writes their data and searches the largest batch; one run (its
command line and numbers) is ``bench/train_runs.py``, the ratios and results.md ``bench/train_report.py``.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import random
import statistics
import sys
import time
from dataclasses import replace
from pathlib import Path

from bench.common import command_line, device_name, versions, write_json
from bench.train_report import markdown, speedups
from bench.train_runs import N_EVAL, PREFIX, Variant, run, setup_of

log = logging.getLogger("bench.train")

H200_PEAK_BF16 = 989e12  # dense bf16 tensor-core peak of one H200 (datasheet)
PARTS = (
    *("train", "levers", "zero", "profile", "attention", "alloc"),
    *("auto", "memory", "realistic", "maxbatch", "scaling"),
)
N_ROWS = 34_000  # rows per data file (10 steps of 1,600 x 2 fit in one epoch); cached tokenization


def search_max_batch(fits, start: int, estimate: int | None = None, step: int = 8, limit: int = 1 << 16) -> int:
    """Largest batch (a multiple of ``step``) for which ``fits(batch)`` is True.

    ``start`` is known to fit. ``estimate`` (e.g. from measured memory per sample) is tried
    first; then the bounds double or bisect until they are one ``step`` apart, so the search
    needs O(log) probes whatever the estimate's quality.
    """
    good, bad = start, None
    guess = estimate if estimate and estimate > start else 2 * start
    # With an estimate the answer is usually near it: widen by 1/8 past it, not by 2x (each
    # probe on the GPUs is a full launch, ~40 s).
    grow = (lambda b: b + max(step, b // 8)) if estimate else (lambda b: 2 * b)
    while True:
        guess = min(guess - guess % step, limit)
        if guess <= good:
            return good
        if fits(guess):
            good = guess
        else:
            bad = guess
        if bad is None:
            guess = grow(good)
        elif bad - good <= step:
            return good
        else:
            guess = (good + bad) // 2


def write_data(data_dir: Path, smoke: bool) -> dict:
    """fixed_* (sources of ~124-128 tokens, replies over 64) and realistic_* (the sample generator)."""
    from chat.model import load_tokenizer
    from finetune.sample_data import generate_split

    data_dir.mkdir(parents=True, exist_ok=True)
    n_rows, n_eval = (64, 16) if smoke else (N_ROWS, N_EVAL)
    rows, _ = generate_split(300 if smoke else 6300, random.Random("bench"), allow_held_out=True, seen=set())
    rng = random.Random(0)
    text = " ".join(r["labels"] + " " + r["texts"] for r in rows[:2000])
    words = text.replace("<s>", " ").replace("</s>", " ").split()
    # Word counts that give ~124 source tokens: just under the cut, so the CLI never has to fit
    # (shorten) them, and every batch still pads to 128 in both recipes.
    tokenizer = load_tokenizer("tiny" if smoke else "random-400M")
    probe = [" ".join(rng.choices(words, k=100)) for _ in range(200)]
    per_word = statistics.mean(len(ids) for ids in tokenizer(probe).input_ids) / 100
    source_words, reply_words = int(120 / per_word), int(72 / per_word)
    stats = {}
    for split, n in (("train", n_rows), ("validation", n_eval)):
        realistic = [rows[i % len(rows)] for i in range(n)]
        fixed = [
            {
                "texts": " ".join(rng.choices(words, k=source_words)),
                "labels": " ".join(rng.choices(words, k=reply_words)),
            }
            for _ in range(n)
        ]
        sample = random.Random(1).sample(range(n), min(n, 500))
        for name, data in (("realistic", realistic), ("fixed", fixed)):
            with open(data_dir / f"{name}_{split}.jsonl", "w") as fh:
                fh.writelines(json.dumps(r) + "\n" for r in data)
            src = tokenizer([PREFIX + data[i]["texts"] for i in sample]).input_ids
            tgt = tokenizer(text_target=[data[i]["labels"] for i in sample]).input_ids
            stats[f"{name}_{split}"] = {
                "mean_source_tokens": statistics.mean(min(len(x), 128) for x in src),
                "mean_reply_tokens": statistics.mean(min(len(x), 64) for x in tgt),
            }
    return stats


def matmul_tflops() -> float | None:
    """Measured bf16 GEMM rate of one GPU (the ceiling MFU is compared against)."""
    import torch

    if not torch.cuda.is_available():
        return None
    a = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    for _ in range(5):
        a @ b
    torch.cuda.synchronize()
    start, n = time.perf_counter(), 50
    for _ in range(n):
        a @ b
    torch.cuda.synchronize()
    return 2 * 8192**3 * n / (time.perf_counter() - start) / 1e12


def environment() -> dict:
    import torch

    return {"gpus": torch.cuda.device_count(), "gpu": device_name(), **versions("accelerate", "deepspeed")}


def plan(
    parts: list[str],
    gpus: int,
    batch: int,
    tuned_batch: int,
    smoke: bool,
    strategies: tuple[str, ...] = ("zero2", "ddp"),
) -> list[Variant]:
    """The variants the parts need, in run order (max-batch probes are run separately).

    The seed runs at ``batch``; tuned ZeRO-2 at ``tuned_batch`` (ZeRO-2 leaves room for it),
    tuned DDP at ``batch`` (DDP keeps full optimizer state on every GPU, so it cannot). Every
    CLI seed run has its "seed compute" twin (same JSON and batch, no loader) right after it.
    """
    n = max(gpus, 1)
    steps = 4 if smoke else 10

    def v(recipe: str, strategy: str, data: str, b: int | str, **kw) -> Variant:
        return Variant(recipe, strategy, data, b, n, steps=steps, cpu=smoke, **kw)

    out = []
    if "train" in parts:
        for strategy in ("zero2",) if smoke else strategies:
            tb = tuned_batch if strategy == "zero2" else batch
            out += [
                v("seed", strategy, "fixed", batch, evaluate=strategy == "zero2"),
                v("seed", strategy, "fixed", batch, mode="compute"),
                v("tuned", strategy, "fixed", tb, evaluate=strategy == "zero2"),
            ]
    if "levers" in parts:  # tuned ZeRO-2 compute, one change at a time
        if not smoke:  # (on the CPU every run is fp32 anyway)
            out.append(v("seed", "zero2", "fixed", tuned_batch, mode="compute", dtype="bf16"))
        out += [
            v("tuned", "zero2", "fixed", tuned_batch, mode="compute"),
            v("tuned", "zero2", "fixed", tuned_batch, mode="compute", bucket=5e8),
            v("tuned", "zero2", "fixed", tuned_batch, mode="compute", compile="layers"),
        ]
    if "zero" in parts:  # ZeRO settings on one GPU: its gradient buckets and side stream do no reducing there
        for zero in ("", "overlap_comm=false", "stage=1,overlap_comm=false", "stage=0"):
            out.append(v("tuned", "zero2", "fixed", tuned_batch, mode="compute", zero=zero))
    if "profile" in parts:  # where a step's GPU time goes, and whether one graph for the whole model helps
        long = {"steps": 16 if not smoke else 8, "profile": 2}
        out += [
            replace(v("seed", "zero2", "fixed", batch, mode="compute"), **long),
            replace(v("tuned", "zero2", "fixed", tuned_batch, mode="compute"), **long),
            replace(v("tuned", "zero2", "fixed", tuned_batch, mode="compute", compile="model"), **long),
        ]
    if "attention" in parts:  # which attention kernel trains fastest (profiled: attention's share of a step)
        long = {"steps": 16 if not smoke else 8, "profile": 2}
        for attention in ("sdpa", "sdpa-flash", "sdpa-efficient", "sdpa-cudnn", "eager"):
            out.append(replace(v("tuned", "zero2", "fixed", tuned_batch, mode="compute", attention=attention), **long))
    if "alloc" in parts:  # the caching allocator near the top of the card: its retries, and expandable segments
        for expandable in (False, True):
            out += [
                v("tuned", "zero2", "fixed", tuned_batch, mode="compute", expandable=expandable),
                v("tuned", "zero2", "fixed", "auto", expandable=expandable),
            ]
    if "auto" in parts:  # the batch finetune/memory.py picks: the CLI, and its compute with the quality check
        out += [
            v("tuned", "zero2", "fixed", "auto", evaluate=True),
            v("tuned", "zero2", "fixed", "auto", mode="compute"),
        ]
    if "memory" in parts:  # second batch sizes, for the memory model's per-row and static terms
        out += [
            v("tuned", "zero2", "fixed", batch, mode="compute"),
            v("tuned", "ddp", "fixed", max(batch // 2, 1), mode="compute"),
            v("tuned", "ddp", "fixed", batch, mode="compute"),
        ]
    if "realistic" in parts:
        out += [v(r, "zero2", "realistic", tuned_batch if r == "tuned" else batch) for r in ("seed", "tuned")]
        out.append(v("tuned", "zero2", "realistic", tuned_batch, packing=False))  # per-batch padding: the lever
    if "scaling" in parts and n > 1:
        out.append(Variant("tuned", "zero2", "fixed", tuned_batch, 1, steps=steps))
    return out


def estimate_max_batch(result: dict, capacity_gib: float) -> int | None:
    """Largest micro-batch a run's memory suggests: weights and optimizer state (measured before
    the first step) plus per-row activations (linear in the batch), within 97% of the GPU."""
    batch = result.get("batch_used") or result["variant"]["batch"]
    if not result.get("peak_gib") or result.get("static_gib") is None or not isinstance(batch, int):
        return None
    per_row = (result["peak_gib"] - result["static_gib"]) / batch
    return int((0.97 * capacity_gib - result["static_gib"]) / per_row)


def memory_model(result: dict, capacity_gib: float) -> dict | None:
    """finetune/memory.py's estimate for a fixed-length GPU run, next to the measured peak."""
    from finetune import memory

    v, batch = result["variant"], result.get("batch_used") or result["variant"]["batch"]
    if v["cpu"] or v["data"] != "fixed" or not result.get("peak_gib") or not isinstance(batch, int):
        return None
    strategy = v["strategy"] if v["strategy"] == "zero2" else "ddp" if v["processes"] > 1 else "single"
    setup = memory.Setup(strategy, result["precision"], v["processes"], 128, 64)
    est = memory.estimate(memory.ModelShape.of("random-400M"), batch, setup, capacity_gib)
    return {
        "estimated_peak_gib": est.peak_gib,
        "error": est.peak_gib / result["peak_gib"] - 1,
        "estimated_max_batch": est.max_batch,
    }


MAX_BATCH_SETUPS = ("seed-zero2", "seed-ddp", "tuned-zero2")


def max_batches(
    results: list[dict],
    data_dir: Path,
    work: Path,
    gpus: int,
    timeout: float,
    setups: tuple[str, ...] = MAX_BATCH_SETUPS,
    on_found=None,
) -> list[dict]:
    """Largest micro-batch per GPU for seed ZeRO-2/DDP (fp16) and tuned ZeRO-2 (bf16), starting
    from the timed fixed-length run of the same setup (its batch fits; its memory gives a guess).
    ``on_found(found)`` is called after each search, so a caller can save partial results."""
    found = []
    for recipe, strategy in (s.split("-") for s in setups):
        timed = (r for r in results if r["ok"] and setup_of(r) == (recipe, strategy, "fixed", gpus))
        measured = next(timed, None)
        base = Variant(recipe, strategy, "fixed", measured["variant"]["batch"] if measured else 8, gpus, steps=3)
        probes = []

        def fits(b: int, base: Variant = base, probes: list = probes) -> bool:  # defaults bind this setup's
            r = run(replace(base, batch=b), data_dir, work, smoke=False, timeout=timeout, tag="probe-")
            probes.append({k: r.get(k) for k in ("name", "ok", "peak_gib", "oom", "error")})
            return r["ok"]

        estimate = measured.get("max_batch_estimate") if measured else None
        best = search_max_batch(fits, start=base.batch, estimate=estimate, step=32)
        found.append(
            {
                "recipe": recipe,
                "strategy": strategy,
                "precision": base.precision,
                "max_batch": best,
                "estimate": estimate,
                "probes": probes,
            }
        )
        if on_found:
            on_found(found)
        log.info("max batch %s %s: %d", recipe, strategy, best)
    return found


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.train", description=__doc__.split("\n")[0])
    parser.add_argument("--out", default="runs/bench", help="Folder for data, runs, results.json and results.md.")
    parser.add_argument("--parts", default=",".join(PARTS), help=f"Comma-separated subset of {', '.join(PARTS)}.")
    parser.add_argument("--batch", type=int, default=800, help="Micro-batch per GPU: the seed's runs and tuned DDP.")
    parser.add_argument("--tuned_batch", type=int, default=1600, help="Micro-batch per GPU of the tuned ZeRO-2 runs.")
    parser.add_argument("--smoke", action="store_true", help="CPU smoke mode: tiny model, a few steps, one process.")
    parser.add_argument("--timeout", type=float, default=600, help="Seconds before one run is abandoned.")
    parser.add_argument("--strategies", default="zero2,ddp", help="Strategies of the train part: zero2, ddp or both.")
    parser.add_argument(
        "--max_batch_setups",
        default=",".join(MAX_BATCH_SETUPS),
        help=f"Setups the maxbatch part searches, a subset of {', '.join(MAX_BATCH_SETUPS)}.",
    )
    parser.add_argument(
        "--reuse",
        type=Path,
        help="results.json of an earlier run on the same machine: its timed "
        "runs give the maxbatch part its starting batch and estimate when `train` is not rerun.",
    )
    args = parser.parse_args(argv)
    logging.basicConfig(
        level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s", datefmt="%H:%M:%S"
    )
    parts = [p.strip() for p in args.parts.split(",") if p.strip()]
    unknown = sorted(set(parts) - set(PARTS))
    if unknown or not parts:
        parser.error(f"--parts takes a comma-separated subset of {', '.join(PARTS)}; got {args.parts!r}")
    if args.batch < 1 or args.tuned_batch < 1:
        parser.error("--batch and --tuned_batch must be >= 1")
    setups = tuple(x.strip() for x in args.max_batch_setups.split(",") if x.strip())
    if not setups or set(setups) - set(MAX_BATCH_SETUPS):
        parser.error(
            f"--max_batch_setups takes a subset of {', '.join(MAX_BATCH_SETUPS)}; got {args.max_batch_setups!r}"
        )
    strategies = tuple(x.strip() for x in args.strategies.split(",") if x.strip())
    if not strategies or set(strategies) - {"zero2", "ddp"}:
        parser.error(f"--strategies takes zero2, ddp or both; got {args.strategies!r}")
    reused = []
    if args.reuse:
        try:
            reused = json.loads(args.reuse.read_text())["runs"]
        except (OSError, ValueError, KeyError, TypeError) as err:
            parser.error(f"--reuse {args.reuse}: not a readable results.json ({err})")
    env = environment()
    if not args.smoke and env["gpus"] == 0:
        parser.error("no GPU found: the benchmark needs CUDA GPUs (use --smoke for the CPU check)")
    batch = 4 if args.smoke else args.batch
    out = Path(args.out)
    work, data_dir = out / "runs", out / "data"
    os.environ.setdefault("HF_DATASETS_CACHE", str((out / "hf_datasets").resolve()))  # shared by every run
    report = {
        "environment": env,
        "command": command_line("bench.train", argv),
        "data": write_data(data_dir, args.smoke),
        "runs": [],
    }
    for v in plan(parts, env["gpus"], batch, 4 if args.smoke else args.tuned_batch, args.smoke, strategies):
        report["runs"].append(run(v, data_dir, work, args.smoke, args.timeout))
        write_json(out / "results.json", report)  # partial results survive a kill
    if env["gpus"]:
        import torch

        capacity = torch.cuda.get_device_properties(0).total_memory / 2**30
        report["gpu_capacity_gib"] = capacity
        for r in report["runs"]:
            r["max_batch_estimate"] = estimate_max_batch(r, capacity)
            if r["ok"] and (model := memory_model(r, capacity)):
                r["memory_model"] = model
    if "maxbatch" in parts and not args.smoke:
        if reused:
            report["max_batch_starts_from"] = str(args.reuse)

        def save(found: list) -> None:
            report["max_batch"] = found
            write_json(out / "results.json", report)

        max_batches(report["runs"] + reused, data_dir, work, env["gpus"], args.timeout, setups, on_found=save)
    report["speedups"] = speedups(report["runs"])
    report["matmul_tflops"] = matmul_tflops()
    if report["matmul_tflops"]:
        for r in report["runs"]:
            if r.get("tflops_per_gpu"):
                r["fraction_of_measured_gemm"] = r["tflops_per_gpu"] / report["matmul_tflops"]
                r["mfu_vs_datasheet"] = r["tflops_per_gpu"] * 1e12 / H200_PEAK_BF16
    write_json(out / "results.json", report)
    (out / "results.md").write_text(markdown(report))
    log.info("results in %s", out / "results.md")
    return 0 if all(r["ok"] for r in report["runs"]) else 1


if __name__ == "__main__":
    sys.exit(main())
