"""What the training benchmark (``bench/train.py``) reports beyond each run's numbers: the
tuned-vs-seed ratios of matching setups, and results.md."""

from __future__ import annotations

from bench.common import md_table
from bench.train_runs import setup_of


def speedups(runs: list[dict]) -> dict:
    """Tuned over seed for each setup both ran (same strategy, data and GPUs), and 1 GPU vs all."""
    by = {setup_of(r): r for r in runs if r["ok"]}
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
        linear = one["samples_per_second"] * m["variant"]["processes"]  # perfect scaling
        out[f"scaling efficiency 1 -> {m['variant']['processes']} GPUs"] = m["samples_per_second"] / linear
    return out


def markdown(report: dict) -> str:
    """results.md: the environment, one row per run, the ratios and the max-batch searches."""
    env = report["environment"]
    title = (
        f"Run {env['date']} on {env['gpus']}x {env['gpu']} · torch {env['torch']} · transformers "
        f"{env['transformers']} · accelerate {env['accelerate']} · deepspeed {env['deepspeed']}"
    )
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
        rows.append(
            [
                r["name"],
                cell(r, "samples_per_second", "{:,.0f}"),
                cell(r, "epoch_10k_seconds", "{:.2f}"),
                cell(r, "tflops_per_gpu", "{:.0f}"),
                cell(r, "peak_gib", "{:.1f}"),
                cell(r, "first_step_seconds", "{:.1f}"),
                cell(r, "eval_seconds", "{:.1f}"),
            ]
        )
    lines += md_table(
        ["run", "samples/s", "s per 10k epoch", "TFLOP/s per GPU", "peak GiB", "first step s", "eval 1k s"],
        rows,
        align="lrrrrrr",
    )
    if report.get("speedups"):
        ratios = [[k, f"{v:.2f}x"] for k, v in report["speedups"].items()]
        lines += ["", *md_table(["tuned vs seed", "ratio"], ratios, align="lr")]
    if report.get("max_batch"):
        rows = []
        for m in report["max_batch"]:
            batches = [p["name"].split("-b")[1].split("-")[0] + ("✓" if p["ok"] else "✗") for p in m["probes"]]
            rows.append([f"{m['recipe']} {m['strategy']} {m['precision']}", m["max_batch"], ", ".join(batches)])
        lines += ["", *md_table(["max micro-batch per GPU", "batch", "probes"], rows, align="lrl")]
    return "\n".join(lines) + "\n"
