"""finetune/jobs/spec.py: a run = the CLI's TrainConfig + launch settings, checked on creation;
the app's preset; run.json's spec, including the flat RunSpec of older run folders."""

import dataclasses
import re

import pytest
from jobs_helpers import OLD_SPEC, good_rows, spec, write_jsonl

from chat.layout import ROOT
from finetune.config import TrainConfig, parse_args
from finetune.jobs.spec import APP_PRESET, LIMITS, JobSpec, _from_run_spec, app_config, app_defaults, make_config


@pytest.mark.parametrize(
    "kwargs,message",
    [
        ({"num_train_epochs": 0}, "num_train_epochs must be >= 1"),
        ({"num_train_epochs": 2.5}, "num_train_epochs must be a whole number"),
        (
            {"per_device_train_batch_size": None},
            "per_device_train_batch_size must be a positive whole number or 'auto', got nothing",
        ),
        ({"n_train": 0}, "n_train must be >= 1"),
        ({"learning_rate": 0}, "learning_rate must be > 0"),
        ({"learning_rate": float("nan")}, "learning_rate must be a finite number"),
        ({"learning_rate": "fast"}, "learning_rate must be a number"),
        ({"num_beams": True}, "num_beams must be a whole number"),
        ({"push_to_hub": "yes"}, "push_to_hub must be true or false"),
        ({"source_prefix": 3}, "source_prefix must be text"),
        ({"strategy": "fsdp"}, "strategy must be one of zero2, zero3_offload, ddp"),
        ({"precision": "int8"}, "precision must be one of"),
        ({"num_gpus": -1}, "num_gpus must be >= 0"),
        ({"strategy": "ddp"}, "needs GPUs"),
        ({"strategy": "zero3_offload"}, "needs GPUs"),
        ({"precision": "fp16"}, "needs GPUs"),
        ({"precision": "bf16"}, "needs GPUs"),
        ({"push_to_hub": True}, "push_to_hub needs --hub_model_id"),
        ({"hub_model_id": "no-slash"}, "must look like 'user/name'"),
        ({"hub_model_id": "a b/c"}, "must look like 'user/name'"),
        (
            {"validation_file": str(ROOT / "data/sample/validation.jsonl")},
            "--train_file and --validation_file go together",
        ),
        ({"model": ""}, "model is required"),
        ({"model": "two words"}, "is not a preset"),
        ({"dataset_name": ""}, "give --dataset_name or --train_file"),
        ({"dataset_name": "a b/c"}, "is not 'sample'"),
        ({"output_dir": "/tmp/elsewhere"}, "output_dir is not part of a run's spec"),
        ({"resume_from_checkpoint": "latest"}, "resume_from_checkpoint is not part of a run's spec"),
        ({"profile_dir": "/tmp/profile"}, "profile_dir writes outside the run folder"),
        ({"no_such_setting": 1}, "unknown training settings: no_such_setting"),
    ],
)
def test_spec_validation(roots, kwargs, message):
    with pytest.raises(ValueError, match=re.escape(message)):
        spec(**kwargs)


@pytest.mark.parametrize(
    "kwargs,message",
    [
        ({"num_train_epochs": 1e30}, "num_train_epochs must be at most 1,000 for runs of the app, got 1e+30"),
        ({"num_beams": 1000}, "num_beams must be at most 32 for runs of the app, got 1,000"),
        ({"per_device_train_batch_size": 1e9}, "per_device_train_batch_size must be at most 65,536"),
        ({"per_device_eval_batch_size": 65537}, "per_device_eval_batch_size must be at most 65,536"),
        ({"max_source_length": 100000}, "max_source_length must be at most 1,024"),
        ({"max_target_length": 1025}, "max_target_length must be at most 1,024"),
        ({"max_train_steps": 10**7 + 1}, "max_train_steps must be at most 10,000,000"),
        ({"logging_steps": 10**8}, "logging_steps must be at most 10,000,000"),
        ({"checkpointing_steps": 10**8}, "checkpointing_steps must be at most 10,000,000"),
        ({"n_train": 10**9 + 1}, "n_train must be at most 1,000,000,000"),
        ({"n_val": 1e12}, "n_val must be at most 1,000,000,000"),
        ({"gradient_accumulation_steps": 2048}, "gradient_accumulation_steps must be at most 1,024"),
        ({"learning_rate": 1.5}, "learning_rate must be at most 1 for runs of the app, got 1.5"),
        ({"num_warmup_steps": 10**9}, "num_warmup_steps must be at most 10,000,000"),
        ({"dataloader_num_workers": 1000}, "dataloader_num_workers must be at most 64"),
    ],
)
def test_spec_upper_bounds(roots, kwargs, message):
    with pytest.raises(ValueError, match=re.escape(message)):
        spec(**kwargs)
    ((name, value),) = kwargs.items()
    with pytest.raises(ValueError, match=re.escape(message)):  # run.json's spec is checked the same way
        JobSpec.from_dict({**spec().to_dict(), "config": {**spec().to_dict()["config"], name: value}})


def test_spec_accepts_values_at_the_bounds(roots):
    at = {name: limit for name, limit in LIMITS.items() if name != "val_min_target_length"}
    made = spec(**at, adapter="lora")  # (the lora_* bounds: a LoRA run)
    assert all(getattr(made.config, name) == limit for name, limit in at.items())
    assert parse_args(["--num_beams", "1000", "--num_train_epochs", "100000"]).num_beams == 1000  # the CLI: as it was


def test_spec_accepts_form_values(roots):
    made = spec(num_train_epochs=2.0, n_train=None, n_val=16.0, hub_model_id="", num_gpus=0.0, learning_rate=1)
    cfg = made.config
    assert (cfg.num_train_epochs, cfg.n_val, cfg.hub_model_id, made.num_gpus) == (2, 16, None, 0)
    assert isinstance(cfg.num_train_epochs, int) and isinstance(cfg.learning_rate, float)
    assert made.precision == "auto" and made.strategy == "zero2" and made.split_train_file is None
    assert spec(hub_model_id=" me/chat ").config.hub_model_id == "me/chat"
    assert spec(source_prefix="").config.source_prefix == ""  # an empty prefix is a prefix, not "missing"


def test_short_targets_lower_the_generation_minimum():
    cfg = make_config(max_target_length=8)
    assert (cfg.val_min_target_length, cfg.val_max_target_length) == (8, 8)
    assert make_config(max_target_length=8, val_max_target_length=30).val_min_target_length == 20
    assert make_config(max_target_length=64).val_min_target_length == 20  # the CLI's default stays
    with pytest.raises(ValueError, match="val_min_target_length is larger"):
        make_config(max_target_length=8, val_min_target_length=9)  # given explicitly: the CLI's check


def test_the_app_preset_is_one_dict_of_config_overrides():
    fields = {f.name for f in dataclasses.fields(TrainConfig)}
    assert all(set(overrides) <= fields for overrides in APP_PRESET.values())
    tiny, large = app_config("tiny"), app_config("facebook/blenderbot-400M-distill")
    assert (tiny.num_train_epochs, tiny.per_device_train_batch_size, tiny.per_device_eval_batch_size) == (3, "auto", 32)
    assert (tiny.num_beams, tiny.logging_steps, tiny.learning_rate) == (4, 10, 1e-3)
    assert large.learning_rate == 5e-5 == TrainConfig().learning_rate and large.num_train_epochs == 3
    assert app_defaults("tiny") == {**APP_PRESET["*"], "learning_rate": 1e-3}
    assert app_config("tiny", num_beams=1).num_beams == 1  # values win over the preset


def test_run_json_spec_round_trips(roots):
    _, uploads = roots
    (uploads / "train.jsonl").write_text('{"texts": "a", "labels": "b"}\n' * 3)
    for made in (
        spec(),
        spec(max_target_length=8, n_train=50, push_to_hub=True, hub_model_id="me/chat"),
        spec(split_train_file=str(uploads / "train.jsonl")),
    ):
        data = made.to_dict()
        assert set(data) == {"config", "strategy", "precision", "num_gpus", "split_train_file"}
        assert "output_dir" not in data["config"] and "resume_from_checkpoint" not in data["config"]
        assert JobSpec.from_dict(data) == made


def test_old_run_spec_is_read(roots):
    _, uploads = roots
    made = JobSpec.from_dict(OLD_SPEC)
    assert made == spec(
        n_train=200,
        n_val=8,
        num_train_epochs=2,
        learning_rate=1e-3,
        per_device_train_batch_size=8,
        per_device_eval_batch_size=8,
        max_target_length=8,
        source_prefix="-x: ",
        checkpointing_steps=5,
        num_beams=1,
        logging_steps=2,
    )
    assert made.config.val_min_target_length == 8  # as the old command's --val_min_target_length 8

    train = uploads / "train.jsonl"
    val = uploads / "val.jsonl"
    for path in (train, val):
        path.write_text('{"texts": "a", "labels": "b"}\n' * 3)
    alone = JobSpec.from_dict({**OLD_SPEC, "dataset": str(train)})
    assert alone.split_train_file == str(train) and alone.config.train_file is None
    both = JobSpec.from_dict({**OLD_SPEC, "dataset": str(train), "validation_file": str(val)})
    assert (both.config.train_file, both.config.validation_file, both.split_train_file) == (str(train), str(val), None)
    hub = _from_run_spec(
        {
            **OLD_SPEC,
            "dataset": "smangrul/MuDoConv",
            "model": "facebook/blenderbot-400M-distill",
            "num_gpus": 2,
            "strategy": "ddp",
            "precision": "bf16",
        }
    )
    assert hub["config"]["dataset_name"] == "smangrul/MuDoConv"
    assert (hub["num_gpus"], hub["strategy"], hub["precision"]) == (2, "ddp", "bf16")
    assert hub["config"]["model_name_or_path"] == "facebook/blenderbot-400M-distill"
    with pytest.raises(ValueError, match="unknown launch settings: colour"):
        JobSpec.from_dict({**spec().to_dict(), "colour": "blue"})


# --------------------------------------------------------------------------- feedback files


def test_feedback_files_must_be_in_the_data_folder(roots, tmp_path):
    _, uploads = roots
    (uploads / "feedback").mkdir()
    inside = write_jsonl(uploads / "feedback" / "train.jsonl", good_rows(3))
    held = write_jsonl(uploads / "feedback" / "heldout.jsonl", good_rows(2))
    made = spec(feedback_file=f" {inside} ", feedback_ratio=0.25, feedback_validation_file=str(held))
    assert (made.config.feedback_file, made.config.feedback_validation_file) == (str(inside), str(held))
    assert JobSpec.from_dict(made.to_dict()) == made
    outside = write_jsonl(tmp_path / "elsewhere.jsonl", good_rows(3))
    with pytest.raises(ValueError, match="feedback file .* is a local path outside the allowed folders"):
        spec(feedback_file=str(outside))
    # the sample folder is allowed for data, never as feedback
    with pytest.raises(ValueError, match="feedback held-out file .* must be in the data folder"):
        spec(feedback_file=str(inside), feedback_validation_file=str(ROOT / "data/sample/validation.jsonl"))
    with pytest.raises(ValueError, match="feedback file 'nothing.jsonl': no such file"):
        spec(feedback_file="nothing.jsonl")
    with pytest.raises(ValueError, match="unsupported file type"):
        spec(feedback_file=str(write_jsonl(uploads / "fb.txt", good_rows(1))))
    with pytest.raises(ValueError, match="needs --feedback_file"):
        spec(feedback_validation_file=str(held))


def test_preference_files_must_be_in_the_data_folder_or_the_shipped_sample(roots, tmp_path):
    _, uploads = roots
    (uploads / "feedback").mkdir()
    pair = {"texts": "hi", "chosen": "hello!", "rejected": "go away."}
    inside = write_jsonl(uploads / "feedback" / "preferences.jsonl", [pair] * 3)
    made = spec(objective="dpo", preference_file=f" {inside} ")
    assert made.config.preference_file == str(inside) and JobSpec.from_dict(made.to_dict()) == made
    shipped = ROOT / "data/sample/preferences-train.jsonl", ROOT / "data/sample/preferences-validation.jsonl"
    made = spec(objective="dpo", preference_file=str(shipped[0]), preference_validation_file=str(shipped[1]))
    assert (made.config.preference_file, made.config.preference_validation_file) == tuple(map(str, shipped))
    with pytest.raises(ValueError, match="preference held-out file .* must be in the data folder"):
        spec(
            objective="dpo",
            preference_file=str(inside),
            preference_validation_file=str(ROOT / "data/sample/train.jsonl"),
        )
    outside = write_jsonl(tmp_path / "elsewhere.jsonl", [pair])
    with pytest.raises(ValueError, match="preference file .* is a local path outside the allowed folders"):
        spec(objective="kto", preference_file=str(outside))
    with pytest.raises(ValueError, match="needs --preference_file"):
        spec(objective="dpo")


@pytest.mark.parametrize(
    "value,expect", [("auto", "auto"), (" AUTO ", "auto"), ("16", 16), (16, 16), (16.0, 16), (65536, 65536)]
)
def test_the_train_batch_is_a_whole_number_or_auto(value, expect):
    assert make_config(dataset_name="sample", per_device_train_batch_size=value).per_device_train_batch_size == expect


@pytest.mark.parametrize(
    "value,message",
    [
        ("lots", "per_device_train_batch_size must be a positive whole number or 'auto', got 'lots'"),
        ("2.5", "must be a positive whole number or 'auto', got '2.5'"),
        (2.5, "must be a positive whole number or 'auto', got 2.5"),
        (True, "must be a positive whole number or 'auto', got True"),
        ("", "per_device_train_batch_size must be a positive whole number or 'auto', got nothing"),
        (0, "must be a positive whole number or 'auto', got 0"),
        ("-3", "must be a positive whole number or 'auto', got '-3'"),
    ],
)
def test_the_train_batch_refuses_anything_else(value, message):
    with pytest.raises(ValueError, match=re.escape(message)):
        make_config(dataset_name="sample", per_device_train_batch_size=value)


def test_auto_passes_the_limits_and_round_trips_through_run_json(roots):
    made = spec(per_device_train_batch_size="auto")
    assert made.config.per_device_train_batch_size == "auto"
    assert JobSpec.from_dict(made.to_dict()) == made
    with pytest.raises(ValueError, match="per_device_train_batch_size must be at most 65,536"):
        spec(per_device_train_batch_size="70000")
