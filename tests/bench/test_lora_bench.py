"""bench/train_lora.py: each run is the project's CLI with valid flags, LoRA is compared with the full
run of its own setup, and (slow) the CPU smoke run measures speed, memory, file sizes and BLEU."""

from __future__ import annotations

import json

import pytest

from bench import train_lora as bench
from chat.layout import ROOT
from finetune.config import parse_args


def flags_of(run: bench.Run) -> list[str]:
    return run.argv[run.argv.index("finetune") + 1 :]


def test_gpu_runs_are_the_tuned_cli_on_one_gpu(tmp_path):
    runs = {
        k: bench.timing_run(k, tmp_path, tmp_path / "w", gpu=True, processes=1, batch=800, steps=12, smoke=False)
        for k in bench.KINDS
    }
    for kind, run in runs.items():
        launch = run.argv[: run.argv.index("-m", 3)]
        assert launch[launch.index("--config_file") + 1] == "configs/accelerate/zero2.yaml"
        assert (ROOT / "configs/accelerate/zero2.yaml").is_file()
        assert launch[launch.index("--mixed_precision") + 1] == "bf16" and "--num_processes" in launch
        cfg = parse_args(flags_of(run))
        assert cfg.model_name_or_path == "random-400M" and cfg.per_device_train_batch_size == 800
        assert cfg.max_train_steps == 12 and cfg.logging_steps == 1 and not cfg.save_model
        assert (cfg.adapter, cfg.lora_fused) == {
            "full": ("none", True),
            "lora": ("lora", True),
            "lora-peft-layers": ("lora", False),
            "lora-no-dropout": ("lora", True),
        }[kind]
    assert parse_args(flags_of(runs["lora-no-dropout"])).lora_dropout == 0
    assert runs["lora"].name == "lora-gpu-x1-b800"


@pytest.mark.parametrize("processes", [1, 2])
def test_cpu_runs_save_their_final_folder_and_take_batch_8(tmp_path, processes):
    run = bench.timing_run("lora", tmp_path, tmp_path, gpu=False, processes=processes, batch=8, steps=6, smoke=False)
    cfg = parse_args(flags_of(run))
    assert cfg.save_model and cfg.per_device_train_batch_size == 8 and cfg.adapter == "lora"
    if processes == 1:  # python -m finetune itself
        assert run.argv[1:3] == ["-m", "finetune"]
    else:
        assert "configs/accelerate/cpu_zero2.yaml" in run.argv and "--mixed_precision" not in run.argv


def test_the_bleu_runs_are_the_readme_recipe(tmp_path):
    readme = (ROOT / "README.md").read_text()
    for flag in bench.README_RECIPE:
        assert flag in readme
    lora = bench.bleu_run("lora", tmp_path, smoke=False, lora_flags=["--lora_r", "16"])
    cfg = parse_args(flags_of(lora))
    assert (cfg.num_train_epochs, cfg.learning_rate, cfg.num_beams, cfg.adapter, cfg.lora_r) == (8, 1e-3, 4, "lora", 16)
    full = parse_args(flags_of(bench.bleu_run("full", tmp_path, smoke=False, lora_flags=["--lora_r", "16"])))
    assert full.adapter == "none" and full.lora_r == 8  # the LoRA flags go to the LoRA run only


def test_ratios_pair_each_lora_run_with_the_full_run_of_its_setup():
    results = [
        {
            "name": "full-cpu-x2-b8",
            "kind": "full",
            "ok": True,
            "samples_per_second": 1.0,
            "seconds_per_step": 16.0,
            "peak_rss_gib": 12.0,
            "saved_mib": 1400.0,
        },
        {
            "name": "lora-cpu-x2-b8",
            "kind": "lora",
            "ok": True,
            "samples_per_second": 2.5,
            "seconds_per_step": 6.4,
            "peak_rss_gib": 5.0,
            "saved_mib": 14.0,
        },
        {"name": "lora-peft-layers-cpu-x2-b8", "kind": "lora-peft-layers", "ok": False},
    ]
    assert bench.ratios(results) == {
        "lora-cpu-x2-b8": {
            "speed_x": 2.5,
            "seconds_per_step_x": 2.5,
            "peak_rss_gib_fraction": 5 / 12,
            "saved_mib_fraction": 0.01,
        }
    }


def test_smoke_run_measures_lora_against_full(tmp_path):
    assert bench.main(["--smoke", "--out", str(tmp_path)]) == 0
    report = json.loads((tmp_path / "results.json").read_text())
    runs = {r["name"]: r for r in report["runs"]}
    assert set(runs) == {"full-cpu-x1-b8", "lora-cpu-x1-b8", "lora-peft-layers-cpu-x1-b8", "bleu-full", "bleu-lora"}
    for name in ("full-cpu-x1-b8", "lora-cpu-x1-b8"):
        assert runs[name]["seconds_per_step"] > 0 and runs[name]["peak_rss_gib"] > 0.1
        assert runs[name]["cpu_seconds_per_step"] > 0
    assert runs["lora-cpu-x1-b8"]["saved_file"] == "adapter_model.safetensors"
    assert runs["full-cpu-x1-b8"]["saved_file"] == "model.safetensors"
    assert runs["lora-cpu-x1-b8"]["saved_mib"] < runs["full-cpu-x1-b8"]["saved_mib"]
    assert 0 <= runs["bleu-lora"]["eval_bleu"] <= 100 and 0 <= runs["bleu-full"]["eval_bleu"] <= 100
    assert "lora-cpu-x1-b8" in report["ratios"] and "bleu-lora" in report["ratios"]
    assert "| lora-cpu-x1-b8 |" in (tmp_path / "results.md").read_text()


def test_cpu_seconds_per_step_count_the_steps_after_the_first():
    samples = [(t, 0, 0, 3.0 * t) for t in range(0, 100)]  # 3 CPU seconds every second
    logs = [{"step": s, "time": 10 * s} for s in (1, 2, 3, 4)]
    assert bench.cpu_seconds_per_step(samples, logs) == {"cpu_seconds_per_step": 30.0}
    assert bench.cpu_seconds_per_step(samples, logs[:2]) == {}
    fast = [{"step": s, "time": 10 + s / 100} for s in (1, 2, 3, 4)]  # all between two samples
    assert bench.cpu_seconds_per_step(samples, fast) == {}
