"""finetune/memory.py: the memory model behind --per_device_train_batch_size auto and the Train tab's
pre-flight line, and the 'auto' value of the batch-size option (CLI and YAML)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from finetune import memory
from finetune.config import TrainConfig, parse_args
from finetune.memory import FIT_FRACTION, BatchTooLarge, Estimate, ModelShape, Setup

# facebook/blenderbot-400M-distill's shape (the random-400M preset), without building the preset
CONFIG_400M = SimpleNamespace(
    d_model=1280,
    encoder_layers=2,
    decoder_layers=12,
    encoder_ffn_dim=5120,
    decoder_ffn_dim=5120,
    decoder_attention_heads=32,
    vocab_size=8008,
    max_position_embeddings=128,
)
SHAPE = ModelShape.from_config(CONFIG_400M)
H200 = 139.8  # GiB, as torch reports the card


def test_parameter_count_is_the_400m_models():
    assert 360e6 < SHAPE.params < 370e6  # blenderbot-400M-distill: 365M weights (embeddings shared)


@pytest.mark.parametrize(
    "strategy,precision,processes,batch,measured",
    [  # measured peaks (torch.cuda.max_memory_allocated), docs/benchmarks.md
        ("zero2", "bf16", 1, 800, 56.5),  # one H200, 2026-12-01
        ("zero2", "bf16", 1, 1600, 108.0),
        ("zero2", "bf16", 1, 1920, 128.5),
        ("zero2", "fp16", 1, 800, 57.0),
        ("single", "bf16", 1, 400, 38.4),
        ("single", "bf16", 1, 800, 71.8),
        ("zero2", "fp16", 2, 800, 55.0),  # two H200s, 2026-11-30
        ("zero2", "bf16", 2, 1600, 105.9),
        ("ddp", "fp16", 2, 800, 73.1),
    ],
)
def test_estimate_is_within_10_percent_of_the_measured_peaks(strategy, precision, processes, batch, measured):
    est = memory.estimate(SHAPE, batch, Setup(strategy, precision, processes), H200)
    assert est.peak_gib == pytest.approx(measured, rel=0.10)


def test_peak_grows_with_batch_and_lengths():
    setup = Setup()
    peaks = [memory.estimate(SHAPE, b, setup).peak_gib for b in (1, 8, 64, 512)]
    assert peaks == sorted(peaks) and len(set(peaks)) == 4
    by_source = [memory.estimate(SHAPE, 64, Setup(source_len=s)).peak_gib for s in (32, 64, 128)]
    by_target = [memory.estimate(SHAPE, 64, Setup(target_len=t)).peak_gib for t in (16, 32, 64)]
    assert by_source == sorted(by_source) and by_target == sorted(by_target)
    assert len(set(by_source)) == 3 and len(set(by_target)) == 3
    # eager attention keeps the attention probabilities too
    assert memory.estimate(SHAPE, 64, Setup(attention="eager")).peak_gib > memory.estimate(SHAPE, 64, setup).peak_gib


def test_zero2_needs_less_per_gpu_than_ddp_and_less_with_more_gpus():
    for processes in (2, 4):
        zero2 = memory.estimate(SHAPE, 800, Setup("zero2", "fp16", processes), H200)
        ddp = memory.estimate(SHAPE, 800, Setup("ddp", "fp16", processes), H200)
        assert zero2.peak_gib < ddp.peak_gib and zero2.max_batch > ddp.max_batch
    static = [memory.static_bytes(SHAPE, Setup("zero2", "bf16", n)) for n in (1, 2, 8)]
    assert static == sorted(static, reverse=True)  # the optimizer state is partitioned
    offload = memory.static_bytes(SHAPE, Setup("zero3_offload", "bf16", 1))
    assert offload < static[-1]


def test_auto_picks_the_largest_fitting_multiple_of_8():
    for setup in (Setup(), Setup("ddp", "bf16", 2), Setup(source_len=64, target_len=32), Setup("zero2", "fp16", 1)):
        for capacity in (24.0, 80.0, H200):
            batch = memory.pick_batch(SHAPE, setup, capacity)
            assert batch % memory.MULTIPLE == 0 and batch > 0
            assert memory.estimate(SHAPE, batch, setup).peak_gib <= FIT_FRACTION * capacity
            assert memory.estimate(SHAPE, batch + memory.MULTIPLE, setup).peak_gib > FIT_FRACTION * capacity
    # the H200 run of 2026-12-01: auto took 1,920 rows and peaked at 128.5 GiB (92% of the card)
    assert memory.pick_batch(SHAPE, Setup(), H200) == 1920


def test_auto_without_a_gpu_is_a_fixed_default():
    assert memory.pick_batch(SHAPE, Setup(), None) == memory.CPU_BATCH == 8


def test_a_batch_that_does_not_fit_is_refused_naming_the_one_that_does():
    fits = memory.pick_batch(SHAPE, Setup(), H200)
    assert memory.check_fits(SHAPE, fits, Setup(), H200).peak_gib <= FIT_FRACTION * H200
    with pytest.raises(BatchTooLarge) as err:
        memory.check_fits(SHAPE, 4000, Setup(), H200)
    text = str(err.value)
    assert "--per_device_train_batch_size 4000" in text and f"{fits} fits" in text and "140 GiB" in text
    with pytest.raises(BatchTooLarge, match="not even one row fits.*zero3_offload"):
        memory.pick_batch(SHAPE, Setup("single", "bf16", 1), 4.0)  # 365M weights + Adam in fp32: ~5 GiB


def test_preflight_line():
    est = memory.estimate(SHAPE, 1600, Setup(), H200, gpu_name="NVIDIA H200", train_rows=10_000)
    assert est.seconds_per_epoch == pytest.approx(10_000 / 2238, rel=0.10)  # measured: 2,238 samples/s
    assert memory.preflight_line(est) == "≈ 108 GiB peak per GPU of 140; ≈ 5 s per epoch"
    unknown = memory.estimate(SHAPE, 8, Setup(), 24.0, gpu_name="Some GPU", train_rows=10_000)
    assert unknown.seconds_per_epoch is None and memory.preflight_line(unknown) == "≈ 5.6 GiB peak per GPU of 24"
    slow = Estimate(50.0, 0, 5400.0, 1.0, 0.1, None)
    assert memory.preflight_line(slow) == "≈ 50 GiB peak per GPU; ≈ 90 min per epoch"


def test_strategy_of_the_accelerate_configs():
    assert memory.strategy_of("configs/accelerate/zero2.yaml") == "zero2"
    assert memory.strategy_of("zero2_seed.yaml") == "zero2"
    assert memory.strategy_of("configs/accelerate/zero3_offload.yaml") == "zero3_offload"
    assert memory.strategy_of("ddp.yaml", processes=2) == "ddp"
    assert memory.strategy_of("ddp.yaml", processes=1) == "single"


def test_bad_setups_are_refused():
    with pytest.raises(ValueError, match="strategy must be one of"):
        Setup("zero1")
    with pytest.raises(ValueError, match="precision"):
        Setup(precision="fp8")
    with pytest.raises(ValueError, match="batch must be >= 1"):
        memory.estimate(SHAPE, 0, Setup())


def _accelerator(processes=1, mixed="no", zero_stage=None):
    plugin = (
        None if zero_stage is None else SimpleNamespace(deepspeed_config={"zero_optimization": {"stage": zero_stage}})
    )
    return SimpleNamespace(
        state=SimpleNamespace(deepspeed_plugin=plugin), num_processes=processes, mixed_precision=mixed
    )


def test_resolve_batch_on_the_cpu(monkeypatch):
    import torch

    monkeypatch.setattr(memory, "gpu", lambda: None)
    model = torch.nn.Linear(4, 4)
    model.config = CONFIG_400M
    cfg = TrainConfig(dataset_name="sample", per_device_train_batch_size="auto")
    assert memory.resolve_batch(cfg, _accelerator(), model) == memory.CPU_BATCH
    cfg = TrainConfig(dataset_name="sample", per_device_train_batch_size=3)
    assert memory.resolve_batch(cfg, _accelerator(zero_stage=2), model) == 3


def test_resolve_batch_on_a_gpu_takes_the_largest_fit_and_warns_about_a_misfit(monkeypatch, caplog):
    import torch

    monkeypatch.setattr(memory, "gpu", lambda: ("NVIDIA H200", H200))
    model = torch.nn.Linear(4, 4)
    model.config = CONFIG_400M
    params = sum(p.numel() for p in model.parameters())  # (the toy's own count is what gets used)
    expect = memory.pick_batch(ModelShape.from_config(CONFIG_400M, params=params), Setup(), H200)
    auto = TrainConfig(dataset_name="sample", per_device_train_batch_size="auto")
    assert memory.resolve_batch(auto, _accelerator(mixed="bf16", zero_stage=2), model) == expect
    huge = TrainConfig(dataset_name="sample", per_device_train_batch_size=1_000_000)
    with caplog.at_level("WARNING", logger="finetune.memory"):
        assert memory.resolve_batch(huge, _accelerator(mixed="bf16", zero_stage=2), model) == 1_000_000
    assert "fits" in caplog.text and "trying it anyway" in caplog.text


@pytest.mark.parametrize("value,expect", [("auto", "auto"), ("AUTO", "auto"), ("16", 16)])
def test_batch_size_option_takes_a_number_or_auto(value, expect):
    cfg = parse_args(["--dataset_name", "sample", "--per_device_train_batch_size", value])
    assert cfg.per_device_train_batch_size == expect


@pytest.mark.parametrize("value", ["0", "big", "1.5"])
def test_batch_size_option_refuses_other_values(value, capsys):
    with pytest.raises(SystemExit):
        parse_args(["--dataset_name", "sample", "--per_device_train_batch_size", value])
    assert "per_device_train_batch_size" in capsys.readouterr().err


def test_auto_round_trips_through_a_yaml_config(tmp_path, capsys):
    import yaml

    cfg = parse_args(["--dataset_name", "sample", "--per_device_train_batch_size", "auto"])
    path = tmp_path / "run.yaml"
    path.write_text(yaml.safe_dump({k: v for k, v in cfg.to_dict().items() if v is not None}))
    assert parse_args(["--config", str(path)]) == cfg
    path.write_text("dataset_name: sample\nper_device_train_batch_size: 32\n")
    assert parse_args(["--config", str(path)]).per_device_train_batch_size == 32
    path.write_text("dataset_name: sample\nper_device_train_batch_size: true\n")
    with pytest.raises(SystemExit):
        parse_args(["--config", str(path)])
    assert "whole number or 'auto'" in capsys.readouterr().err


# --------------------------------------------------------------------------- the shape from config.json alone


def test_local_shape_reads_a_model_folders_config(tiny_path):
    from transformers import AutoConfig

    from chat.layout import DEMO_DIR

    for folder in (DEMO_DIR, tiny_path):
        assert ModelShape.local(str(folder)) == ModelShape.from_config(AutoConfig.from_pretrained(folder))
    assert ModelShape.local("tiny") == ModelShape.local(str(tiny_path))  # a built preset: its folder


def test_local_shape_of_a_preset_not_built_yet_is_its_recipe(tmp_path, monkeypatch, tiny_path):
    monkeypatch.setenv("PERSONA_CHAT_CACHE", str(tmp_path))  # nothing built here, and nothing gets built
    assert ModelShape.local("random-400M") == SHAPE  # blenderbot-400M-distill's shape
    recipe, built = ModelShape.local("tiny"), ModelShape.local(str(tiny_path))
    assert recipe.d_model == built.d_model and recipe.params == pytest.approx(built.params, rel=0.05)
    assert not any(tmp_path.iterdir())


def test_local_shape_of_a_hub_id_comes_from_the_cache_only(tmp_path, monkeypatch):
    import json

    import huggingface_hub
    from huggingface_hub import constants

    def no_download(*args, **kwargs):
        raise AssertionError("an estimate must not download")

    monkeypatch.setattr(huggingface_hub, "hf_hub_download", no_download)
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path))
    assert ModelShape.local("someone/not-cached") is None
    assert ModelShape.local("not a repo id") is None
    # the layout huggingface_hub caches a downloaded file in
    repo = tmp_path / "models--someone--cached"
    (repo / "refs").mkdir(parents=True)
    (repo / "refs" / "main").write_text("0" * 40)
    snapshot = repo / "snapshots" / ("0" * 40)
    snapshot.mkdir(parents=True)
    (snapshot / "config.json").write_text(json.dumps(vars(CONFIG_400M)))
    assert ModelShape.local("someone/cached") == SHAPE
    (snapshot / "config.json").write_text('{"d_model": 12}')  # not an encoder-decoder's config
    assert ModelShape.local("someone/cached") is None
