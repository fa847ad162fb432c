"""LoRA adapters against full fine-tuning (issue 25), both through the project's CLI in one run.

    python -m bench.train_lora --parts gpu --out runs/bench-lora          # one GPU; prints the results as JSON
    python -m bench.train_lora --parts cpu,bleu --out runs/bench-lora-cpu # a CPU machine
    python -m bench.train_lora --smoke --out /tmp/bench-lora              # CPU, tiny model, a few minutes (CI)

Every number is a run of ``accelerate launch ... -m finetune`` (or ``python -m finetune`` for one CPU
process) on the 400M shape with random weights (``random-400M``) and bench.train's fixed rows (every
row 128 source / 64 target tokens, so padding cannot differ between runs):

* ``gpu``: one GPU, the tuned CLI (configs/accelerate/zero2.yaml, bf16, fused AdamW, packing): full
  fine-tuning, LoRA (r 8, alpha 16, dropout 0.05 on every projection: the CLI's defaults, through the
  fused layers of finetune/lora_layer.py), LoRA through peft's own layers (``--lora_fused false``)
  and LoRA without dropout (``--lora_dropout 0``: nothing to recompute),
  at one micro-batch (``--batch``) and then each at ``auto`` (the largest that finetune/memory.py says
  fits): samples/s (median over the steps after the 2nd) and peak GPU memory (max_memory_allocated),
  with the memory model's estimate beside each;
* ``cpu``: batch 8 per process on ``--processes`` (2: DeepSpeed ZeRO-2 on gloo, the README's CPU
  recipe; 1: plain PyTorch, no launcher): seconds per optimizer step (median after the 2nd), peak
  RSS of the training processes (their sum, and the largest one) while they train, and the sizes of
  what each run saves in final/ (the adapter's file against the full model's);
* ``bleu``: the README's CPU recipe (tiny model, the shipped sample, 8 epochs) as it is and with
  ``--adapter lora``: validation BLEU and eval loss of both.

Results: OUT/results.json and OUT/results.md, and the JSON on stdout at the end.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import shlex
import shutil
import statistics
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

from bench.common import command_line, cpu_name, md_table, versions, write_json
from chat.layout import ROOT
from finetune.jobs.command import free_port

log = logging.getLogger("bench.train_lora")

PARTS = ("gpu", "cpu", "bleu")
# The README's CPU recipe (README "Train"), as its flags.
README_RECIPE = (
    "--model_name_or_path tiny --dataset_name sample --num_train_epochs 8 --learning_rate 1e-3 "
    "--num_warmup_steps 50 --per_device_train_batch_size 16 --per_device_eval_batch_size 32 --num_beams 4"
).split()
KINDS = {  # the training flags of each kind of run
    "full": [],
    "lora": ["--adapter", "lora"],
    "lora-peft-layers": ["--adapter", "lora", "--lora_fused", "false"],
    "lora-no-dropout": ["--adapter", "lora", "--lora_dropout", "0"],
}
GPU_KINDS = tuple(KINDS)
CPU_KINDS = ("full", "lora", "lora-peft-layers")


@dataclass
class Run:
    """One launch: its name, argv (run from the repository root) and output folder."""

    name: str
    argv: list[str]
    out_dir: Path
    kind: str
    processes: int
    batch: int | str
    # (time, the training processes' RSS summed, the largest one's, their CPU seconds so far), every 0.2 s
    samples: list[tuple[float, int, int, float]] = field(default_factory=list)


def launcher(processes: int, gpu: bool) -> list[str]:
    """How a run starts: accelerate with the tuned GPU config or the CPU DeepSpeed one; one CPU
    process runs ``python -m finetune`` itself (the README's one-process recipe)."""
    if not gpu and processes == 1:
        return [sys.executable]
    config = "zero2.yaml" if gpu else "cpu_zero2.yaml"
    argv = [sys.executable, "-m", "accelerate.commands.launch", "--config_file", f"configs/accelerate/{config}"]
    argv += ["--num_processes", str(processes), "--main_process_port", str(free_port())]
    return argv + (["--mixed_precision", "bf16"] if gpu else [])


def timing_run(kind: str, data_dir: Path, work: Path, *, gpu: bool, processes: int, batch, steps: int, smoke: bool):
    """A run timed on fixed 128/64 rows; CPU runs save final/ (its sizes are measured)."""
    flags = {
        "model_name_or_path": "tiny" if smoke else "random-400M",
        "train_file": data_dir / "fixed_train.jsonl",
        "validation_file": data_dir / "fixed_validation.jsonl",
        "source_prefix": "chatbot: ",
        "per_device_train_batch_size": batch,
        "per_device_eval_batch_size": 8,
        "max_train_steps": steps,
        "logging_steps": 1,
        "n_val": 2 * processes,  # (evaluation is not what is measured: a few short replies)
        "num_beams": 1,
        "val_max_target_length": 4,
        "val_min_target_length": 1,
        "learning_rate": "1e-5",
        "save_model": "false" if gpu else "true",
        "seed": 25,
    }
    name = f"{kind}-{'gpu' if gpu else 'cpu'}-x{processes}-b{batch}"
    out_dir = work / name
    args = [word for flag, value in flags.items() for word in (f"--{flag}", str(value))]
    argv = [*launcher(processes, gpu), "-m", "finetune", *args, *KINDS[kind], "--output_dir", str(out_dir)]
    return Run(name, argv, out_dir, kind, processes, batch)


def bleu_run(kind: str, work: Path, smoke: bool, lora_flags: list[str]) -> Run:
    """The README's CPU recipe (2 processes of DeepSpeed ZeRO-2), as it is or as a LoRA run."""
    recipe = list(README_RECIPE)
    if smoke:  # a few steps of it
        recipe += ["--n_train", "64", "--n_val", "8", "--num_train_epochs", "1"]
    extra = KINDS[kind] + (lora_flags if kind != "full" else [])
    out_dir = work / f"bleu-{kind}"
    argv = [*launcher(2, gpu=False), "-m", "finetune", *recipe, *extra, "--output_dir", str(out_dir)]
    return Run(f"bleu-{kind}", argv, out_dir, kind, 2, 16)


def training_processes(root) -> list:
    """The processes that train (the launcher's ranks, or the one process itself)."""
    procs = [root, *root.children(recursive=True)]
    return [p for p in procs if "finetune" in (cmd := p.cmdline()) and "accelerate.commands.launch" not in cmd]


def execute(run: Run, timeout: float) -> dict:
    """Launch ``run``, sample its processes' RSS every 0.2 s, and summarize its metrics.jsonl."""
    import psutil

    if run.out_dir.exists():
        shutil.rmtree(run.out_dir)
    log.info("%s: %s", run.name, " ".join(run.argv[1:]))
    started = time.time()
    proc = subprocess.Popen(run.argv, cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    stderr: list[str] = []
    reader = threading.Thread(target=lambda: stderr.extend(proc.stderr), daemon=True)
    reader.start()
    root = psutil.Process(proc.pid)
    while proc.poll() is None and time.time() - started < timeout:
        try:
            procs = training_processes(root)
            sizes = [p.memory_info().rss for p in procs]
            cpu = sum(sum(p.cpu_times()[:2]) for p in procs)  # user + system
        except psutil.Error:  # a process ended between the listing and the reading
            sizes = []
        if sizes:
            run.samples.append((time.time(), sum(sizes), max(sizes), cpu))
        time.sleep(0.2)
    if proc.poll() is None:
        proc.kill()
    code = proc.wait()
    reader.join(timeout=10)
    run.out_dir.mkdir(parents=True, exist_ok=True)
    (run.out_dir / "launch.log").write_text("".join(stderr))
    result = {"name": run.name, "kind": run.kind, "processes": run.processes, "batch": run.batch, "ok": code == 0}
    result["command"] = shlex.join(["python", *run.argv[1:]])
    result["wall_seconds"] = time.time() - started
    result.update(summarize(run))
    if code != 0:
        result["error"] = next(
            (e["message"] for e in reversed(events(run.out_dir)) if e["event"] == "error"),
            "".join(stderr[-3:]).strip() or f"exit {code}",
        )
    log.info("%s: %s", run.name, {k: v for k, v in result.items() if k not in ("command", "losses")})
    return result


def events(out_dir: Path) -> list[dict]:
    path = out_dir / "metrics.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def summarize(run: Run) -> dict:
    """Speed, memory and sizes of one finished run."""
    ev = events(run.out_dir)
    start = next((e for e in ev if e["event"] == "start"), {})
    logs = [e for e in ev if e["event"] == "log" and not e.get("partial")]
    out: dict = {"losses": [round(e["loss"], 4) for e in logs]}
    if start.get("global_batch_size"):
        out["global_batch"] = start["global_batch_size"]
        out["batch_used"] = start["global_batch_size"] // max(start.get("num_processes") or 1, 1)
    steady = [e["samples_per_second"] for e in logs if e["step"] > 2] or [e["samples_per_second"] for e in logs]
    if steady and out.get("global_batch"):
        rate = statistics.median(steady)
        out.update(samples_per_second=rate, seconds_per_step=out["global_batch"] / rate)
    peaks = [e["gpu_mem_gib"] for e in logs if e.get("gpu_mem_gib") is not None]
    if peaks:
        out["peak_gpu_gib"] = max(peaks)
    if run.samples and start and logs:  # while it trains: from its start event to its last step (not the final save)
        training = [r for r in run.samples if start["time"] <= r[0] <= logs[-1]["time"]] or run.samples
        out["peak_rss_gib"] = max(r[1] for r in training) / 2**30
        out["peak_rss_one_process_gib"] = max(r[2] for r in training) / 2**30
        out.update(cpu_seconds_per_step(run.samples, logs))
    final = run.out_dir / "final"
    for name in ("adapter_model.safetensors", "model.safetensors"):
        if (final / name).is_file():
            out["saved_file"], out["saved_mib"] = name, (final / name).stat().st_size / 2**20
    evals = [e for e in ev if e["event"] == "eval"]
    if evals:
        out.update(eval_bleu=evals[-1]["eval_bleu"], eval_loss=evals[-1]["eval_loss"])
    return out


def cpu_seconds_per_step(samples: list[tuple], logs: list[dict]) -> dict:
    """CPU seconds (user + system, all training processes) per optimizer step after the 2nd: on a
    machine shared with other work a step's wall time follows the share of the cores it got, its CPU
    time much less."""
    steady = [e for e in logs if e["step"] >= 2]
    if len(steady) < 2:
        return {}

    def sample_at(t: float) -> int:  # the first sample at or after t (sampled every 0.2 s)
        return next((i for i, s in enumerate(samples) if s[0] >= t), len(samples) - 1)

    first, last = steady[0], steady[-1]
    a, b = sample_at(first["time"]), sample_at(last["time"])
    if a == b:  # the steps went by between two samples: too fast to measure, not free
        return {}
    return {"cpu_seconds_per_step": (samples[b][3] - samples[a][3]) / (last["step"] - first["step"])}


def memory_estimate(result: dict, capacity_gib: float) -> dict | None:
    """finetune/memory.py's peak for a GPU run (LoRA: its trainable weights and dropout copies)."""
    from chat.adapters import LORA_TARGETS
    from finetune import memory

    if not result.get("peak_gpu_gib") or not result.get("batch_used"):
        return None
    lora = {}
    if result["kind"] != "full":
        dropout = 0.05 if result["kind"] == "lora-peft-layers" else 0.0  # (the fused layers keep no dropout copies)
        lora = {"lora_r": 8, "lora_targets": LORA_TARGETS, "lora_dropout": dropout}
    setup = memory.Setup("zero2", "bf16", result["processes"], 128, 64, **lora)
    est = memory.estimate(memory.ModelShape.of("random-400M"), result["batch_used"], setup, capacity_gib)
    return {"estimated_peak_gib": est.peak_gib, "error": est.peak_gib / result["peak_gpu_gib"] - 1}


def ratios(results: list[dict]) -> dict:
    """LoRA against full fine-tuning, by setup: speed (x faster) and memory (fraction of full's)."""
    out = {}
    for r in results:
        if r["kind"] == "full" or not r["ok"]:
            continue
        full = next(
            (
                f
                for f in results
                if f["kind"] == "full" and f["ok"] and f["name"] == r["name"].replace(r["kind"], "full")
            ),
            None,
        )
        if full is None:
            continue
        entry = {}
        if r.get("samples_per_second") and full.get("samples_per_second"):
            entry["speed_x"] = r["samples_per_second"] / full["samples_per_second"]
            entry["seconds_per_step_x"] = full["seconds_per_step"] / r["seconds_per_step"]
        if r.get("cpu_seconds_per_step") and full.get("cpu_seconds_per_step"):
            entry["cpu_seconds_per_step_x"] = full["cpu_seconds_per_step"] / r["cpu_seconds_per_step"]
        for key in ("peak_gpu_gib", "peak_rss_gib", "saved_mib"):
            if r.get(key) and full.get(key):
                entry[f"{key}_fraction"] = r[key] / full[key]
        out[r["name"]] = entry
    return out


def markdown(report: dict) -> str:
    env = report["environment"]
    lines = [f"# LoRA vs full fine-tuning ({env['date']}, {env['device']})", "", f"`{report['command']}`", ""]
    header = [
        "run",
        "samples/s",
        "s/step",
        "CPU s/step",
        "peak GPU GiB",
        "peak RSS GiB (sum / one)",
        "final/ file MiB",
        "BLEU",
    ]
    rows = []
    for r in report["runs"]:
        rss = f"{r['peak_rss_gib']:.2f} / {r['peak_rss_one_process_gib']:.2f}" if r.get("peak_rss_gib") else ""
        rows.append(
            [
                r["name"] + ("" if r["ok"] else " (failed)"),
                f"{r['samples_per_second']:.1f}" if r.get("samples_per_second") else "",
                f"{r['seconds_per_step']:.2f}" if r.get("seconds_per_step") else "",
                f"{r['cpu_seconds_per_step']:.1f}" if r.get("cpu_seconds_per_step") else "",
                f"{r['peak_gpu_gib']:.1f}" if r.get("peak_gpu_gib") else "",
                rss,
                f"{r['saved_mib']:.1f}" if r.get("saved_mib") else "",
                f"{r['eval_bleu']:.2f}" if "eval_bleu" in r and r["name"].startswith("bleu") else "",
            ]
        )
    lines += md_table(header, rows, "lrrrrrrr")
    lines += ["", "LoRA against full fine-tuning:", ""]
    lines += [
        f"- {name}: " + ", ".join(f"{k} {v:.2f}" for k, v in entry.items()) for name, entry in report["ratios"].items()
    ]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.train_lora", description=__doc__.split("\n")[0])
    parser.add_argument("--out", default="runs/bench-lora", help="Folder for data, runs, results.json and results.md.")
    parser.add_argument("--parts", default="gpu", help=f"Comma-separated subset of {', '.join(PARTS)}.")
    parser.add_argument("--batch", type=int, default=800, help="GPU micro-batch of the same-batch runs (then 'auto').")
    parser.add_argument(
        "--gpu_batches", default="batch,auto", help="The GPU runs' micro-batches: 'batch' (--batch), 'auto', or both."
    )
    parser.add_argument("--gpu_steps", type=int, default=12, help="Optimizer steps of each GPU run.")
    parser.add_argument("--processes", type=int, default=2, choices=(1, 2), help="CPU processes (2: ZeRO-2).")
    parser.add_argument("--cpu_steps", type=int, default=6, help="Optimizer steps of each CPU run.")
    parser.add_argument("--kinds", default=",".join(KINDS), help=f"Runs to make, a subset of {', '.join(KINDS)}.")
    parser.add_argument("--lora_flags", default="", help="Extra flags for the LoRA runs of the bleu part.")
    parser.add_argument("--smoke", action="store_true", help="CPU, tiny model, every part in a few steps.")
    parser.add_argument("--timeout", type=float, default=1800, help="Seconds before one run is abandoned.")
    args = parser.parse_args(argv)
    logging.basicConfig(
        level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s", datefmt="%H:%M:%S"
    )
    parts = [p.strip() for p in args.parts.split(",") if p.strip()] if not args.smoke else ["cpu", "bleu"]
    if not parts or set(parts) - set(PARTS):
        parser.error(f"--parts takes a comma-separated subset of {', '.join(PARTS)}; got {args.parts!r}")
    kinds = [k.strip() for k in args.kinds.split(",") if k.strip()]
    if not kinds or set(kinds) - set(KINDS):
        parser.error(f"--kinds takes a comma-separated subset of {', '.join(KINDS)}; got {args.kinds!r}")
    gpu_batches = [b.strip() for b in args.gpu_batches.split(",") if b.strip()]
    if not gpu_batches or set(gpu_batches) - {"batch", "auto"}:
        parser.error(f"--gpu_batches takes 'batch', 'auto' or both; got {args.gpu_batches!r}")
    if min(args.batch, args.gpu_steps, args.cpu_steps) < 1:
        parser.error("--batch, --gpu_steps and --cpu_steps must be >= 1")
    import torch

    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if "gpu" in parts and not gpus:
        parser.error("the gpu part needs a CUDA GPU (the cpu and bleu parts run without one)")
    device = torch.cuda.get_device_name(0) if gpus else cpu_name()
    env = {"device": device, "cpu": cpu_name(), "cores": os.cpu_count(), **versions("accelerate", "deepspeed", "peft")}
    env["load_average_at_start"] = os.getloadavg()
    out = Path(args.out)
    work, data_dir = out / "runs", out / "data"
    os.environ.setdefault("HF_DATASETS_CACHE", str((out / "hf_datasets").resolve()))
    from bench.train import write_data

    report = {"environment": env, "command": command_line("bench.train_lora", argv), "runs": []}
    if {"gpu", "cpu"} & set(parts):
        report["data"] = write_data(data_dir, args.smoke)
    plan = []
    if "gpu" in parts:
        for batch in [args.batch if b == "batch" else "auto" for b in gpu_batches]:
            plan += [
                timing_run(k, data_dir, work, gpu=True, processes=1, batch=batch, steps=args.gpu_steps, smoke=False)
                for k in GPU_KINDS
                if k in kinds
            ]
    if "cpu" in parts:
        steps, processes = (16, 1) if args.smoke else (args.cpu_steps, args.processes)
        plan += [
            timing_run(k, data_dir, work, gpu=False, processes=processes, batch=8, steps=steps, smoke=args.smoke)
            for k in CPU_KINDS
            if k in kinds
        ]
    if "bleu" in parts:
        plan += [bleu_run(k, work, args.smoke, args.lora_flags.split()) for k in ("full", "lora") if k in kinds]
    for run in plan:
        report["runs"].append(execute(run, args.timeout))
        write_json(out / "results.json", report)  # partial results survive a kill
    if gpus:
        capacity = torch.cuda.get_device_properties(0).total_memory / 2**30
        report["gpu_capacity_gib"] = capacity
        for r in report["runs"]:
            if r["ok"] and (model := memory_estimate(r, capacity)):
                r["memory_model"] = model
    report["ratios"] = ratios(report["runs"])
    report["environment"]["load_average_at_end"] = os.getloadavg()
    write_json(out / "results.json", report)
    (out / "results.md").write_text(markdown(report))
    print(json.dumps({k: v for k, v in report.items() if k != "data"}, indent=1))
    return 0 if all(r["ok"] for r in report["runs"]) else 1


if __name__ == "__main__":
    sys.exit(main())
