"""The Train tab's logic (finetune/runner.py): commands, form validation, path checks, uploads,
and real CPU runs through RunManager (start, busy, finish, stop, re-attach, resume, failure)."""

import json
import os
import re
import shlex
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from chat.layout import ROOT
from finetune import runner
from finetune.config import parse_args
from finetune.data import DataError
from finetune.runner import (
    MAX_UPLOAD_BYTES,
    RunBusyError,
    RunManager,
    RunSpec,
    RunStatus,
    build_command,
    format_command,
    validate_upload,
)

TIMEOUT = 180  # seconds any single wait for a run may take


@pytest.fixture
def roots(tmp_path, monkeypatch):
    """An isolated runs root and upload dir, as the app would configure them."""
    runs, uploads = tmp_path / "runs", tmp_path / "uploads"
    uploads.mkdir()
    monkeypatch.setenv("PERSONA_CHAT_RUNS", str(runs))
    monkeypatch.setenv("PERSONA_CHAT_DATA", str(uploads))
    return runs, uploads


def write_jsonl(path: Path, rows) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def good_rows(n):
    return [{"texts": f"context: happy  <s> hello number {i}", "labels": f"hi {i}!"} for i in range(n)]


def wait_for(manager, run_id, done, timeout=TIMEOUT) -> RunStatus:
    deadline = time.monotonic() + timeout
    while True:
        status = manager.status(run_id)
        if done(status):
            return status
        assert time.monotonic() < deadline, f"timed out in state {status.state}:\n{status.log_tail}"
        time.sleep(0.25)


def settled(status):
    return status.state not in ("running", "stopping")


def launcher_args(argv):
    from accelerate.commands.launch import launch_command_parser

    assert argv[:3] == [sys.executable, "-m", "accelerate.commands.launch"]
    return launch_command_parser().parse_args(argv[3:])


# --------------------------------------------------------------------------- commands


def test_cpu_command_is_the_readme_recipe(tmp_path, monkeypatch):
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0, 1, 2, 3})
    spec = RunSpec(epochs=8, num_beams=4)
    argv = build_command(spec, tmp_path / "run")
    assert isinstance(argv, list) and all(isinstance(a, str) for a in argv)
    args = launcher_args(argv)
    assert args.config_file == "configs/accelerate/cpu_zero2.yaml" and (ROOT / args.config_file).is_file()
    assert args.num_processes == 2  # the tested CPU recipe, however many cores
    assert args.mixed_precision == "no" and args.main_process_port > 0
    assert args.module and args.training_script == "finetune"
    # the CLI's own parser accepts the rest and reads back the form's values
    cfg = parse_args(args.training_script_args)
    assert (cfg.model_name_or_path, cfg.dataset_name, cfg.train_file) == ("tiny", "sample", None)
    assert (cfg.num_train_epochs, cfg.learning_rate, cfg.num_beams) == (8, 1e-3, 4)
    assert (cfg.per_device_train_batch_size, cfg.per_device_eval_batch_size) == (16, 32)
    assert (cfg.max_source_length, cfg.max_target_length, cfg.source_prefix) == (128, 64, "chatbot: ")
    assert cfg.output_dir == str((tmp_path / "run").resolve()) and cfg.resume_from_checkpoint is None
    assert not cfg.push_to_hub and cfg.checkpointing_steps is None

    # the README's CPU command, flag for flag (launcher part; the port is ours)
    readme = (ROOT / "README.md").read_text()
    line = next(l for l in readme.splitlines() if l.startswith("accelerate launch") and "cpu_zero2" in l)
    documented = shlex.split(line.rstrip("\\"))[2:]
    ours = argv[3:argv.index("finetune") - 1]
    assert documented == ["--config_file", "configs/accelerate/cpu_zero2.yaml", "-m", "finetune"]
    assert ours[:2] == documented[:2]
    for flag in ("--model_name_or_path", "--dataset_name", "--num_train_epochs", "--learning_rate",
                 "--per_device_train_batch_size", "--per_device_eval_batch_size", "--num_beams", "--output_dir"):
        assert flag in readme and flag in argv

    # one core: one process
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0})
    assert launcher_args(build_command(spec, tmp_path / "run")).num_processes == 1


def test_resume_adds_latest(tmp_path):
    spec = RunSpec(checkpointing_steps=20, n_train=100, n_val=8)
    plain, resumed = build_command(spec, tmp_path), build_command(spec, tmp_path, resume=True)
    assert "--resume_from_checkpoint" not in plain
    assert resumed[-2:] == ["--resume_from_checkpoint", "latest"]
    strip_port = lambda a: [x for i, x in enumerate(a) if "--main_process_port" not in (x, a[i - 1])]  # noqa: E731
    assert strip_port(resumed[:-2]) == strip_port(plain)
    cfg = parse_args(launcher_args(resumed).training_script_args)
    assert (cfg.resume_from_checkpoint, cfg.checkpointing_steps, cfg.n_train, cfg.n_val) == ("latest", 20, 100, 8)


@pytest.mark.parametrize("strategy,precision,gpus,bf16,config,mixed", [
    ("zero2", "fp16", 2, True, "zero2.yaml", "fp16"),
    ("zero2", "auto", 8, True, "zero2.yaml", "bf16"),
    ("zero2", "auto", 1, False, "zero2.yaml", "fp16"),
    ("ddp", "fp32", 2, True, "ddp.yaml", "no"),  # overrides ddp.yaml's own fp16
    ("ddp", "bf16", 4, False, "ddp.yaml", "bf16"),
    ("zero3_offload", "fp16", 1, False, "zero3_offload.yaml", "fp16"),
    ("zero3_offload", "auto", 2, True, "zero3_offload.yaml", "bf16"),
])
def test_gpu_commands(tmp_path, monkeypatch, strategy, precision, gpus, bf16, config, mixed):
    monkeypatch.setattr(runner, "gpu_supports_bf16", lambda: bf16)
    spec = RunSpec(model="facebook/blenderbot-400M-distill", dataset="smangrul/MuDoConv", strategy=strategy,
                   precision=precision, num_gpus=gpus, learning_rate=1e-6, push_to_hub=True,
                   hub_model_id="someone/chat", hub_private=True)
    argv = build_command(spec, tmp_path)
    args = launcher_args(argv)
    assert args.config_file == f"configs/accelerate/{config}" and (ROOT / args.config_file).is_file()
    assert args.num_processes == gpus and args.mixed_precision == mixed
    cfg = parse_args(args.training_script_args)
    assert cfg.model_name_or_path == "facebook/blenderbot-400M-distill" and cfg.dataset_name == "smangrul/MuDoConv"
    assert cfg.learning_rate == 1e-6
    assert cfg.push_to_hub and cfg.hub_model_id == "someone/chat" and cfg.hub_private


def test_readme_gpu_command_prefix(tmp_path):
    readme = (ROOT / "README.md").read_text()
    line = next(l for l in readme.splitlines() if l.startswith("accelerate launch") and "/zero2.yaml --num" in l)
    documented = shlex.split(line.rstrip("\\"))[2:]  # --config_file ... --num_processes 2 --mixed_precision bf16
    argv = build_command(RunSpec(num_gpus=2, precision="bf16"), tmp_path)
    ours = argv[3:argv.index("--main_process_port")]
    assert ours == documented


def test_format_command_round_trips(tmp_path):
    argv = build_command(RunSpec(source_prefix="chat bot's: "), tmp_path / "a dir")
    line = format_command(argv)
    assert isinstance(line, str) and shlex.split(line) == argv


@pytest.mark.parametrize("prefix", ["", "-x: ", "--num_beams 9 ", "chatbot: "])
def test_any_source_prefix_reaches_the_cli_intact(tmp_path, prefix):
    cfg = parse_args(launcher_args(build_command(RunSpec(source_prefix=prefix), tmp_path)).training_script_args)
    assert cfg.source_prefix == prefix and cfg.num_beams == 4


def test_short_targets_lower_the_generation_minimum(tmp_path):
    cfg = parse_args(launcher_args(build_command(RunSpec(max_target_length=8), tmp_path)).training_script_args)
    assert cfg.val_min_target_length == 8 and cfg.val_max_target_length == 8


# --------------------------------------------------------------------------- the form


@pytest.mark.parametrize("kwargs,message", [
    (dict(epochs=0), "epochs must be >= 1"),
    (dict(epochs=2.5), "epochs must be a whole number"),
    (dict(train_batch_size=None), "train_batch_size is required"),
    (dict(n_train=0), "n_train must be >= 1"),
    (dict(learning_rate=0), "learning_rate must be > 0"),
    (dict(learning_rate=float("nan")), "learning_rate must be > 0"),
    (dict(learning_rate="fast"), "learning_rate must be a number"),
    (dict(strategy="fsdp"), "strategy must be one of zero2, zero3_offload, ddp"),
    (dict(precision="int8"), "precision must be one of"),
    (dict(num_gpus=-1), "num_gpus must be >= 0"),
    (dict(strategy="ddp"), "needs GPUs"),
    (dict(precision="fp16"), "needs GPUs"),
    (dict(push_to_hub=True), "needs a Hub model id"),
    (dict(hub_model_id="no-slash"), "must look like 'user/name'"),
    (dict(validation_file=str(ROOT / "data/sample/validation.jsonl")), "goes with an uploaded train file"),
    (dict(model=""), "model is required"),
    (dict(model="two words"), "is not a preset"),
    (dict(dataset=""), "dataset is required"),
    (dict(dataset="a b/c"), "is not 'sample'"),
])
def test_spec_validation(roots, kwargs, message):
    with pytest.raises(ValueError, match=re.escape(message)):
        RunSpec(**kwargs)


def test_spec_accepts_form_values(roots):
    spec = RunSpec(epochs=2.0, n_train=None, n_val=16.0, hub_model_id="", validation_file="", num_gpus=0.0)
    assert (spec.epochs, spec.n_val, spec.hub_model_id, spec.validation_file) == (2, 16, None, None)
    assert isinstance(spec.epochs, int) and spec.precision == "auto"


# --------------------------------------------------------------------------- paths


@pytest.mark.parametrize("field", ["model", "dataset"])
@pytest.mark.parametrize("value", ["../../etc/passwd", "/etc/passwd", "/etc", "~/.bashrc", "data/../../../etc/hosts"])
def test_paths_outside_allowed_roots_are_refused(roots, field, value):
    with pytest.raises(ValueError, match="outside the allowed folders"):
        RunSpec(**{field: value})


def test_symlink_out_of_an_allowed_root_is_refused(roots, tmp_path):
    _, uploads = roots
    secret = write_jsonl(tmp_path / "secret.jsonl", good_rows(3))
    (uploads / "link.jsonl").symlink_to(secret)
    with pytest.raises(ValueError, match="outside the allowed folders"):
        RunSpec(dataset=str(uploads / "link.jsonl"))


def test_local_files_inside_roots(roots, tmp_path, monkeypatch):
    runs, uploads = roots
    train = write_jsonl(uploads / "train.jsonl", good_rows(20))
    val = write_jsonl(uploads / "val.jsonl", good_rows(4))
    spec = RunSpec(dataset=str(train), validation_file=str(val))
    cfg = parse_args(launcher_args(build_command(spec, tmp_path)).training_script_args)
    assert (cfg.train_file, cfg.validation_file, cfg.dataset_name) == (str(train), str(val), "smangrul/MuDoConv")
    # relative to the working directory, like the app's default roots
    monkeypatch.chdir(uploads.parent)
    assert RunSpec(dataset="uploads/train.jsonl").dataset == str(train)
    # the shipped sample by path; a model folder must hold a checkpoint
    assert RunSpec(dataset="data/sample/train.jsonl").dataset == str(ROOT / "data/sample/train.jsonl")
    with pytest.raises(ValueError, match="not a model folder"):
        RunSpec(model=str(uploads))
    with pytest.raises(ValueError, match="no such file"):
        RunSpec(dataset=str(uploads / "missing.jsonl"))
    (uploads / "notes.txt").write_text("x")
    with pytest.raises(ValueError, match="unsupported file type"):
        RunSpec(dataset=str(uploads / "notes.txt"))
    # a Hub id stays a Hub id
    assert RunSpec(dataset="nobody/nothing", model="facebook/blenderbot-400M-distill").dataset == "nobody/nothing"


def test_run_ids_are_strict(roots):
    runs, _ = roots
    manager = RunManager(runs)
    for bad in ("../x", "..", "/etc", "20250101-000000-abcdef/../..", "x"):
        for call in (manager.status, manager.resume, manager.stop):
            with pytest.raises(ValueError, match="invalid run id"):
                call(bad)
        with pytest.raises(ValueError, match="invalid run id"):
            manager.push(bad, "someone/chat")
    with pytest.raises(ValueError, match="no run"):
        manager.status("20250101-000000-abcdef")
    assert manager.runs() == [] and manager.status() == RunStatus()  # idle


# --------------------------------------------------------------------------- uploads


def test_validate_upload(roots):
    _, uploads = roots
    good = write_jsonl(uploads / "good.jsonl", good_rows(5))
    result = validate_upload(good)
    assert result["rows"] == 5
    assert result["preview"] == [f"chatbot: context: happy  <s> hello number {i}" for i in range(3)]
    assert validate_upload(good, source_prefix="")["preview"][0] == "context: happy  <s> hello number 0"

    structured = write_jsonl(uploads / "s.jsonl", [{"kind": "persona", "context": "i like tea.", "turns": ["hi"],
                                                     "response": "hello!"}])
    assert validate_upload(structured)["preview"][0].startswith("chatbot: your persona: i like tea.")

    bad = write_jsonl(uploads / "bad.jsonl", [*good_rows(2), {"texts": "x", "labels": "  "}])
    with pytest.raises(DataError, match=r"bad\.jsonl: row 3: column 'labels' is empty"):
        validate_upload(bad)
    with pytest.raises(DataError, match="no such file"):
        validate_upload(uploads / "missing.jsonl")
    assert MAX_UPLOAD_BYTES == 50 * 2**20


def test_upload_size_limit_is_checked_first(roots, monkeypatch):
    _, uploads = roots
    big = uploads / "big.jsonl"
    big.write_bytes(b"not json at all\n" * 100)
    monkeypatch.setattr(runner, "MAX_UPLOAD_BYTES", 1000)
    with pytest.raises(DataError, match="the limit is"):
        validate_upload(big)


def test_uploaded_train_file_alone_is_split(roots, tmp_path):
    _, uploads = roots
    train = write_jsonl(uploads / "train.jsonl", good_rows(25))
    spec = RunSpec(dataset=str(train))
    assert spec.holds_out_validation
    run_dir = tmp_path / "run"
    assert runner.write_split(spec.dataset, run_dir) == (23, 2)
    cfg = parse_args(launcher_args(build_command(spec, run_dir)).training_script_args)
    t, v = Path(cfg.train_file), Path(cfg.validation_file)
    assert t.parent == v.parent == (run_dir / "data").resolve()
    assert [json.loads(l)["labels"] for l in v.read_text().splitlines()] == ["hi 23!", "hi 24!"]
    assert len(t.read_text().splitlines()) == 23 and train.read_text() == "".join(
        json.dumps(r) + "\n" for r in good_rows(25))  # the upload itself is untouched
    with pytest.raises(DataError, match="at least 2"):
        runner.write_split(str(write_jsonl(uploads / "one.jsonl", good_rows(1))), tmp_path / "r2")


# --------------------------------------------------------------------------- processes (no training)


def fake_run(manager: RunManager, run_id: str, code: str) -> subprocess.Popen:
    """A run dir whose 'training' process is a stub that looks like ours (argv has finetune + run dir)."""
    run_dir = manager.root / run_id
    run_dir.mkdir(parents=True)
    proc = subprocess.Popen([sys.executable, "-c", code, "finetune", "--output_dir", str(run_dir)],
                            start_new_session=True)
    info = {"run_id": run_id, "spec": RunSpec().to_dict(), "argv": ["python", "-m", "finetune"], "pid": proc.pid,
            "pgid": proc.pid, "started": time.time(), "metrics_offset": 0, "log_offset": 0, "attempts": []}
    (run_dir / "run.json").write_text(json.dumps(info))
    return proc


def test_liveness_busy_and_forced_stop(roots):
    """A process that ignores STOP and SIGTERM is killed; another instance sees it all from disk."""
    runs, _ = roots
    manager = RunManager(runs, grace_seconds=0.5, term_seconds=0.5)
    run_id = "20250101-000000-abcdef"
    proc = fake_run(manager, run_id, "import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); time.sleep(60)")
    try:
        assert RunManager(runs).status().run_id == run_id
        assert RunManager(runs).status(run_id).state == "running"
        with pytest.raises(RunBusyError, match=f"run {run_id} is still running"):
            RunManager(runs).start(RunSpec())
        with pytest.raises(RunBusyError):
            manager.resume(run_id)
        assert manager.stop().state == "stopping"
        assert (runs / run_id / "STOP").exists()
        assert proc.wait(timeout=15) == -signal.SIGKILL
        status = wait_for(manager, run_id, settled, timeout=15)
        assert status.state == "failed" and "did not stop within 0.5 s" in status.error, status.error
    finally:
        proc.kill()
        proc.wait()
    # a dead pid (or one reused by an unrelated process) is not our run
    info = json.loads((runs / run_id / "run.json").read_text())
    info["pid"] = info["pgid"] = os.getpid()
    (runs / run_id / "run.json").write_text(json.dumps(info))
    assert RunManager(runs).status(run_id).state == "failed"


# --------------------------------------------------------------------------- real runs


TINY = dict(model="tiny", dataset="sample", n_val=8, num_beams=1, train_batch_size=8, eval_batch_size=8)


@pytest.fixture(scope="module")
def runs_root(tmp_path_factory):
    return tmp_path_factory.mktemp("runner") / "runs"


@pytest.fixture(scope="module")
def finished_run(tiny_path, runs_root):
    manager = RunManager(runs_root)
    status = manager.start(RunSpec(**TINY, n_train=200, epochs=1))
    run_id = status.run_id
    assert re.fullmatch(r"\d{8}-\d{6}-[0-9a-f]{6}", run_id)
    assert status.state == "running", status.log_tail
    assert manager.status().run_id == run_id and RunManager(runs_root).status().state == "running"
    with pytest.raises(RunBusyError, match="still running"):
        manager.start(RunSpec(**TINY, n_train=200, epochs=1))
    with pytest.raises(RunBusyError):
        RunManager(runs_root).start(RunSpec(**TINY, n_train=200, epochs=1))  # another viewer / restarted app
    assert manager.runs() == [run_id]  # the refused starts left nothing behind
    status = wait_for(manager, run_id, settled)
    return manager, status


def test_real_run_finishes(finished_run, runs_root):
    manager, status = finished_run
    assert status.state == "finished", status.error or status.log_tail
    run_dir = runs_root / status.run_id
    info = json.loads((run_dir / "run.json").read_text())
    assert info["spec"]["n_train"] == 200 and info["argv"][:3] == [sys.executable, "-m", "accelerate.commands.launch"]
    assert info["pid"] == info["pgid"] and info["exit_code"] == 0
    assert status.step == status.total_steps == 13 and status.progress == 1.0  # 200 rows / (8 x 2 processes)
    # the CLI logs the first step too (it shows the run is alive), then every 10 steps and the last one
    assert [p["step"] for p in status.loss_points] == [1, 10, 13] and all(p["loss"] > 0 for p in status.loss_points)
    assert status.bleu_points == [{"step": 13, "bleu": status.eval_bleu}] and status.eval_bleu is not None
    assert status.samples and set(status.samples[0]) >= {"prompt", "prediction", "reference"}
    assert status.samples_per_second > 0 and status.gpu_mem_gib is None and status.error is None
    assert status.final_dir == str(run_dir / "final") and (run_dir / "final" / "model.safetensors").is_file()
    assert "final model in" in status.log_tail and len(status.log_tail.splitlines()) <= 40
    assert status.command.startswith(f"{sys.executable} -m accelerate.commands.launch --config_file")
    label, path = manager.finished_checkpoints()[0]
    assert path == status.final_dir and label == f"{status.run_id} (BLEU {status.eval_bleu:.1f})"
    # the child was reaped: no zombie left
    stat = runner._proc_stat(info["pid"])
    assert stat is None or stat[0] != "Z"
    # a finished run can be the next run's model (runs root is allowed), and is not resumable
    assert RunSpec(model=path).model == path
    with pytest.raises(ValueError, match="already finished"):
        manager.resume(status.run_id)


def test_push_failure_is_clear_and_token_stays_secret(finished_run, runs_root, monkeypatch):
    from finetune.hub import HubError

    manager, status = finished_run
    token = "hf_NotARealTokenButSecret1234567890"
    monkeypatch.setenv("HF_TOKEN", token)
    with pytest.raises(HubError, match="could not push") as err:
        manager.push(status.run_id, "someone/chat")
    assert token not in str(err.value)
    with pytest.raises(ValueError, match="user/name"):
        manager.push(status.run_id, "no-slash")
    for file in (runs_root / status.run_id).rglob("*"):
        if file.is_file():
            assert token.encode() not in file.read_bytes(), file


def test_stop_reattach_and_resume(tiny_path, runs_root, finished_run):
    manager = RunManager(runs_root)
    spec = RunSpec(**{**TINY, "train_batch_size": 16}, n_train=1400, epochs=2, checkpointing_steps=20, logging_steps=5)
    run_id = manager.start(spec).run_id
    running = wait_for(manager, run_id, lambda s: s.step >= 1 or settled(s))
    assert running.state == "running", running.error or running.log_tail
    assert running.total_steps == 88 and 0 < running.progress < 1 and running.eta_seconds is not None

    assert manager.stop().state in ("stopping", "stopped")
    stopped = wait_for(manager, run_id, settled)
    assert stopped.state == "stopped", stopped.error or stopped.log_tail
    assert stopped.has_checkpoint and stopped.step < 88 and stopped.final_dir is None
    assert (runs_root / run_id / "checkpoints" / f"step_{stopped.step}").is_dir()

    restarted = RunManager(runs_root)  # the app restarts
    assert restarted.status().run_id == run_id and restarted.status().state == "stopped"
    assert restarted.runs()[0] == run_id
    resumed = restarted.resume(run_id)
    assert resumed.state == "running" and not (runs_root / run_id / "STOP").exists()
    assert resumed.command.endswith("--resume_from_checkpoint latest")
    done = wait_for(restarted, run_id, settled)
    assert done.state == "finished", done.error or done.log_tail
    assert done.step == 88 and len(done.bleu_points) == 2 and done.eval_bleu is not None
    steps = [p["step"] for p in done.loss_points]
    assert steps == sorted(set(steps)) and steps[-1] == 88 and stopped.step < steps[-1]
    starts = [json.loads(l) for l in (runs_root / run_id / "metrics.jsonl").read_text().splitlines()]
    assert [e["resumed_at"] for e in starts if e["event"] == "start"] == [0, stopped.step]
    assert len(json.loads((runs_root / run_id / "run.json").read_text())["attempts"]) == 2
    assert [label.split()[0] for label, _ in restarted.finished_checkpoints()][0] == run_id


def test_unreachable_dataset_fails_with_the_cli_message(tiny_path, runs_root, finished_run):
    manager = RunManager(runs_root)
    run_id = manager.start(RunSpec(**{**TINY, "dataset": "nobody/nothing"})).run_id
    status = wait_for(manager, run_id, settled)
    assert status.state == "failed"
    assert status.error.startswith("cannot load dataset 'nobody/nothing' from the Hub"), status.error
    assert status.final_dir is None and not status.has_checkpoint
    assert RunManager(runs_root).status(run_id).error == status.error  # also from disk alone
    with pytest.raises(ValueError, match="no checkpoint to resume from"):
        manager.resume(run_id)
