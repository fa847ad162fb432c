"""DPO and KTO against SFT (issue 27), each a run of the project's CLI, in one call.

    python -m bench.train_preference --out runs/bench-pref                  # one GPU; prints the results as JSON
    python -m bench.train_preference --smoke --out /tmp/bench-pref          # CPU, tiny model, a minute or two (CI)

Every run is ``accelerate launch --config_file configs/accelerate/zero2.yaml --num_processes 1
--mixed_precision bf16 -m finetune ...`` (the tuned one-GPU CLI) on the 400M shape with random
weights (``random-400M``) and bench.train's fixed rows (sources of ~124 tokens, replies over 64,
so padding cannot differ between runs), at the same micro-batch (``--batch``):

* ``sft``: the fixed rows' target replies (cross-entropy; packed, the CLI's default);
* ``dpo``: the same sources as pairs, chosen = the row's reply, rejected = another row's (each
  step's forward runs both replies: twice the rows of an SFT step);
* ``kto``: the same pairs as single rated replies (each step also runs every row's source with
  another row's reply, for KTO's KL estimate).

Reported per run: samples/s (median over the steps after the 2nd; a DPO sample is a pair, a KTO
or SFT sample one reply), replies/s (the target sequences each step computes), peak GPU memory,
and for the preference runs the seconds spent computing the reference log-probabilities before
the first step (a forward pass over all rows; the run needs no second model). Ratios against SFT
come from the same call. Results: OUT/results.json and OUT/results.md.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
from pathlib import Path

from bench.common import command_line, cpu_name, md_table, versions, write_json
from bench.train_lora import Run, events, execute, launcher

log = logging.getLogger("bench.train_preference")

OBJECTIVES = ("sft", "dpo", "kto")
REPLIES_PER_SAMPLE = {"sft": 1, "dpo": 2, "kto": 2}  # target sequences a sample's forward computes
REFERENCE_PHASE = "computing the reference log-probabilities"


def write_preferences(data_dir: Path, n_rows: int) -> dict[str, Path]:
    """Preference files of bench.train's first ``n_rows`` fixed train rows (what the steps use: the
    reference pass before the first step goes over every row): DPO pairs (chosen = the row's
    reply, rejected = the next row's) and the same as KTO rows (one rated reply per source)."""
    lines = (data_dir / "fixed_train.jsonl").read_text().splitlines()[:n_rows]
    rows = [json.loads(line) for line in lines]
    pairs = [
        {"texts": r["texts"], "chosen": r["labels"], "rejected": rows[(i + 1) % len(rows)]["labels"]}
        for i, r in enumerate(rows)
    ]
    rated = [
        {"texts": p["texts"], "response": p["chosen" if i % 2 == 0 else "rejected"], "label": i % 2 == 0}
        for i, p in enumerate(pairs)
    ]
    files = {"dpo": data_dir / "fixed_dpo.jsonl", "kto": data_dir / "fixed_kto.jsonl"}
    for objective, data in (("dpo", pairs), ("kto", rated)):
        files[objective].write_text("".join(json.dumps(r) + "\n" for r in data))
    return files


def timing_run(objective: str, data_dir: Path, work: Path, files: dict, *, batch, steps: int, smoke: bool) -> Run:
    """One run of ``objective`` at micro-batch ``batch``: the GPU's tuned CLI, or one CPU process (smoke)."""
    flags = {
        "model_name_or_path": "tiny" if smoke else "random-400M",
        "train_file": data_dir / "fixed_train.jsonl",
        "validation_file": data_dir / "fixed_validation.jsonl",
        "per_device_train_batch_size": batch,
        "per_device_eval_batch_size": 8,
        "max_train_steps": steps,
        "logging_steps": 1,
        "n_val": 2,  # (evaluation is not what is measured: a few short replies)
        "num_beams": 1,
        "val_max_target_length": 4,
        "val_min_target_length": 1,
        "learning_rate": "1e-5",
        "save_model": "false",
        "seed": 27,
    }
    if objective != "sft":
        flags.update(objective=objective, preference_file=files[objective])
    name = f"{objective}-b{batch}"
    out_dir = work / name
    args = [word for flag, value in flags.items() for word in (f"--{flag}", str(value))]
    argv = [*launcher(1, gpu=not smoke), "-m", "finetune", *args, "--output_dir", str(out_dir)]
    return Run(name, argv, out_dir, objective, 1, batch)


def reference_seconds(out_dir: Path) -> float | None:
    """From the reference phase's event to the next event (the run's start)."""
    ev = events(out_dir)
    at = next((i for i, e in enumerate(ev) if e["event"] == "phase" and e.get("phase") == REFERENCE_PHASE), None)
    if at is None or at + 1 >= len(ev):
        return None
    return ev[at + 1]["time"] - ev[at]["time"]


def with_replies(result: dict) -> dict:
    if result.get("samples_per_second"):
        result["replies_per_second"] = result["samples_per_second"] * REPLIES_PER_SAMPLE[result["kind"]]
    return result


def ratios(results: list[dict]) -> dict:
    """Each preference run against the SFT run of the same batch: speed in samples and in replies."""
    sft = {r["batch"]: r for r in results if r["kind"] == "sft" and r.get("ok") and r.get("samples_per_second")}
    out = {}
    for r in results:
        base = sft.get(r["batch"])
        if r["kind"] == "sft" or not base or not r.get("ok") or not r.get("samples_per_second"):
            continue
        out[r["name"]] = {
            "samples_per_second_x": r["samples_per_second"] / base["samples_per_second"],
            "replies_per_second_x": r["replies_per_second"] / base["replies_per_second"],
        }
        if r.get("peak_gpu_gib") and base.get("peak_gpu_gib"):
            out[r["name"]]["peak_gpu_gib_x"] = r["peak_gpu_gib"] / base["peak_gpu_gib"]
    return out


def markdown(report: dict) -> str:
    env = report["environment"]
    lines = [f"# DPO / KTO against SFT ({env['device']})", "", f"`{report['command']}`", ""]
    header = ["run", "samples/s", "replies/s", "peak GPU GiB", "reference s", "final loss"]
    rows = [
        [
            r["name"],
            f"{r['samples_per_second']:.1f}" if r.get("samples_per_second") else "failed",
            f"{r['replies_per_second']:.1f}" if r.get("replies_per_second") else "",
            f"{r['peak_gpu_gib']:.1f}" if r.get("peak_gpu_gib") else "",
            f"{r['reference_seconds']:.1f}" if r.get("reference_seconds") is not None else "",
            f"{r['losses'][-1]:.4f}" if r.get("losses") else "",
        ]
        for r in report["runs"]
    ]
    lines += md_table(header, rows, "lrrrrr")
    lines += ["", "Against SFT at the same batch:", ""]
    lines += [f"- {n}: " + ", ".join(f"{k} {v:.2f}" for k, v in e.items()) for n, e in report["ratios"].items()]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.train_preference", description=__doc__.split("\n")[0])
    parser.add_argument("--out", default="runs/bench-pref", help="Folder for data, runs, results.json and results.md.")
    parser.add_argument("--batch", type=int, default=256, help="Micro-batch of every run (pairs for DPO).")
    parser.add_argument("--steps", type=int, default=12, help="Optimizer steps of each run.")
    parser.add_argument("--objectives", default=",".join(OBJECTIVES), help="Runs to make, a subset of sft,dpo,kto.")
    parser.add_argument("--smoke", action="store_true", help="CPU, tiny model, one process, a few steps.")
    parser.add_argument("--timeout", type=float, default=1800, help="Seconds before one run is abandoned.")
    args = parser.parse_args(argv)
    logging.basicConfig(
        level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s", datefmt="%H:%M:%S"
    )
    objectives = [o.strip() for o in args.objectives.split(",") if o.strip()]
    if not objectives or set(objectives) - set(OBJECTIVES):
        parser.error(f"--objectives takes a comma-separated subset of {', '.join(OBJECTIVES)}; got {args.objectives!r}")
    if min(args.batch, args.steps) < 1:
        parser.error("--batch and --steps must be >= 1")
    import torch

    if not args.smoke and not torch.cuda.is_available():
        parser.error("the benchmark needs a CUDA GPU (--smoke runs on the CPU)")
    batch, steps = (8, 4) if args.smoke else (args.batch, args.steps)
    env = {"device": torch.cuda.get_device_name(0) if not args.smoke else cpu_name(), "cpu": cpu_name()}
    env.update(cores=os.cpu_count(), **versions("torch", "transformers", "accelerate", "deepspeed"))
    out = Path(args.out)
    work, data_dir = out / "runs", out / "data"
    os.environ.setdefault("HF_DATASETS_CACHE", str((out / "hf_datasets").resolve()))
    from bench.train import write_data

    report = {"environment": env, "command": command_line("bench.train_preference", argv), "runs": []}
    report["data"] = write_data(data_dir, args.smoke)
    files = write_preferences(data_dir, batch * (steps + 1))
    for objective in objectives:
        run = timing_run(objective, data_dir, work, files, batch=batch, steps=steps, smoke=args.smoke)
        result = with_replies(execute(run, args.timeout))
        if objective != "sft":
            result["reference_seconds"] = reference_seconds(run.out_dir)
        report["runs"].append(result)
        write_json(out / "results.json", report)  # partial results survive a kill
    report["ratios"] = ratios(report["runs"])
    write_json(out / "results.json", report)
    (out / "results.md").write_text(markdown(report))
    print(json.dumps({k: v for k, v in report.items() if k != "data"}, indent=1))
    return 0 if all(r["ok"] for r in report["runs"]) else 1


if __name__ == "__main__":
    sys.exit(main())
