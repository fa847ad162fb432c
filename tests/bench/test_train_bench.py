"""bench/train.py and its parts (train_runs.py, train_report.py): a run's argv is valid CLI input, the
max-batch search, and the CPU smoke run (the real CLI on the tiny model, both recipes side by side)."""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from dataclasses import asdict

import pytest

from bench import train as train_bench
from bench.train_compute import zero_overrides
from bench.train_report import speedups
from bench.train_runs import Variant, command, env_of
from chat.layout import ROOT
from finetune.config import parse_args


def _split(argv):
    i = argv.index("finetune")
    return argv[:i], argv[i + 1 :]


@pytest.mark.parametrize(
    "recipe,strategy,config",
    [
        ("seed", "zero2", "zero2_seed.yaml"),
        ("tuned", "zero2", "zero2.yaml"),
        ("seed", "ddp", "ddp.yaml"),
        ("tuned", "ddp", "ddp.yaml"),
    ],
)
def test_gpu_commands_are_the_cli_with_each_recipe(tmp_path, recipe, strategy, config):
    v = Variant(recipe, strategy, "fixed", 800, 2, evaluate=True)
    launcher, args = _split(command(v, tmp_path, tmp_path / "out", smoke=False))
    assert launcher[launcher.index("--config_file") + 1] == f"configs/accelerate/{config}"
    assert (ROOT / "configs" / "accelerate" / config).is_file()
    assert launcher[launcher.index("--mixed_precision") + 1] == ("fp16" if recipe == "seed" else "bf16")
    cfg = parse_args(args)  # every flag the bench passes is a real CLI flag with a valid value
    assert cfg.per_device_train_batch_size == 800 and cfg.n_val == 1000 and not cfg.save_model
    assert cfg.val_min_target_length == cfg.val_max_target_length == 64  # replies forced to full length
    seed = recipe == "seed"
    assert cfg.pad_to_max_length is seed and cfg.fast_ngram_blocking is not seed and not cfg.group_by_length
    assert cfg.per_device_eval_batch_size == (100 if seed else 500)


def test_compute_runs_use_the_recipes_deepspeed_json_without_the_cli(tmp_path):
    seed = command(Variant("seed", "zero2", "fixed", 800, 1, mode="compute"), tmp_path, tmp_path / "o", smoke=False)
    launcher, args = seed[: seed.index("-m", 3)], seed[seed.index("-m", 3) + 1 :]
    assert launcher[launcher.index("--config_file") + 1] == "configs/accelerate/zero2_seed.yaml"
    assert args[0] == "bench.train_compute" and args[args.index("--pad") + 1] == "max"
    assert args[args.index("--batch") + 1] == "800" and args[args.index("--compile") + 1] == "none"
    lever = Variant("tuned", "zero2", "fixed", 1600, 1, mode="compute", compile="layers", bucket=5e8)
    assert lever.name == "tuned-compute-zero2-bf16-fixed-b1600-x1-compile-bucket500M" and not lever.plain
    argv = command(lever, tmp_path, tmp_path / "o", smoke=False)
    assert argv[argv.index("--bucket") + 1] == "5e+08" and argv[argv.index("--pad") + 1] == "batch"
    assert Variant("tuned", "zero2", "fixed", "auto", 1).name == "tuned-zero2-bf16-fixed-bauto-x1"
    profiled = Variant("tuned", "zero2", "fixed", 1600, 1, mode="compute", compile="model", profile=2)
    argv = command(profiled, tmp_path, tmp_path / "o", smoke=False)
    assert argv[argv.index("--profile") + 1] == "2" and argv[argv.index("--compile") + 1] == "model"
    assert profiled.name.endswith("-compile-model")
    zero = Variant("tuned", "zero2", "fixed", 1600, 1, mode="compute", zero="stage=1,overlap_comm=false")
    argv = command(zero, tmp_path, tmp_path / "o", smoke=False)
    assert argv[argv.index("--zero") + 1] == "stage=1,overlap_comm=false"
    assert zero.name.endswith("-zero-stage1-overlap_commfalse")
    assert zero_overrides("stage=1,overlap_comm=false") == {"stage": 1, "overlap_comm": False}
    with pytest.raises(argparse.ArgumentTypeError, match="key=value"):
        zero_overrides("stage")
    # the allocator part sets expandable segments both ways explicitly (the CLI's default is on)
    alloc = train_bench.plan(["alloc"], 1, 800, 1600, smoke=False, strategies=("zero2",))
    assert [env_of(v)["PYTORCH_CUDA_ALLOC_CONF"] for v in alloc] == [
        *["expandable_segments:False"] * 2,
        *["expandable_segments:True"] * 2,
    ]
    assert len({v.name for v in alloc}) == 4 and env_of(lever) is None
    # every train-part seed run has its compute twin, at the same batch
    planned = train_bench.plan(["train"], 1, 800, 1600, smoke=False, strategies=("zero2",))
    assert [v.name for v in planned] == [
        "seed-zero2-fp16-fixed-b800-x1",
        "seed-compute-zero2-fp16-fixed-b800-x1",
        "tuned-zero2-bf16-fixed-b1600-x1",
    ]


def test_max_batch_search_finds_the_largest_fitting_multiple():
    for limit in (37, 100, 800, 1234, 5000):
        tried = []

        def fits(batch, tried=tried, limit=limit):
            tried.append(batch)
            return batch <= limit

        for estimate in (None, limit, 3 * limit, limit // 2 + 1):
            tried.clear()
            assert train_bench.search_max_batch(fits, start=8, estimate=estimate, step=8) == limit - limit % 8
            assert len(tried) <= 2 * limit.bit_length() + 2  # logarithmic, not a scan
            assert all(b % 8 == 0 for b in tried)


def test_speedups_pair_recipes_of_the_same_setup():
    def result(recipe, data, rate, evaluate=None, n=2):
        v = Variant(recipe, "zero2", data, 800, n)
        return {"name": v.name, "ok": True, "variant": asdict(v), "samples_per_second": rate, "eval_seconds": evaluate}

    runs = [
        result("seed", "fixed", 100, 30.0),
        result("tuned", "fixed", 160, 5.0),
        result("seed", "realistic", 100),
        result("tuned", "realistic", 350),
        result("tuned", "fixed", 85, n=1),
    ]
    nopack = Variant("tuned", "zero2", "realistic", 800, 2, packing=False)  # the lever switched off
    runs.append({"name": nopack.name, "ok": True, "variant": asdict(nopack), "samples_per_second": 220})
    got = speedups(runs)
    assert got[f"{nopack.name} vs seed"] == pytest.approx(2.2)
    assert got["training samples/s, zero2, fixed"] == pytest.approx(1.6)
    assert got["evaluation, zero2, fixed (seed s / tuned s)"] == pytest.approx(6.0)
    assert got["training samples/s, zero2, realistic"] == pytest.approx(3.5)
    assert got["scaling efficiency 1 -> 2 GPUs"] == pytest.approx(160 / 170)


def test_smoke_run_measures_both_recipes(tmp_path, tiny_path):
    out = tmp_path / "bench"
    proc = subprocess.run(
        [sys.executable, "-m", "bench.train", "--smoke", "--parts", "train", "--out", str(out)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=600,
        check=False,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    report = json.loads((out / "results.json").read_text())
    runs = {r["variant"]["recipe"]: r for r in report["runs"] if r["variant"]["mode"] == "cli"}
    assert set(runs) == {"seed", "tuned"}
    for r in runs.values():
        assert r["ok"] and r["samples_per_second"] > 0 and r["eval_seconds"] > 0 and len(r["losses"]) == 4
        assert r["first_step_seconds"] > 0
    # the seed's compute alone: its JSON, batches already on the device, the sample-data loss after
    (compute,) = [r for r in report["runs"] if r["variant"]["mode"] == "compute"]
    assert compute["name"] == "seed-compute-zero2-fp32-fixed-b4-x1" and compute["ok"], compute.get("error")
    assert compute["samples_per_second"] > 0 and len(compute["losses"]) == 4 and compute["eval_loss"] > 0
    assert report["speedups"]["training samples/s, zero2, fixed"] > 0
    assert report["speedups"]["training samples/s, zero2, fixed, tuned vs seed compute"] > 0
    table = (out / "results.md").read_text()
    assert "| seed-zero2-fp32-fixed-b4-x1 |" in table and "| tuned-zero2-fp32-fixed-b4-x1 |" in table
    assert "| seed-compute-zero2-fp32-fixed-b4-x1 |" in table


def test_max_batch_estimate_is_linear_in_the_batch():
    v = Variant("seed", "ddp", "fixed", 800, 2)
    result = {"variant": asdict(v), "peak_gib": 52.0, "static_gib": 2.0}
    # 50 GiB of activations for 800 rows; (97 - 2) / (50 / 800) rows fit in 97% of 100 GiB
    assert train_bench.estimate_max_batch(result, 100.0) == 1520
    assert train_bench.estimate_max_batch(dict(result, peak_gib=None), 100.0) is None


def test_max_batch_search_needs_few_probes_near_a_good_estimate():
    # Each GPU probe is a full launch, so a close estimate must save most of them.
    for limit in (1900, 2003, 2150):
        tried = []

        def fits(batch, tried=tried, limit=limit):
            tried.append(batch)
            return batch <= limit

        assert train_bench.search_max_batch(fits, start=800, estimate=2003, step=32) == limit - limit % 32
        assert len(tried) <= 6, tried


@pytest.mark.parametrize(
    "argv,message",
    [
        (["--max_batch_setups", "seed-zero3"], "--max_batch_setups takes"),
        (["--reuse", "no/such/results.json"], "not a readable results.json"),
    ],
)
def test_bad_max_batch_options_are_refused_before_any_work(tmp_path, capsys, argv, message):
    with pytest.raises(SystemExit) as exit:
        train_bench.main(["--out", str(tmp_path / "b"), "--parts", "maxbatch", *argv])
    assert exit.value.code == 2 and message in capsys.readouterr().err
    assert not (tmp_path / "b").exists()
