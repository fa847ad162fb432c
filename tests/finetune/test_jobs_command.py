"""finetune/jobs/command.py: the launch command, generated from the run's TrainConfig; the CLI's
own parser reads back exactly that config."""

import dataclasses
import os
import random
import shlex
import sys
import typing
from pathlib import Path

import pytest
from jobs_helpers import good_rows, launcher_args, spec, write_jsonl

from chat.layout import ROOT
from chat.model import ATTENTION
from finetune.config import EVAL_ATTENTION, TRACKERS, TrainConfig, parse_args
from finetune.jobs import command
from finetune.jobs.command import build_command, format_command, run_config, training_args
from finetune.jobs.manager import RunManager
from finetune.jobs.spec import STRATEGIES


def test_cpu_command_is_the_readme_recipe(tmp_path, monkeypatch):
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0, 1, 2, 3})
    made = spec(num_train_epochs=8, num_beams=4)
    argv = build_command(made, tmp_path / "run")
    assert isinstance(argv, list) and all(isinstance(a, str) for a in argv)
    args = launcher_args(argv)
    assert args.config_file == "configs/accelerate/cpu_zero2.yaml" and (ROOT / args.config_file).is_file()
    assert args.num_processes == 2  # the tested CPU recipe, however many cores
    assert args.mixed_precision == "no" and args.main_process_port > 0
    assert args.module and args.training_script == "finetune"
    # the CLI's own parser accepts the rest and reads back the form's values
    cfg = parse_args(args.training_script_args)
    assert cfg == run_config(made, tmp_path / "run")
    assert (cfg.model_name_or_path, cfg.dataset_name, cfg.train_file) == ("tiny", "sample", None)
    assert (cfg.num_train_epochs, cfg.learning_rate, cfg.num_beams) == (8, 1e-3, 4)
    assert (cfg.per_device_train_batch_size, cfg.per_device_eval_batch_size) == ("auto", 32)  # the app's preset
    assert (cfg.max_source_length, cfg.max_target_length, cfg.source_prefix) == (128, 64, "chatbot: ")
    assert cfg.output_dir == str((tmp_path / "run").resolve()) and cfg.resume_from_checkpoint is None
    assert not cfg.push_to_hub and cfg.checkpointing_steps is None

    # the README's CPU command, flag for flag (launcher part; the port is ours)
    readme = (ROOT / "README.md").read_text()
    line = next(row for row in readme.splitlines() if row.startswith("accelerate launch") and "cpu_zero2" in row)
    documented = shlex.split(line.rstrip("\\"))[2:]
    ours = argv[3 : argv.index("finetune") - 1]
    assert documented == ["--config_file", "configs/accelerate/cpu_zero2.yaml", "-m", "finetune"]
    assert ours[:2] == documented[:2]
    for flag in (
        "--model_name_or_path",
        "--dataset_name",
        "--num_train_epochs",
        "--learning_rate",
        "--per_device_train_batch_size",
        "--per_device_eval_batch_size",
        "--num_beams",
        "--output_dir",
    ):
        assert flag in readme and flag in argv

    # one core: one process
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0})
    assert launcher_args(build_command(made, tmp_path / "run")).num_processes == 1


def test_resume_adds_latest(tmp_path):
    made = spec(checkpointing_steps=20, n_train=100, n_val=8)
    plain, resumed = build_command(made, tmp_path), build_command(made, tmp_path, resume=True)
    assert "--resume_from_checkpoint" not in plain
    assert resumed[-2:] == ["--resume_from_checkpoint", "latest"]

    def strip_port(a):  # the port is fresh each time
        return [x for i, x in enumerate(a) if "--main_process_port" not in (x, a[i - 1])]

    assert strip_port(resumed[:-2]) == strip_port(plain)
    cfg = parse_args(launcher_args(resumed).training_script_args)
    assert (cfg.resume_from_checkpoint, cfg.checkpointing_steps, cfg.n_train, cfg.n_val) == ("latest", 20, 100, 8)
    assert cfg == run_config(made, tmp_path, resume=True)


@pytest.mark.parametrize(
    "strategy,precision,gpus,bf16,config,mixed",
    [
        ("zero2", "fp16", 2, True, "zero2.yaml", "fp16"),
        ("zero2", "auto", 8, True, "zero2.yaml", "bf16"),
        ("zero2", "auto", 1, False, "zero2.yaml", "fp16"),
        ("ddp", "fp32", 2, True, "ddp.yaml", "no"),  # overrides ddp.yaml's own fp16
        ("ddp", "bf16", 4, False, "ddp.yaml", "bf16"),
        ("zero3_offload", "fp16", 1, False, "zero3_offload.yaml", "fp16"),
        ("zero3_offload", "auto", 2, True, "zero3_offload.yaml", "bf16"),
    ],
)
def test_gpu_commands(tmp_path, monkeypatch, strategy, precision, gpus, bf16, config, mixed):
    monkeypatch.setattr(command, "gpu_supports_bf16", lambda: bf16)
    made = spec(
        "facebook/blenderbot-400M-distill",
        dataset_name="smangrul/MuDoConv",
        strategy=strategy,
        precision=precision,
        num_gpus=gpus,
        learning_rate=1e-6,
        push_to_hub=True,
        hub_model_id="someone/chat",
        hub_private=True,
    )
    argv = build_command(made, tmp_path)
    args = launcher_args(argv)
    assert args.config_file == f"configs/accelerate/{config}" and (ROOT / args.config_file).is_file()
    assert args.num_processes == gpus and args.mixed_precision == mixed
    cfg = parse_args(args.training_script_args)
    assert cfg.model_name_or_path == "facebook/blenderbot-400M-distill" and cfg.dataset_name == "smangrul/MuDoConv"
    assert cfg.learning_rate == 1e-6
    assert cfg.push_to_hub and cfg.hub_model_id == "someone/chat" and cfg.hub_private
    assert cfg == run_config(made, tmp_path)


def test_every_strategy_has_an_accelerate_config():
    assert set(command.CONFIG_FILES) == set(STRATEGIES)
    for name in (*command.CONFIG_FILES.values(), command.CPU_CONFIG):
        assert (ROOT / command.ACCELERATE_DIR / name).is_file()


def test_readme_gpu_command_prefix(tmp_path):
    readme = (ROOT / "README.md").read_text()
    line = next(
        row for row in readme.splitlines() if row.startswith("accelerate launch") and "/zero2.yaml --num" in row
    )
    documented = shlex.split(line.rstrip("\\"))[2:]  # --config_file ... --num_processes 2 --mixed_precision bf16
    argv = build_command(spec(num_gpus=2, precision="bf16"), tmp_path)
    ours = argv[3 : argv.index("--main_process_port")]
    assert ours == documented


def test_format_command_round_trips(tmp_path):
    argv = build_command(spec(source_prefix="chat bot's: "), tmp_path / "a dir")
    line = format_command(argv)
    assert isinstance(line, str) and shlex.split(line) == argv


@pytest.mark.parametrize("prefix", ["", "-x: ", "--num_beams 9 ", "chatbot: "])
def test_any_source_prefix_reaches_the_cli_intact(tmp_path, prefix):
    cfg = parse_args(launcher_args(build_command(spec(source_prefix=prefix), tmp_path)).training_script_args)
    assert cfg.source_prefix == prefix and cfg.num_beams == 4


def test_short_targets_lower_the_generation_minimum(tmp_path):
    argv = build_command(spec(max_target_length=8), tmp_path)
    cfg = parse_args(launcher_args(argv).training_script_args)
    assert cfg.val_min_target_length == 8 and cfg.val_max_target_length == 8
    # A run's command gives every setting (Show command prints it): the derived maximum too.
    assert argv[argv.index("--val_max_target_length") + 1] == argv[argv.index("--val_min_target_length") + 1] == "8"
    flags = training_args(run_config(spec(max_target_length=8), tmp_path))  # only the changes:
    assert "--val_min_target_length" in flags and "--val_max_target_length" not in flags  # derived, no flag


def test_a_runs_command_gives_every_setting(tmp_path):
    """Show command (and the run) left out the flags at their defaults: a reader could not see the
    CLI's num_beams 10 or val_min_target_length 20. Every field with a value is a flag now."""
    cfg = run_config(spec(), tmp_path)
    full = training_args(cfg, full=True)
    given = {arg.split("=")[0][2:] for arg in full if arg.startswith("--")}
    assert given == {f.name for f in dataclasses.fields(TrainConfig) if getattr(cfg, f.name) is not None}
    assert parse_args(full) == cfg
    assert full[full.index("--num_beams") + 1] == "4" and "--fast_ngram_blocking" in full
    assert full[full.index("--pad_to_max_length") + 1] == "false"  # a false boolean, said
    assert launcher_args(build_command(spec(), tmp_path)).training_script_args == full


def test_flags_are_only_the_changes(tmp_path):
    cfg = TrainConfig()
    assert training_args(cfg) == []
    assert training_args(dataclasses.replace(cfg, save_model=False, pad_to_max_length=True, weight_decay=-0.5)) == [
        "--pad_to_max_length",
        "--weight_decay=-0.5",
        "--save_model",
        "false",
    ]
    with pytest.raises(ValueError, match="dataset_name cannot be None"):
        training_args(dataclasses.replace(cfg, dataset_name=None, train_file="t.jsonl", validation_file="v.jsonl"))


# --------------------------------------------------------------------------- round trip


def _random_config(rng: random.Random) -> TrainConfig | None:
    """A TrainConfig with random fields changed (None when the mix is one the CLI refuses)."""
    hints = typing.get_type_hints(TrainConfig)
    choices = {
        "attention": ATTENTION,
        "eval_attention": EVAL_ATTENTION,
        "report_to": TRACKERS,
        "hub_model_id": ("me/chat", None),
        # A dataset name is checked as a Hub id or a loader's name: random text is mostly refused.
        "dataset_name": ("smangrul/MuDoConv", "me/my-dialogues", "sample"),
        "context_scorer": (None, "tiny", "me/scorer"),  # a preset, a Hub id or a model folder
        "objective": ("sft",),  # dpo/kto need a preference file, which the round trip leaves out
        "preference_file": (None,),
        "preference_validation_file": (None,),
        "lr_scheduler_type": ("linear", "cosine", "constant"),
        "adapter": ("none", "lora", "lora"),
        "lora_target_modules": (("q_proj",), ("fc2", "v_proj"), ("q_proj", "k_proj", "v_proj", "out_proj")),
    }
    texts = ("", "-x: ", "--num_beams 9 ", "chat bot's: ", "a=b", "runs/x y", "ünï ☃")
    values = {}
    for f in dataclasses.fields(TrainConfig):
        if f.name in ("train_file", "validation_file") or rng.random() < 0.5:
            continue
        kind = next(a for a in (*typing.get_args(hints[f.name]), hints[f.name]) if a is not type(None))
        if f.name in choices:
            values[f.name] = rng.choice(choices[f.name])
        elif kind is bool:
            values[f.name] = rng.random() < 0.5
        elif kind is int:
            values[f.name] = rng.choice([1, 2, 3, 7, 19, 20, 64, 128, 10_000])
        elif kind is float:
            values[f.name] = rng.choice([1e-6, 3e-4, 5e-5, 0.1, 1.0, 2.5, 1e-3, 0.30000000000000004])
        else:
            values[f.name] = rng.choice(texts)
    if values.get("adapter") != "lora":  # (the --lora_* settings need --adapter lora)
        values = {name: value for name, value in values.items() if not name.startswith("lora_")}
    if rng.random() < 0.3:
        values.update(train_file="/data/my train.jsonl", validation_file="-odd.jsonl")
    try:
        return TrainConfig(**values)
    except ValueError:
        return None


def test_training_args_round_trip_through_the_cli_parser():
    rng = random.Random(1234)
    configs = [c for c in (_random_config(rng) for _ in range(1500)) if c is not None]
    assert len(configs) >= 300
    for cfg in configs:
        args = training_args(cfg)
        assert parse_args(args) == cfg, args


def test_commands_of_many_specs_round_trip(roots, tmp_path):
    _, uploads = roots
    train = write_jsonl(uploads / "train.jsonl", good_rows(10))
    val = write_jsonl(uploads / "val.jsonl", good_rows(3))
    specs = [
        spec(),
        spec(max_target_length=8, source_prefix="-p "),
        spec(n_train=100, n_val=1, logging_steps=1),
        spec(split_train_file=str(train)),
        spec(train_file=str(train), validation_file=str(val)),
        spec(push_to_hub=True, hub_model_id="me/chat", checkpointing_steps=3, num_warmup_steps=7),
        spec(save_model=False, pad_to_max_length=True, seed=0, weight_decay=0.01, val_max_target_length=30),
        spec("facebook/blenderbot-400M-distill", dataset_name="smangrul/MuDoConv", num_gpus=4, strategy="ddp"),
    ]
    for made in specs:
        for resume in (False, True):
            argv = build_command(made, tmp_path / "run", resume=resume)
            assert parse_args(launcher_args(argv).training_script_args) == run_config(made, tmp_path / "run", resume)


# --------------------------------------------------------------------------- what people are shown


def test_the_shown_command_names_paths_relative_to_the_repository(roots, tmp_path, monkeypatch):
    """Show command, a run's status and its log are open to visitors: no server folders in them,
    and the line still runs from the repository root (here tmp_path / "repo" plays it)."""
    runs, _ = roots
    repo = tmp_path / "repo"
    monkeypatch.setattr(command, "ROOT", repo)
    uploads = repo / "data" / "uploads"
    uploads.mkdir(parents=True)
    monkeypatch.setenv("PERSONA_CHAT_DATA", str(uploads))
    train = write_jsonl(uploads / "my train.jsonl", good_rows(10))
    made = spec(train_file=str(train), validation_file=str(train))
    run_dir = repo / "runs" / "20250101-000000-abcdef"
    argv = build_command(made, run_dir)
    shown = command.display_command(argv)
    assert str(repo) not in shown and sys.executable not in shown
    assert shown.startswith("python -m accelerate.commands.launch --config_file configs/accelerate/cpu_zero2.yaml")
    assert "--train_file 'data/uploads/my train.jsonl'" in shown
    assert shown.endswith("--output_dir runs/20250101-000000-abcdef")
    # token for token the same command, run from the repository root
    words = shlex.split(shown)
    assert words[0] == "python" and len(words) == len(argv)
    assert all(w == a or repo / w == Path(a) for w, a in zip(words[1:], argv[1:]))
    # paths outside the repository stay as they are; "--flag=value" values are shown the same way
    outside = build_command(made, runs / "20250101-000000-abcdef")
    assert command.display_command(outside).endswith(f"--output_dir {runs / '20250101-000000-abcdef'}")
    assert command.display_command(["python", f"--x={repo / '-odd'}", str(repo)]) == "python --x=./-odd ."
    preview = RunManager(repo / "runs").command_preview(made)
    assert preview.endswith("--output_dir 'runs/<run_id>'") and str(repo) not in preview


@pytest.mark.parametrize("batch", ["auto", 24])
def test_the_train_batch_reaches_the_cli_as_given(tmp_path, batch):
    """'auto' (the Train tab's default: finetune.memory picks the batch in the run) and a number."""
    argv = build_command(spec(per_device_train_batch_size=batch), tmp_path / "run")
    flags = launcher_args(argv).training_script_args
    assert flags[flags.index("--per_device_train_batch_size") + 1] == str(batch)
    assert parse_args(flags).per_device_train_batch_size == batch
    assert f"--per_device_train_batch_size {batch} " in command.display_command(argv)  # what Show command prints
