"""What the training benchmark (``bench/train.py``) reports beyond each run's numbers: the
tuned-vs-seed ratios of matching setups, and results.md."""

from __future__ import annotations

from bench.common import md_table
from bench.train_runs import Variant, setup_of


def speedups(runs: list[dict]) -> dict:
    """Tuned over seed for each setup both ran (same strategy, data and GPUs), each over the seed's
    compute alone (its JSON, no loader), the levers over tuned compute, and 1 GPU vs all."""
    ok = [r for r in runs if r["ok"] and r.get("samples_per_second")]
    by = {setup_of(r): r for r in ok if Variant(**r["variant"]).plain}
    out = {}
    n = max((k[3] for k in by), default=1)
    for strategy in ("zero2", "ddp"):
        base = next(  # the seed's compute at its own precision and batch
            (
                r
                for r in ok
                if setup_of(r) == ("seed-compute", strategy, "fixed", n)
                and r["variant"].get("dtype") is None
                and (seed := by.get(("seed", strategy, "fixed", n))) is not None
                and r["variant"]["batch"] == seed["variant"]["batch"]
            ),
            None,
        )
        for data in ("fixed", "realistic"):
            seed, tuned = by.get(("seed", strategy, data, n)), by.get(("tuned", strategy, data, n))
            if seed and tuned:
                out[f"training samples/s, {strategy}, {data}"] = (
                    tuned["samples_per_second"] / seed["samples_per_second"]
                )
            if base and tuned:
                out[f"training samples/s, {strategy}, {data}, tuned vs seed compute"] = (
                    tuned["samples_per_second"] / base["samples_per_second"]
                )
            if seed and tuned and seed.get("eval_seconds") and tuned.get("eval_seconds"):
                out[f"evaluation, {strategy}, {data} (seed s / tuned s)"] = seed["eval_seconds"] / tuned["eval_seconds"]
        if base:
            for r in ok:  # everything else of this strategy on fixed rows, against the seed's compute
                v = r["variant"]
                if v["strategy"] == strategy and v["data"] == "fixed" and r is not base and r not in by.values():
                    out[f"{r['name']} vs seed compute"] = r["samples_per_second"] / base["samples_per_second"]
    for r in ok:  # a lever switched off (e.g. -nopack) against the seed of its setup
        v = r["variant"]
        seed = by.get(("seed", v["strategy"], v["data"], v["processes"]))
        if v.get("packing") is False and seed:
            out[f"{r['name']} vs seed"] = r["samples_per_second"] / seed["samples_per_second"]
    one = by.get(("tuned", "zero2", "fixed", 1))
    many = [r for k, r in by.items() if k[:3] == ("tuned", "zero2", "fixed") and k[3] > 1]
    if one and many:
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
            rows.append([r["name"], f"failed: {r.get('error', '')[:80]}", *[""] * 8])
            continue
        model = r.get("memory_model") or {}
        rows.append(
            [
                r["name"],
                cell(r, "batch_used", "{}"),
                cell(r, "samples_per_second", "{:,.0f}"),
                cell(r, "epoch_10k_seconds", "{:.2f}"),
                cell(r, "tflops_per_gpu", "{:.0f}"),
                cell(r, "peak_gib", "{:.1f}"),
                cell(model, "estimated_peak_gib", "{:.1f}"),
                cell(r, "first_step_seconds", "{:.1f}"),
                cell(r, "eval_seconds", "{:.1f}"),
                cell(r, "eval_loss", "{:.4f}"),
            ]
        )
    header = ["run", "batch", "samples/s", "s per 10k epoch", "TFLOP/s per GPU", "peak GiB", "model GiB"]
    lines += md_table([*header, "first step s", "eval 1k s", "eval loss"], rows, align="lrrrrrrrrr")
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
