"""finetune/jobs/manager.py: RunManager over real CPU runs (start, busy, finish, stop, re-attach,
resume, failure, push), strict run ids, and run folders written before finetune/jobs."""

import json
import re
import sys
import time

import pytest
from jobs_helpers import OLD_SPEC, launcher_args, settled, spec, wait_for

from finetune import checkpoint as ckpt
from finetune.config import parse_args
from finetune.jobs import command, process
from finetune.jobs.manager import RunBusyError, RunManager
from finetune.jobs.status import RunStatus


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


# --------------------------------------------------------------------------- older run folders


OLD_RUN_ID = "20240601-120000-0a1b2c"


def old_run_folder(runs):
    """A stopped run as finetune/runner.py left it: its flat RunSpec, its command, a checkpoint."""
    run_dir = runs / OLD_RUN_ID
    (run_dir / "checkpoints" / "step_5").mkdir(parents=True)
    (run_dir / "checkpoints" / "step_5" / "trainer_state.json").write_text("{}")
    spec = {**OLD_SPEC, "source_prefix": "chatbot: "}
    argv = [
        sys.executable,
        "-m",
        "accelerate.commands.launch",
        "--config_file",
        "configs/accelerate/cpu_zero2.yaml",
        "--num_processes",
        "2",
        "--mixed_precision",
        "no",
        "--main_process_port",
        "29512",
        "-m",
        "finetune",
        "--model_name_or_path",
        "tiny",
        "--dataset_name",
        "sample",
        "--n_train",
        "200",
        "--n_val",
        "8",
        "--num_train_epochs",
        "2",
        "--learning_rate",
        "0.001",
        "--per_device_train_batch_size",
        "8",
        "--per_device_eval_batch_size",
        "8",
        "--max_source_length",
        "128",
        "--max_target_length",
        "8",
        "--source_prefix=chatbot: ",
        "--num_beams",
        "1",
        "--logging_steps",
        "2",
        "--val_min_target_length",
        "8",
        "--checkpointing_steps",
        "5",
        "--output_dir",
        str(run_dir),
    ]
    attempt = {
        "argv": argv,
        "pid": 999_999_999,
        "pgid": 999_999_999,
        "started": time.time(),
        "resume": False,
        "metrics_offset": 0,
        "log_offset": 0,
        "exit_code": 0,
    }
    info = {"run_id": OLD_RUN_ID, "spec": spec, "created": time.time(), **attempt, "attempts": [attempt]}
    (run_dir / "run.json").write_text(json.dumps(info, indent=2))
    (run_dir / "train.log").write_text("=== start\nstep 5: checkpoint\n")
    metrics = ckpt.MetricsWriter(run_dir, enabled=True)
    metrics.write("start", total_steps=26, resumed_at=0)
    metrics.write("log", step=2, loss=7.0, samples_per_second=50.0)
    metrics.write("checkpoint", step=5)
    metrics.write("stopped", step=5)
    return run_dir, argv


def test_old_run_folders_show_list_and_resume(roots, monkeypatch):
    runs, _ = roots
    run_dir, old_argv = old_run_folder(runs)
    monkeypatch.setattr(command, "ROOT", runs.parent)  # the runs root is in "the repository"
    manager = RunManager(runs)
    assert manager.runs() == [OLD_RUN_ID]
    status = manager.status()
    assert (status.run_id, status.state, status.step, status.total_steps) == (OLD_RUN_ID, "stopped", 5, 26)
    assert status.has_checkpoint and status.command.endswith(f"--output_dir runs/{OLD_RUN_ID}")
    assert status.command.startswith("python -m accelerate.commands.launch") and str(runs) not in status.command

    launched = []  # the resumed command, run by a stub that looks like the run's process and ends at once
    real_spawn = process.spawn
    monkeypatch.setattr(
        process,
        "spawn",
        lambda argv, folder, log: (
            launched.append(argv) or real_spawn([sys.executable, "-c", "pass", "finetune", str(folder)], folder, log)
        ),
    )
    manager.resume(OLD_RUN_ID)
    new = parse_args(launcher_args(launched[0]).training_script_args)
    assert new == parse_args([*launcher_args(old_argv).training_script_args, "--resume_from_checkpoint", "latest"])
    info = json.loads((run_dir / "run.json").read_text())
    assert info["spec"]["epochs"] == 2 and len(info["attempts"]) == 2 and info["argv"] == launched[0]
    header = (run_dir / "train.log").read_text().splitlines()[-1]  # visitors read the log: no server folders
    assert header.startswith("=== resume ") and header.endswith(
        f"--output_dir runs/{OLD_RUN_ID} --resume_from_checkpoint latest"
    )
    assert str(runs) not in header and launched[0][-3] == str(run_dir)  # what runs has the real folder
    wait_for(manager, OLD_RUN_ID, settled, timeout=30)


# --------------------------------------------------------------------------- real runs


TINY = {"n_val": 8, "num_beams": 1, "per_device_train_batch_size": 8, "per_device_eval_batch_size": 8}


@pytest.fixture(scope="module")
def runs_root(tmp_path_factory):
    return tmp_path_factory.mktemp("jobs") / "runs"


@pytest.fixture(scope="module")
def finished_run(tiny_path, runs_root):
    manager = RunManager(runs_root)
    status = manager.start(spec(**TINY, n_train=200, num_train_epochs=1))
    run_id = status.run_id
    assert re.fullmatch(r"\d{8}-\d{6}-[0-9a-f]{6}", run_id)
    assert status.state == "running", status.log_tail
    assert manager.status().run_id == run_id and RunManager(runs_root).status().state == "running"
    with pytest.raises(RunBusyError, match="still running"):
        manager.start(spec(**TINY, n_train=200, num_train_epochs=1))
    with pytest.raises(RunBusyError):
        RunManager(runs_root).start(spec(**TINY, n_train=200, num_train_epochs=1))  # another viewer / restarted app
    assert manager.runs() == [run_id]  # the refused starts left nothing behind
    status = wait_for(manager, run_id, settled)
    return manager, status


def test_real_run_finishes(finished_run, runs_root):
    manager, status = finished_run
    assert status.state == "finished", status.error or status.log_tail
    run_dir = runs_root / status.run_id
    info = json.loads((run_dir / "run.json").read_text())
    assert info["spec"]["config"]["n_train"] == 200
    assert info["argv"][:3] == [sys.executable, "-m", "accelerate.commands.launch"]
    assert info["pid"] == info["pgid"] and info["exit_code"] == 0
    assert status.step == status.total_steps == 13 and status.progress == 1.0  # 200 rows / (8 x 2 processes)
    # the CLI logs the first step too (it shows the run is alive), then every 10 steps and the last one
    assert [p["step"] for p in status.loss_points] == [1, 10, 13] and all(p["loss"] > 0 for p in status.loss_points)
    assert status.bleu_points == [{"step": 13, "bleu": status.eval_bleu}] and status.eval_bleu is not None
    assert status.samples and set(status.samples[0]) >= {"prompt", "prediction", "reference"}
    assert status.samples_per_second > 0 and status.gpu_mem_gib is None and status.error is None
    assert status.final_dir == str(run_dir / "final") and (run_dir / "final" / "model.safetensors").is_file()
    assert "final model in" in status.log_tail and len(status.log_tail.splitlines()) <= 40
    assert status.command.startswith("python -m accelerate.commands.launch --config_file configs/accelerate/")
    assert sys.executable not in status.command and not status.samples_private  # the shipped sample is public
    label, path = manager.finished_runs()[0]
    assert path == status.final_dir and label == f"{status.run_id} (BLEU {status.eval_bleu:.1f})"
    # the child was reaped: no zombie left
    stat = process.proc_stat(info["pid"])
    assert stat is None or stat[0] != "Z"
    # a finished run can be the next run's model (runs root is allowed), and is not resumable
    assert spec(model=path).config.model_name_or_path == path
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
    made = spec(
        **{**TINY, "per_device_train_batch_size": 16},
        n_train=1400,
        num_train_epochs=2,
        checkpointing_steps=20,
        logging_steps=5,
    )
    run_id = manager.start(made).run_id
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
    starts = [json.loads(row) for row in (runs_root / run_id / "metrics.jsonl").read_text().splitlines()]
    assert [e["resumed_at"] for e in starts if e["event"] == "start"] == [0, stopped.step]
    assert len(json.loads((runs_root / run_id / "run.json").read_text())["attempts"]) == 2
    assert restarted.finished_runs()[0][0].split()[0] == run_id


def test_unreachable_dataset_fails_with_the_cli_message(tiny_path, runs_root, finished_run):
    manager = RunManager(runs_root)
    run_id = manager.start(spec(**TINY, dataset_name="nobody/nothing")).run_id
    status = wait_for(manager, run_id, settled)
    assert status.state == "failed"
    assert status.error.startswith("cannot load dataset 'nobody/nothing' from the Hub"), status.error
    assert status.final_dir is None and not status.has_checkpoint
    assert RunManager(runs_root).status(run_id).error == status.error  # also from disk alone
    with pytest.raises(ValueError, match="no checkpoint to resume from"):
        manager.resume(run_id)
