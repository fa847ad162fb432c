"""bench/train_preference.py: each run is the project's CLI with valid flags at the same batch, the
preference files pair the fixed rows, ratios compare with the SFT run, and (slow) the CPU smoke run
measures SFT and DPO."""

from __future__ import annotations

import json

from bench import train_preference as bench
from finetune.config import parse_args
from finetune.preference_data import load_preferences


def flags_of(run) -> list[str]:
    return run.argv[run.argv.index("finetune") + 1 :]


def test_the_gpu_runs_are_the_tuned_cli_at_one_batch(tmp_path):
    (tmp_path / "fixed_train.jsonl").write_text(
        "".join(json.dumps({"texts": f"source {i}", "labels": f"reply {i}"}) + "\n" for i in range(6))
    )
    files = bench.write_preferences(tmp_path, 5)
    pairs, _ = load_preferences(str(files["dpo"]), "dpo")
    assert pairs["chosen"] == [f"reply {i}" for i in range(5)] and pairs["rejected"] == [
        f"reply {(i + 1) % 5}" for i in range(5)
    ]
    rated, _ = load_preferences(str(files["kto"]), "kto")
    assert rated["label"] == [True, False, True, False, True]
    runs = {
        o: bench.timing_run(o, tmp_path, tmp_path / "w", files, batch=256, steps=12, smoke=False)
        for o in bench.OBJECTIVES
    }
    for objective, run in runs.items():
        launch = run.argv[: run.argv.index("-m", 3)]
        assert launch[launch.index("--config_file") + 1] == "configs/accelerate/zero2.yaml"
        assert launch[launch.index("--mixed_precision") + 1] == "bf16"
        cfg = parse_args(flags_of(run))
        assert (cfg.objective, cfg.model_name_or_path, cfg.per_device_train_batch_size) == (
            objective,
            "random-400M",
            256,
        )
        assert cfg.max_train_steps == 12 and cfg.logging_steps == 1 and not cfg.save_model
        assert cfg.preference_file == (None if objective == "sft" else str(files[objective]))


def test_ratios_compare_samples_and_replies_with_sft_of_the_same_batch():
    results = [
        {
            "name": "sft-b256",
            "kind": "sft",
            "batch": 256,
            "ok": True,
            "samples_per_second": 1000.0,
            "peak_gpu_gib": 40.0,
        },
        {
            "name": "dpo-b256",
            "kind": "dpo",
            "batch": 256,
            "ok": True,
            "samples_per_second": 400.0,
            "peak_gpu_gib": 60.0,
        },
        {"name": "kto-b256", "kind": "kto", "batch": 256, "ok": False},
    ]
    results = [bench.with_replies(r) for r in results]
    assert results[1]["replies_per_second"] == 800.0
    assert bench.ratios(results) == {
        "dpo-b256": {"samples_per_second_x": 0.4, "replies_per_second_x": 0.8, "peak_gpu_gib_x": 1.5}
    }


def test_preference_bench_smoke(tmp_path):
    assert bench.main(["--smoke", "--objectives", "sft,dpo", "--out", str(tmp_path)]) == 0
    report = json.loads((tmp_path / "results.json").read_text())
    runs = {r["name"]: r for r in report["runs"]}
    assert set(runs) == {"sft-b8", "dpo-b8"}
    assert all(r["samples_per_second"] > 0 for r in runs.values())
    assert runs["dpo-b8"]["replies_per_second"] == 2 * runs["dpo-b8"]["samples_per_second"]
    assert runs["dpo-b8"]["reference_seconds"] > 0 and "reference_seconds" not in runs["sft-b8"]
    assert set(report["ratios"]) == {"dpo-b8"}
    assert "| dpo-b8 |" in (tmp_path / "results.md").read_text()
