"""Real training runs on CPU: DeepSpeed ZeRO-2 over 2 processes, resume, two loopback machines,
Hub push failure, failures as `error` events. Each run uses the tiny preset on the shipped sample data."""

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from safetensors.torch import load_file

from chat.layout import ROOT
from finetune.jobs.command import free_port

# The flags every run here shares: the tiny model on a slice of the sample data, quick to train and evaluate.
FAST = (
    "--model_name_or_path tiny --dataset_name sample --n_val 16 --num_beams 2 --val_min_target_length 2 "
    "--per_device_train_batch_size 8 --per_device_eval_batch_size 8 --learning_rate 1e-3 --logging_steps 2 --seed 7"
).split()


def launch(args, *, launcher=(), env=None, timeout=300) -> subprocess.CompletedProcess:
    cmd = [*launcher, "-m", "finetune", *FAST, *args] if launcher else [sys.executable, "-m", "finetune", *FAST, *args]
    return subprocess.run(
        cmd, cwd=ROOT, capture_output=True, text=True, timeout=timeout, check=False, env={**os.environ, **(env or {})}
    )


def accelerate(*flags):
    return [
        sys.executable,
        "-m",
        "accelerate.commands.launch",
        "--config_file",
        "configs/accelerate/cpu_zero2.yaml",
        *flags,
    ]


def events(out: Path) -> list[dict]:
    """The run's events, less the ``phase`` events of setup (tests/finetune/test_start_and_noise.py)."""
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    return [e for e in rows if e["event"] != "phase"]


def errors(out: Path) -> list[dict]:
    return [e for e in events(out) if e["event"] == "error"]


def curve(run_dir: Path) -> list[tuple[int, float]]:
    """The loss curve the Train tab draws for the run in ``run_dir`` (finetune.jobs.status), as (step, loss)."""
    from finetune.jobs.status import status_of

    if not (run_dir / "run.json").exists():  # a run launched here, not by the app: the status needs one
        (run_dir / "run.json").write_text(json.dumps({"argv": [], "spec": {}}))
    return [(p["step"], p["loss"]) for p in status_of(run_dir).loss_points]


def logged(out: Path, *, partial: bool) -> list[tuple[int, float]]:
    """(step, loss) of the run's ``log`` events: the curve's points, or the ``partial`` ones."""
    return [(e["step"], e["loss"]) for e in events(out) if e["event"] == "log" and e.get("partial", False) == partial]


@pytest.fixture(scope="module")
def zero2_run(tiny_path, tmp_path_factory):
    """12 steps, a log every 5 and a checkpoint every 4: step 8's checkpoint holds an open loss window (6-8)."""
    out = tmp_path_factory.mktemp("zero2") / "run"
    proc = launch(
        ["--output_dir", str(out), "--max_train_steps", "12", "--checkpointing_steps", "4", "--logging_steps", "5"],
        launcher=accelerate("--main_process_port", str(free_port())),
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    return out, proc


@pytest.fixture(scope="module")
def resumed_run(zero2_run, tmp_path_factory) -> Path:
    """zero2_run as if killed right after its step-8 checkpoint (its events up to that one, that
    checkpoint), resumed with ``latest`` in the same folder: what the app's Resume does."""
    out, _ = zero2_run
    run = tmp_path_factory.mktemp("resumed") / "run"
    shutil.copytree(out / "checkpoints" / "step_8", run / "checkpoints" / "step_8")
    lines = (out / "metrics.jsonl").read_text().splitlines(keepends=True)
    rows = [json.loads(line) for line in lines]
    cut = next(i for i, e in enumerate(rows) if e["event"] == "checkpoint" and e["step"] == 8)
    (run / "metrics.jsonl").write_text("".join(lines[: cut + 1]))
    proc = launch(
        [
            "--output_dir",
            str(run),
            "--max_train_steps",
            "12",
            "--logging_steps",
            "5",
            "--resume_from_checkpoint",
            "latest",
        ],
        launcher=accelerate("--main_process_port", str(free_port())),
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    return run


def test_zero2_two_processes_trains_and_saves(zero2_run):
    out, _ = zero2_run
    ev = events(out)
    start = ev[0]
    assert start["event"] == "start"
    assert start["distributed"] == "DEEPSPEED" and start["zero_stage"] == 2 and start["num_processes"] == 2
    logs = [e for e in ev if e["event"] == "log"]
    assert logs[-1]["step"] == 12
    assert logs[-1]["loss"] < logs[0]["loss"] - 0.3, [e["loss"] for e in logs]
    assert all(e["samples_per_second"] > 0 and e["lr"] >= 0 for e in logs)
    results = json.loads((out / "all_results.json").read_text())
    assert 0.0 <= results["eval_bleu"] <= 100.0 and results["eval_samples"] == 16
    assert len(results["train_epoch_seconds"]) == 1 and len(results["eval_epoch_seconds"]) == 1
    assert ev[-1]["event"] == "done"

    from transformers import AutoTokenizer, BlenderbotForConditionalGeneration

    final = out / "final"
    assert (final / "model.safetensors").is_file() and not list(final.glob("*.bin"))
    model = BlenderbotForConditionalGeneration.from_pretrained(final, use_safetensors=True)
    tok = AutoTokenizer.from_pretrained(final)
    args = json.loads((final / "training_args.json").read_text())
    assert args["source_prefix"] == "chatbot: " and args["max_source_length"] == 128
    ids = tok(args["source_prefix"] + "context: happy  <s> i got a new puppy!", return_tensors="pt")
    reply = model.generate(**ids, max_new_tokens=8, num_beams=1)
    assert reply.shape[1] > 1
    assert "eval_bleu" in json.loads((final / "all_results.json").read_text())
    card = (final / "README.md").read_text()
    assert card.startswith("---") and "sacreBLEU" in card and "`tiny`" in card
    # keep-last-2 policy: step_4 was pruned once step_8 and step_12 existed
    assert sorted(p.name for p in (out / "checkpoints").iterdir()) == ["step_12", "step_8"]


def test_resume_matches_uninterrupted_run(zero2_run, resumed_run):
    """Resuming from the step-8 checkpoint reproduces the uninterrupted run's final weights."""
    out, _ = zero2_run
    starts = [i for i, e in enumerate(events(resumed_run)) if e["event"] == "start"]
    attempt = events(resumed_run)[starts[-1] :]
    assert len(starts) == 2 and attempt[0]["resumed_at"] == 8
    reference = load_file(out / "final" / "model.safetensors")
    got = load_file(resumed_run / "final" / "model.safetensors")
    assert reference.keys() == got.keys()
    worst = max((reference[k] - got[k]).abs().max().item() for k in reference)
    assert worst < 1e-5, worst
    # it trained only the remaining steps (the first one is always logged: the run is alive)
    assert [e["step"] for e in attempt if e["event"] == "log"] == [9, 10, 12]


def test_a_resumed_run_draws_the_uninterrupted_runs_loss_curve(zero2_run, resumed_run):
    """The step-8 checkpoint saved the open window (steps 6-8): the resumed run's point at step 10
    is the mean of steps 6-10, as in the uninterrupted run, and its first step (9) is logged as
    ``partial`` (alive, not a point of the curve). Before, the curve had a one-step point at 9 and
    a 9-10 point at 10, and steps 6-8 were lost."""
    out, _ = zero2_run
    want = curve(out)
    assert [step for step, _ in want] == [1, 5, 10, 12]
    got = curve(resumed_run)
    print(f"loss curve: uninterrupted {want}, resumed at 8 {got}")
    assert [step for step, _ in got] == [1, 5, 10, 12]
    assert [loss for _, loss in got] == pytest.approx([loss for _, loss in want], rel=1e-5)
    # the events behind it: the same curve points, and the first step of each attempt as `partial` after a resume
    assert [s for s, _ in logged(resumed_run, partial=False)] == [s for s, _ in logged(out, partial=False)]
    assert [v for _, v in logged(resumed_run, partial=False)] == pytest.approx(
        [v for _, v in logged(out, partial=False)], rel=1e-5
    )
    assert [s for s, _ in logged(out, partial=True)] == [] and [s for s, _ in logged(resumed_run, partial=True)] == [9]
    state = json.loads((out / "checkpoints" / "step_8" / "trainer_state.json").read_text())
    assert state["loss_window"]["count"] == 3 * 2  # steps 6-8 on 2 processes


def test_stop_file_checkpoints_and_resume_latest(tiny_path, tmp_path):
    """A STOP file makes the run save a checkpoint and exit; `latest` continues it to the end, and
    its loss curve is the uninterrupted run's."""
    flags = ["--max_train_steps", "6", "--logging_steps", "4"]
    out = tmp_path / "run"
    out.mkdir()
    (out / "STOP").touch()
    proc = launch(["--output_dir", str(out), *flags])
    assert proc.returncode == 0, proc.stderr[-3000:]
    ev = events(out)
    assert ev[-1] == {**ev[-1], "event": "stopped", "step": 1}
    assert (out / "checkpoints" / "step_1").is_dir() and not (out / "final").exists()
    (out / "STOP").unlink()
    proc = launch(["--output_dir", str(out), *flags, "--resume_from_checkpoint", "latest"])
    assert proc.returncode == 0, proc.stderr[-3000:]
    ev = events(out)
    assert ev[-1]["event"] == "done" and ev[-1]["step"] == 6
    assert (out / "final" / "model.safetensors").is_file()

    full = tmp_path / "full"
    proc = launch(["--output_dir", str(full), *flags])
    assert proc.returncode == 0, proc.stderr[-3000:]
    want, got = curve(full), curve(out)
    print(f"loss curve: uninterrupted {want}, stopped at 1 {got}")
    assert [step for step, _ in want] == [step for step, _ in got] == [1, 4, 6]
    assert [loss for _, loss in got] == pytest.approx([loss for _, loss in want], rel=1e-5)
    assert [s for s, _ in logged(out, partial=True)] == [2]  # alive after the resume, not drawn


def test_refuses_to_overwrite_a_previous_run(zero2_run):
    out, _ = zero2_run
    before = (out / "metrics.jsonl").read_text()
    proc = launch(["--output_dir", str(out), "--max_train_steps", "2"])
    assert proc.returncode == 1
    assert "already holds a run" in proc.stderr
    assert (out / "metrics.jsonl").read_text() == before


def test_two_loopback_machines_train_together(tiny_path, tmp_path):
    out = tmp_path / "multinode"
    port = str(free_port())
    procs = []
    for rank in ("0", "1"):
        launcher = accelerate(
            "--num_machines",
            "2",
            "--num_processes",
            "2",
            "--machine_rank",
            rank,
            "--main_process_ip",
            "127.0.0.1",
            "--main_process_port",
            port,
            "--deepspeed_multinode_launcher",
            "standard",
        )
        cmd = [*launcher, "-m", "finetune", *FAST, "--output_dir", str(out), "--max_train_steps", "4"]
        procs.append(subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True))
    logs = [p.communicate(timeout=300)[0] for p in procs]
    assert [p.returncode for p in procs] == [0, 0], logs[0][-3000:] + logs[1][-3000:]
    start = events(out)[0]
    assert start["num_processes"] == 2 and start["zero_stage"] == 2
    assert events(out)[-1]["event"] == "done"


def test_push_failure_is_clear_and_token_never_leaks(tiny_path, tmp_path):
    token = "hf_NotARealTokenButSecret1234567890"
    out = tmp_path / "push"
    proc = launch(
        [
            "--output_dir",
            str(out),
            "--max_train_steps",
            "2",
            "--push_to_hub",
            "--hub_model_id",
            "someone/chat",
            "--with_tracking",
            "--report_to",
            "tensorboard",
        ],
        env={"HF_TOKEN": token},
    )
    assert proc.returncode == 1
    assert "could not push" in proc.stderr and "intact" in proc.stderr
    assert (out / "final" / "model.safetensors").is_file()  # the local checkpoint survives
    assert token not in proc.stdout + proc.stderr
    # one error event, after `done`: the run itself finished, only the push failed
    assert [e["event"] for e in events(out)][-2:] == ["done", "error"]
    [error] = errors(out)
    assert error["kind"] == "HubError" and "could not push" in error["message"]
    assert error["file"] == str(out / "final")
    assert list(out.rglob("events.out.tfevents.*")), "the tensorboard tracker wrote nothing"
    for file in out.rglob("*"):
        if file.is_file():
            assert token.encode() not in file.read_bytes(), file


def test_non_finite_loss_stops_the_run(tiny_path, tmp_path):
    out = tmp_path / "diverge"
    proc = launch(["--output_dir", str(out), "--max_train_steps", "20", "--learning_rate", "1e30"])
    assert proc.returncode == 1
    assert "loss was not finite" in proc.stderr
    assert events(out)[-1]["event"] == "error"
    [error] = errors(out)
    assert error["kind"] == "TrainingError" and "loss was not finite" in error["message"]
    assert f"up to step {error['step']}:" in error["message"] and error["file"] is None
    assert not (out / "final").exists()


def test_length_grouped_run_resumes_exactly(tiny_path, tmp_path):
    """--group_by_length's order is a function of seed and epoch: a run resumed mid-epoch ends
    with the same weights as an uninterrupted one."""
    flags = ["--group_by_length", "--n_train", "64", "--per_device_train_batch_size", "4", "--max_train_steps", "12"]
    full = tmp_path / "full"
    proc = launch(
        [*flags, "--output_dir", str(full), "--checkpointing_steps", "3", "--checkpoints_total_limit", "10"],
        launcher=accelerate("--main_process_port", str(free_port())),
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    resumed = tmp_path / "resumed"
    step_3 = full / "checkpoints" / "step_3"
    proc = launch(
        [*flags, "--output_dir", str(resumed), "--resume_from_checkpoint", str(step_3)],
        launcher=accelerate("--main_process_port", str(free_port())),
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    reference = load_file(full / "final" / "model.safetensors")
    got = load_file(resumed / "final" / "model.safetensors")
    assert max((reference[k] - got[k]).abs().max().item() for k in reference) < 1e-5


def test_unwritable_profile_dir_fails_before_training(tmp_path):
    from finetune.parts import TrainingError, start_profiler

    blocker = tmp_path / "a-file"
    blocker.write_text("not a folder")
    with pytest.raises(TrainingError, match="--profile_dir .*cannot write there"):
        start_profiler(str(blocker / "profile"))
    profiler = start_profiler(str(tmp_path / "profile"))  # a writable folder starts a profiler
    profiler.stop()
    assert (tmp_path / "profile").is_dir() and not list((tmp_path / "profile").iterdir())


# --------------------------------------------------------------------------- failures as error events


def test_failed_start_does_not_block_rerunning_the_same_command(tiny_path, tmp_path):
    """A run that fails before it starts (here: a data file not there yet) leaves one error event,
    written by rank 0 alone even before the accelerator exists; once the file is there, the same
    command runs."""
    out, train = tmp_path / "run", tmp_path / "data" / "train.jsonl"
    args = [
        "--output_dir",
        str(out),
        "--max_train_steps",
        "2",
        "--n_train",
        "64",
        "--save_model",
        "false",
        "--train_file",
        str(train),
        "--validation_file",
        str(ROOT / "data/sample/validation.jsonl"),
    ]
    launcher = accelerate("--main_process_port", str(free_port()))
    proc = launch(args, launcher=launcher)
    assert proc.returncode != 0
    assert [e["event"] for e in events(out)] == ["error"]  # one event for two processes
    assert errors(out)[0] == {**errors(out)[0], "kind": "DataError", "file": str(train)}
    assert errors(out)[0]["message"] == f"{train}: no such file"

    train.parent.mkdir()
    train.write_text((ROOT / "data/sample/train.jsonl").read_text())
    proc = launch(args, launcher=launcher)
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert [e["event"] for e in events(out)][:2] == ["error", "start"] and events(out)[-1]["event"] == "done"


@pytest.fixture
def mismatched_model(tiny_path, tmp_path) -> Path:
    """A model folder whose tokenizer knows more tokens than the model has embeddings (as when a
    tokenizer is copied in from another model): it loads fine and fails at the first step."""
    from transformers import AutoTokenizer, BlenderbotForConditionalGeneration

    folder = tmp_path / "mismatched-model"
    model = BlenderbotForConditionalGeneration.from_pretrained(tiny_path)
    model.resize_token_embeddings(64)
    model.save_pretrained(folder)
    AutoTokenizer.from_pretrained(tiny_path).save_pretrained(folder)
    return folder


def test_internal_error_is_one_event_and_a_traceback(mismatched_model, tmp_path):
    out = tmp_path / "run"
    proc = launch(
        [
            "--output_dir",
            str(out),
            "--max_train_steps",
            "2",
            "--n_train",
            "32",
            "--model_name_or_path",
            str(mismatched_model),
        ]
    )
    assert proc.returncode == 1
    assert [e["event"] for e in events(out)] == ["start", "error"]
    [error] = errors(out)
    assert error == {**error, "kind": "internal", "file": None}
    assert error["message"].startswith("IndexError: index out of range"), error["message"]
    assert "internal error" in proc.stderr and "Traceback" in proc.stderr  # where it happened, for a bug report


@pytest.mark.parametrize("spec", ["latest", "missing"])
def test_bad_resume_names_the_checkpoint(spec, tmp_path):
    """A checkpoint that is not there fails at once (before data and model load), naming where it looked."""
    from finetune.cli import main

    out = tmp_path / "run"
    wanted = spec if spec == "latest" else str(tmp_path / "checkpoints" / "step_5")
    assert main([*FAST, "--output_dir", str(out), "--resume_from_checkpoint", wanted]) == 1
    [error] = events(out)
    assert error == {
        **error,
        "event": "error",
        "kind": "FileNotFoundError",
        "file": str(out / "checkpoints") if spec == "latest" else wanted,
    }
    assert set(error) == {"event", "time", "kind", "message", "file"}


def test_an_output_dir_holds_a_run_once_one_started(tmp_path):
    """Only a run that started (a start event or a checkpoint) makes --output_dir unusable for a new one."""
    from finetune.config import parse_args
    from finetune.parts import OutputDirInUse, check_output_dir

    out = tmp_path / "run"
    cfg = parse_args([*FAST, "--output_dir", str(out)])
    check_output_dir(cfg)  # no folder yet
    out.mkdir()
    failed = json.dumps({"event": "error", "time": 1.0, "kind": "DataError", "message": "x", "file": None}) + "\n"
    (out / "metrics.jsonl").write_text(failed + failed + '{"event": "sta')  # failed starts, and a cut line
    check_output_dir(cfg)
    (out / "metrics.jsonl").write_text(failed + json.dumps({"event": "start", "time": 2.0}) + "\n")
    with pytest.raises(OutputDirInUse, match="already holds a run"):
        check_output_dir(cfg)
    check_output_dir(parse_args([*FAST, "--output_dir", str(out), "--resume_from_checkpoint", "latest"]))

    (out / "metrics.jsonl").unlink()
    step = out / "checkpoints" / "step_3"
    step.mkdir(parents=True)
    check_output_dir(cfg)  # a checkpoint folder still being written is no checkpoint
    (step / "trainer_state.json").write_text("{}")
    with pytest.raises(OutputDirInUse):
        check_output_dir(cfg)


def test_error_event_fields():
    from finetune.cli import error_event
    from finetune.config import parse_args
    from finetune.data import DataError
    from finetune.parts import TrainingError

    cfg = parse_args(FAST)
    assert error_event(DataError("t.csv: row 2: bad", file="t.csv"), cfg) == {
        "kind": "DataError",
        "message": "t.csv: row 2: bad",
        "file": "t.csv",
    }
    assert error_event(TrainingError("no room", step=7), cfg) == {
        "kind": "TrainingError",
        "message": "no room",
        "file": None,
        "step": 7,
    }
    assert error_event(KeyError("completed_steps"), cfg) == {
        "kind": "internal",
        "message": "KeyError: 'completed_steps'",
        "file": None,
    }
    assert error_event(PermissionError(13, "Permission denied", "/runs/x/final"), cfg) == {
        "kind": "internal",
        "message": "PermissionError: [Errno 13] Permission denied: '/runs/x/final'",
        "file": "/runs/x/final",
    }
    assert error_event(AssertionError(), cfg)["message"] == "AssertionError"


def test_feedback_run_reports_bleu_by_kind_and_on_held_out_feedback(tiny_path, tmp_path):
    """A run with feedback rows mixed in and a held-out part: per-kind and feedback figures in the
    eval event, all_results.json and the model card (a few steps; 2 held-out rows over 2 processes)."""
    from chat.layout import SAMPLE_DIR
    from chat.prompt import kind_of

    rows = [
        {"kind": "persona", "context": "i am a pilot.", "turns": ["what do you do?"], "response": "i fly planes."},
        {"kind": "topic", "context": "tea", "turns": ["tell me about tea"], "response": "tea is a hot drink."},
        {"kind": "none", "context": None, "turns": ["hi", "hey", "how are you?"], "response": "great, thanks."},
    ]
    feedback, held = tmp_path / "feedback.jsonl", tmp_path / "heldout.jsonl"
    feedback.write_text("".join(json.dumps({**r, "rating": "correction"}) + "\n" for r in rows * 3))
    held.write_text("".join(json.dumps(r) + "\n" for r in rows[:2]))
    out = tmp_path / "run"
    proc = launch(
        ["--output_dir", str(out), "--n_train", "24", "--max_train_steps", "3", "--feedback_file", str(feedback)]
        + ["--feedback_ratio", "0.5", "--feedback_validation_file", str(held)],
        launcher=accelerate("--main_process_port", str(free_port())),  # as the app runs it: ZeRO-2, 2 processes
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    ev = events(out)
    assert ev[0]["event"] == "start" and ev[0]["train_samples"] > 24  # the feedback rows are in
    (evaluation,) = [e for e in ev if e["event"] == "eval"]
    validation = [json.loads(line)["texts"] for line in (SAMPLE_DIR / "validation.jsonl").read_text().splitlines()]
    kinds = {kind_of(t) for t in validation[:16]}
    assert len(kinds) >= 3
    assert {k for k in evaluation if k.startswith("eval_bleu_")} == {f"eval_bleu_{k}" for k in kinds} | {
        "eval_bleu_feedback"
    }
    assert sum(evaluation[f"eval_rows_{k}"] for k in kinds) == 16
    assert evaluation["eval_rows_feedback"] == 2 and evaluation["eval_loss_feedback"] > 0
    assert all(0 <= evaluation[f"eval_bleu_{k}"] <= 100 for k in [*kinds, "feedback"])
    results = json.loads((out / "all_results.json").read_text())
    figures = {k: v for k, v in evaluation.items() if k.startswith(("eval_bleu", "eval_rows", "eval_loss"))}
    assert {k: results[k] for k in figures} == figures and len(figures) == 2 + 2 * len(kinds) + 3
    card = (out / "final" / "README.md").read_text()
    assert "BLEU by kind" in card and "Held-out feedback: sacreBLEU" in card and "`feedback.jsonl`" in card
    assert all(f"| {k} | " in card for k in kinds)
