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

Parts: ``train`` (samples/s, seconds per 10,000-sample epoch, peak memory, MFU, time to the
first logged step, evaluation of 1,000 rows with the seed's generation settings), ``realistic``,
``maxbatch`` (largest micro-batch per GPU: each probe is a short run; an out-of-memory probe
ends cleanly with the CLI's own error and the next size is tried) and ``scaling`` (1 GPU vs all).
Results: ``OUT/results.json`` and ``OUT/results.md``.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import random
import shutil
import socket
import statistics
import subprocess
import sys
import time
from dataclasses import asdict, dataclass, replace
from pathlib import Path

from bench.common import command_line, device_name, md_table, versions, write_json
from chat.layout import ROOT

log = logging.getLogger("bench.train")

PREFIX = "chatbot: "  # the seed's --source_prefix, in both recipes
FLOPS_PER_SAMPLE = 173e9  # 6 x weights x the tokens each weight sees at 128/64 (see docs/benchmarks.md)
H200_PEAK_BF16 = 989e12  # dense bf16 tensor-core peak of one H200 (datasheet)
PARTS = ("train", "realistic", "maxbatch", "scaling")
N_ROWS = 34_000  # rows per data file (10 steps of 1,600 x 2 fit in one epoch); cached tokenization
N_EVAL = 1_000


@dataclass(frozen=True)
class Variant:
    recipe: str  # "seed" | "tuned"
    strategy: str  # "zero2" | "ddp"
    data: str  # "fixed" | "realistic"
    batch: int  # micro-batch per process
    processes: int
    evaluate: bool = False  # 1,000 rows with the seed's generation settings
    steps: int = 12
    cpu: bool = False  # smoke mode: tiny model, fp32

    @property
    def precision(self) -> str:
        return "fp32" if self.cpu else "fp16" if self.recipe == "seed" else "bf16"

    @property
    def name(self) -> str:
        return f"{self.recipe}-{self.strategy}-{self.precision}-{self.data}-b{self.batch}-x{self.processes}"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def command(v: Variant, data_dir: Path, out_dir: Path, smoke: bool) -> list[str]:
    """The exact launcher + CLI argv of one variant."""
    if smoke:  # CPU: one process, DeepSpeed ZeRO-2 on gloo; the seed keeps its own JSON
        launcher = ["--config_file", "configs/accelerate/cpu_zero2.yaml", "--num_processes", "1"]
        if v.recipe == "seed":
            launcher += ["--deepspeed_config_file", "configs/ds_zero2_seed.json"]
    else:
        config = {"zero2": "zero2_seed.yaml" if v.recipe == "seed" else "zero2.yaml", "ddp": "ddp.yaml"}[v.strategy]
        launcher = ["--config_file", f"configs/accelerate/{config}", "--num_processes", str(v.processes),
                    "--mixed_precision", v.precision]
    eval_batch = max(1, N_EVAL // v.processes) if v.recipe == "tuned" else 100  # the seed evaluated 100 per GPU
    args = [
        "--model_name_or_path", "tiny" if smoke else "random-400M",
        "--train_file", str(data_dir / f"{v.data}_train.jsonl"),
        "--validation_file", str(data_dir / f"{v.data}_validation.jsonl"),
        "--max_source_length", "128", "--max_target_length", "64", "--source_prefix", PREFIX,
        "--val_max_target_length", "64", "--val_min_target_length", "64", "--num_beams", "10",
        "--n_val", str(N_EVAL if v.evaluate else 2 * v.processes),
        "--per_device_train_batch_size", str(v.batch), "--per_device_eval_batch_size", str(eval_batch),
        "--max_train_steps", str(v.steps), "--logging_steps", "1" if v.cpu else "2", "--save_model", "false",
        "--seed", "25",
        "--learning_rate", "1e-6", "--weight_decay", "0.0", "--num_warmup_steps", "100",
        "--output_dir", str(out_dir),
    ]
    if v.recipe == "seed":
        args += ["--pad_to_max_length", "--group_by_length", "false", "--fast_ngram_blocking", "false",
                 "--dataloader_num_workers", "0", "--attention", "sdpa", "--eval_attention", "sdpa"]
    if smoke:
        args[args.index("--n_val") + 1] = "8"
        args[args.index("--per_device_eval_batch_size") + 1] = "8"
    return [sys.executable, "-m", "accelerate.commands.launch", "--main_process_port", str(_free_port()),
            *launcher, "-m", "finetune", *args]


def summarize(events: list[dict], launched: float, v: Variant) -> dict:
    """Numbers of one run from its metrics.jsonl events."""
    logs = [e for e in events if e["event"] == "log"]
    steady = [e["samples_per_second"] for e in logs if e["step"] > 2] or [e["samples_per_second"] for e in logs]
    out = {"steps": len(logs), "losses": [round(e["loss"], 5) for e in logs]}
    if steady:
        rate = statistics.median(steady)
        out.update(samples_per_second=rate, epoch_10k_seconds=10_000 / rate,
                   first_step_seconds=logs[0]["time"] - launched)
        if v.data == "fixed" and not v.cpu:  # the FLOP count is the 400M model's
            out["tflops_per_gpu"] = rate * FLOPS_PER_SAMPLE / v.processes / 1e12
    peaks = [e["gpu_mem_gib"] for e in logs if e.get("gpu_mem_gib") is not None]
    if peaks:
        out["peak_gib"] = max(peaks)
    start = next((e for e in events if e["event"] == "start"), {})
    if start.get("gpu_mem_static_gib") is not None:
        out["static_gib"] = start["gpu_mem_static_gib"]
    evals = [e for e in events if e["event"] == "eval"]
    if v.evaluate and evals:
        out.update(eval_seconds=evals[-1]["eval_epoch_seconds"], eval_bleu=evals[-1]["eval_bleu"])
    return out


def run(v: Variant, data_dir: Path, work: Path, smoke: bool, timeout: float, tag: str = "") -> dict:
    out_dir = work / f"{tag}{v.name}"
    if out_dir.exists():  # a rerun of the same variant starts clean
        shutil.rmtree(out_dir)
    argv = command(v, data_dir, out_dir, smoke)
    log.info("%s: %s", v.name, " ".join(argv[2:]))
    launched = time.time()
    try:
        proc = subprocess.run(argv, cwd=ROOT, capture_output=True, text=True, timeout=timeout, check=False)
        code, stderr = proc.returncode, proc.stderr
    except subprocess.TimeoutExpired as err:
        partial = err.stderr or ""
        code, stderr = "timeout", partial.decode(errors="replace") if isinstance(partial, bytes) else partial
    if out_dir.exists():
        (out_dir / "launch.log").write_text(stderr)  # the run's own log, for when a number looks wrong
    result = {"variant": asdict(v), "name": v.name, "precision": v.precision,
              "wall_seconds": time.time() - launched, "ok": code == 0}
    metrics = out_dir / "metrics.jsonl"
    events = [json.loads(line) for line in metrics.read_text().splitlines()] if metrics.exists() else []
    result.update(summarize(events, launched, v))
    if code != 0:
        errors = [e["message"] for e in events if e["event"] == "error"]
        tail = [line for line in stderr.splitlines() if "error" in line.lower()][-3:]
        result["error"] = errors[-1] if errors else (" | ".join(tail) or f"exit {code}")
        result["oom"] = "out of memory" in (result["error"] + stderr).lower()
    log.info("%s: %s", v.name, {k: result[k] for k in result if k not in ("variant", "losses")})
    return result


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
        fixed = [{"texts": " ".join(rng.choices(words, k=source_words)),
                  "labels": " ".join(rng.choices(words, k=reply_words))} for _ in range(n)]
        sample = random.Random(1).sample(range(n), min(n, 500))
        for name, data in (("realistic", realistic), ("fixed", fixed)):
            with open(data_dir / f"{name}_{split}.jsonl", "w") as fh:
                fh.writelines(json.dumps(r) + "\n" for r in data)
            src = tokenizer([PREFIX + data[i]["texts"] for i in sample]).input_ids
            tgt = tokenizer(text_target=[data[i]["labels"] for i in sample]).input_ids
            stats[f"{name}_{split}"] = {"mean_source_tokens": statistics.mean(min(len(x), 128) for x in src),
                                        "mean_reply_tokens": statistics.mean(min(len(x), 64) for x in tgt)}
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


def plan(parts: list[str], gpus: int, batch: int, tuned_batch: int, smoke: bool) -> list[Variant]:
    """The variants the parts need, in run order (max-batch probes are run separately).

    The seed runs at ``batch``; tuned ZeRO-2 at ``tuned_batch`` (ZeRO-2 leaves room for it),
    tuned DDP at ``batch`` (DDP keeps full optimizer state on every GPU, so it cannot).
    """
    n = max(gpus, 1)
    steps = 4 if smoke else 10
    out = []
    if "train" in parts:
        for strategy in (("zero2",) if smoke else ("zero2", "ddp")):
            for recipe in ("seed", "tuned"):
                b = tuned_batch if (recipe, strategy) == ("tuned", "zero2") else batch
                out.append(Variant(recipe, strategy, "fixed", b, n, evaluate=strategy == "zero2", steps=steps,
                                   cpu=smoke))
    if "realistic" in parts:
        out += [Variant(r, "zero2", "realistic", tuned_batch if r == "tuned" else batch, n, steps=steps, cpu=smoke)
                for r in ("seed", "tuned")]
    if "scaling" in parts and n > 1:
        out.append(Variant("tuned", "zero2", "fixed", tuned_batch, 1, steps=steps))
    return out


def estimate_max_batch(result: dict, capacity_gib: float) -> int | None:
    """Largest micro-batch a run's memory suggests: weights and optimizer state (measured before
    the first step) plus per-row activations (linear in the batch), within 97% of the GPU."""
    if not result.get("peak_gib") or result.get("static_gib") is None:
        return None
    per_row = (result["peak_gib"] - result["static_gib"]) / result["variant"]["batch"]
    return int((0.97 * capacity_gib - result["static_gib"]) / per_row)


MAX_BATCH_SETUPS = ("seed-zero2", "seed-ddp", "tuned-zero2")


def max_batches(results: list[dict], data_dir: Path, work: Path, gpus: int, timeout: float,
                setups: tuple[str, ...] = MAX_BATCH_SETUPS, on_found=None) -> list[dict]:
    """Largest micro-batch per GPU for seed ZeRO-2/DDP (fp16) and tuned ZeRO-2 (bf16), starting
    from the timed fixed-length run of the same setup (its batch fits; its memory gives a guess).
    ``on_found(found)`` is called after each search, so a caller can save partial results."""
    found = []
    for recipe, strategy in (s.split("-") for s in setups):
        measured = next((r for r in results if r["ok"] and (r["variant"]["recipe"], r["variant"]["strategy"],
                         r["variant"]["data"], r["variant"]["processes"]) == (recipe, strategy, "fixed", gpus)), None)
        base = Variant(recipe, strategy, "fixed", measured["variant"]["batch"] if measured else 8, gpus, steps=3)
        probes = []

        def fits(b: int, base: Variant = base, probes: list = probes) -> bool:  # defaults bind this setup's
            r = run(replace(base, batch=b), data_dir, work, smoke=False, timeout=timeout, tag="probe-")
            probes.append({k: r.get(k) for k in ("name", "ok", "peak_gib", "oom", "error")})
            return r["ok"]

        estimate = measured.get("max_batch_estimate") if measured else None
        best = search_max_batch(fits, start=base.batch, estimate=estimate, step=32)
        found.append({"recipe": recipe, "strategy": strategy, "precision": base.precision, "max_batch": best,
                      "estimate": estimate, "probes": probes})
        if on_found:
            on_found(found)
        log.info("max batch %s %s: %d", recipe, strategy, best)
    return found


def markdown(report: dict) -> str:
    env = report["environment"]
    title = (f"Run {env['date']} on {env['gpus']}x {env['gpu']} · torch {env['torch']} · transformers "
             f"{env['transformers']} · accelerate {env['accelerate']} · deepspeed {env['deepspeed']}")
    lines = [title, f"Command: `{report['command']}`", ""]
    if report.get("matmul_tflops"):
        lines += [f"Measured bf16 GEMM rate: {report['matmul_tflops']:.0f} TFLOP/s per GPU.", ""]

    def cell(r, key, fmt):
        return fmt.format(r[key]) if r.get(key) is not None else "–"

    rows = []
    for r in report["runs"]:
        if not r["ok"]:
            rows.append([r["name"], f"failed: {r.get('error', '')[:80]}", "", "", "", "", ""])
            continue
        rows.append([r["name"], cell(r, "samples_per_second", "{:,.0f}"), cell(r, "epoch_10k_seconds", "{:.2f}"),
                     cell(r, "tflops_per_gpu", "{:.0f}"), cell(r, "peak_gib", "{:.1f}"),
                     cell(r, "first_step_seconds", "{:.1f}"), cell(r, "eval_seconds", "{:.1f}")])
    lines += md_table(["run", "samples/s", "s per 10k epoch", "TFLOP/s per GPU", "peak GiB", "first step s",
                       "eval 1k s"], rows, align="lrrrrrr")
    if report.get("speedups"):
        lines += ["", *md_table(["tuned vs seed", "ratio"], [[k, f"{v:.2f}x"] for k, v in report["speedups"].items()],
                                align="lr")]
    if report.get("max_batch"):
        rows = []
        for m in report["max_batch"]:
            batches = [p["name"].split("-b")[1].split("-")[0] + ("✓" if p["ok"] else "✗") for p in m["probes"]]
            rows.append([f"{m['recipe']} {m['strategy']} {m['precision']}", m["max_batch"], ", ".join(batches)])
        lines += ["", *md_table(["max micro-batch per GPU", "batch", "probes"], rows, align="lrl")]
    return "\n".join(lines) + "\n"


def speedups(runs: list[dict]) -> dict:
    by = {(r["variant"]["recipe"], r["variant"]["strategy"], r["variant"]["data"], r["variant"]["processes"]): r
          for r in runs if r["ok"]}
    out = {}
    for strategy in ("zero2", "ddp"):
        for data in ("fixed", "realistic"):
            n = max((k[3] for k in by), default=1)
            seed, tuned = by.get(("seed", strategy, data, n)), by.get(("tuned", strategy, data, n))
            if seed and tuned and seed.get("samples_per_second") and tuned.get("samples_per_second"):
                rate = tuned["samples_per_second"] / seed["samples_per_second"]
                out[f"training samples/s, {strategy}, {data}"] = rate
            if seed and tuned and seed.get("eval_seconds") and tuned.get("eval_seconds"):
                out[f"evaluation, {strategy}, {data} (seed s / tuned s)"] = seed["eval_seconds"] / tuned["eval_seconds"]
    one = by.get(("tuned", "zero2", "fixed", 1))
    many = [r for k, r in by.items() if k[:3] == ("tuned", "zero2", "fixed") and k[3] > 1]
    if one and many and one.get("samples_per_second"):
        m = many[0]
        out[f"scaling efficiency 1 -> {m['variant']['processes']} GPUs"] = (
            m["samples_per_second"] / (one["samples_per_second"] * m["variant"]["processes"]))
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.train", description=__doc__.split("\n")[0])
    parser.add_argument("--out", default="runs/bench", help="Folder for data, runs, results.json and results.md.")
    parser.add_argument("--parts", default=",".join(PARTS), help=f"Comma-separated subset of {', '.join(PARTS)}.")
    parser.add_argument("--batch", type=int, default=800, help="Micro-batch per GPU: the seed's runs and tuned DDP.")
    parser.add_argument("--tuned_batch", type=int, default=1600, help="Micro-batch per GPU of the tuned ZeRO-2 runs.")
    parser.add_argument("--smoke", action="store_true", help="CPU smoke mode: tiny model, a few steps, one process.")
    parser.add_argument("--timeout", type=float, default=600, help="Seconds before one run is abandoned.")
    parser.add_argument("--max_batch_setups", default=",".join(MAX_BATCH_SETUPS),
                        help=f"Setups the maxbatch part searches, a subset of {', '.join(MAX_BATCH_SETUPS)}.")
    parser.add_argument("--reuse", type=Path, help="results.json of an earlier run on the same machine: its timed "
                        "runs give the maxbatch part its starting batch and estimate when `train` is not rerun.")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s",
                        datefmt="%H:%M:%S")
    parts = [p.strip() for p in args.parts.split(",") if p.strip()]
    unknown = sorted(set(parts) - set(PARTS))
    if unknown or not parts:
        parser.error(f"--parts takes a comma-separated subset of {', '.join(PARTS)}; got {args.parts!r}")
    if args.batch < 1 or args.tuned_batch < 1:
        parser.error("--batch and --tuned_batch must be >= 1")
    setups = tuple(x.strip() for x in args.max_batch_setups.split(",") if x.strip())
    if not setups or set(setups) - set(MAX_BATCH_SETUPS):
        parser.error(f"--max_batch_setups takes a subset of {', '.join(MAX_BATCH_SETUPS)}; "
                     f"got {args.max_batch_setups!r}")
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
    report = {"environment": env, "command": command_line("bench.train", argv),
              "data": write_data(data_dir, args.smoke), "runs": []}
    for v in plan(parts, env["gpus"], batch, 4 if args.smoke else args.tuned_batch, args.smoke):
        report["runs"].append(run(v, data_dir, work, args.smoke, args.timeout))
        write_json(out / "results.json", report)  # partial results survive a kill
    if env["gpus"]:
        import torch

        capacity = torch.cuda.get_device_properties(0).total_memory / 2**30
        for r in report["runs"]:
            r["max_batch_estimate"] = estimate_max_batch(r, capacity)
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
