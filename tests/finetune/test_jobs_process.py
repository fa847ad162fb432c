"""finetune/jobs/process.py: liveness from /proc (every process of a run, whatever its process
group), the busy check, the stop escalation (STOP file, then SIGTERM, then SIGKILL), the
environment of a run, and status polls sharing one scan; stub processes instead of training."""

import json
import os
import signal
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
from jobs_helpers import environ, fake_run, kill_all, settled, spec, training_processes, wait_for

from finetune.jobs import command, process
from finetune.jobs.manager import RunBusyError, RunManager

RUN_ID = "20250101-000000-abcdef"


def test_liveness_busy_and_forced_stop(roots):
    """A process that ignores STOP and SIGTERM is killed; another instance sees it all from disk."""
    runs, _ = roots
    manager = RunManager(runs, grace_seconds=0.5, term_seconds=0.5)
    run_id = "20250101-000000-abcdef"
    stubborn = "import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); time.sleep(60)"
    proc = fake_run(manager, run_id, stubborn)
    try:
        assert RunManager(runs).status().run_id == run_id
        assert RunManager(runs).status(run_id).state == "running"
        with pytest.raises(RunBusyError, match=f"run {run_id} is still running"):
            RunManager(runs).start(spec())
        with pytest.raises(RunBusyError):
            manager.resume(run_id)
        assert manager.stop().state == "stopping"
        assert (runs / run_id / "STOP").exists()
        assert proc.wait(timeout=15) == -signal.SIGKILL
        status = wait_for(manager, run_id, settled, timeout=15)
        assert status.state == "failed" and "did not stop within 0.5 s" in status.error, status.error
        assert not process.is_stopping(runs / run_id)
    finally:
        proc.kill()
        proc.wait()
    # a dead pid (or one reused by an unrelated process) is not our run
    info = json.loads((runs / run_id / "run.json").read_text())
    info["pid"] = info["pgid"] = os.getpid()
    (runs / run_id / "run.json").write_text(json.dumps(info))
    assert RunManager(runs).status(run_id).state == "failed"


def test_a_run_that_stops_on_sigterm_is_not_killed(roots):
    runs, _ = roots
    manager = RunManager(runs, grace_seconds=0.3, term_seconds=5)
    run_id = "20250101-000000-abcdef"
    proc = fake_run(manager, run_id, "import time; time.sleep(60)")  # SIGTERM ends it
    try:
        manager.stop(run_id)
        assert proc.wait(timeout=15) == -signal.SIGTERM
        status = wait_for(manager, run_id, settled, timeout=15)
        assert "killed" not in json.loads((runs / run_id / "run.json").read_text())
        assert "did not stop" not in (status.error or "")
    finally:
        proc.kill()
        proc.wait()


def test_proc_stat_of_a_gone_process():
    assert process.proc_stat(os.getpid())[0] in "RS"
    assert process.proc_stat(2**22 + 12345) is None


# --------------------------------------------------------------------------- a run is all of its processes

# A launcher that starts a "rank" the way torch elastic does, in a session of its own; the rank
# ignores SIGTERM (as one hung in a collective does) and starts a worker of its own, in its group,
# whose argv names neither finetune nor the run.
LAUNCHER = """
import subprocess, sys, time
rank = ("import signal, subprocess, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); "
        "subprocess.Popen(['sleep', '30']); time.sleep(30)")
subprocess.Popen([sys.executable, '-c', rank, 'finetune', '--output_dir', sys.argv[-1]], start_new_session=True)
time.sleep(60)
"""


def children(pid: int) -> list[int]:
    """Live (not zombie) children of ``pid``, from /proc."""
    found = []
    for entry in filter(str.isdigit, os.listdir("/proc")):
        try:
            fields = Path(f"/proc/{entry}/stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if fields[0] != "Z" and fields[1] == str(pid):
            found.append(int(entry))
    return found


def test_a_rank_in_its_own_session_that_outlives_its_launcher_is_the_run(roots):
    runs, _ = roots
    manager = RunManager(runs, grace_seconds=0.3, term_seconds=0.5)
    launcher = fake_run(manager, RUN_ID, LAUNCHER)
    run_dir = runs / RUN_ID
    worker = None
    try:
        deadline = time.monotonic() + 15
        while (
            not ((ranks := [p for p in training_processes(run_dir) if p != launcher.pid]) and children(ranks[0]))
            and time.monotonic() < deadline
        ):
            time.sleep(0.05)
        rank, worker = ranks[0], children(ranks[0])[0]
        assert training_processes(run_dir)[rank][1] == rank != launcher.pid  # a group of its own
        launcher.kill()
        launcher.wait()
        assert process.run_pids(run_dir, process.snapshot(0)) == {rank, worker}
        assert manager.status(RUN_ID).state == "running" and manager.status().run_id == RUN_ID
        with pytest.raises(RunBusyError, match=f"run {RUN_ID} is still running"):
            RunManager(runs).start(spec())
        with pytest.raises(RunBusyError):
            manager.resume(RUN_ID)
        assert manager.stop().state == "stopping"
        status = wait_for(manager, RUN_ID, settled, timeout=20)
        assert status.state == "failed" and "was killed" in status.error, status.error
        assert training_processes(run_dir) == {}
        assert process.proc_stat(worker) is None or process.proc_stat(worker)[0] == "Z"  # its group got it too
    finally:
        kill_all(run_dir)
        if worker is not None and process.proc_stat(worker) is not None:
            os.kill(worker, signal.SIGKILL)


def test_only_the_output_folder_makes_a_process_the_runs(roots, tmp_path):
    runs, _ = roots
    first, second = runs / "20250101-000000-aaaaaa", runs / "20250102-000000-bbbbbb"
    argv = [
        sys.executable,
        "-c",
        "import time; time.sleep(30)",
        "finetune",
        "--model_name_or_path",
        str(first / "final"),
        f"--output_dir={second}",
    ]
    proc = process.subprocess.Popen(argv, start_new_session=True)
    try:
        deadline = time.monotonic() + 10  # until its command line shows
        while not process.run_alive(second, process.snapshot(0)) and time.monotonic() < deadline:
            time.sleep(0.02)
        snap = process.snapshot(0)
        assert process.run_pids(second, snap) == {proc.pid} and process.run_pids(first, snap) == set()
        assert process.live_runs(runs, snap) == {second.name: {proc.pid}}
        assert process.live_runs(tmp_path, snap) == {}  # the root holds the runs, not any folder above
    finally:
        proc.kill()
        proc.wait()


# --------------------------------------------------------------------------- the environment of a run

APP_SECRETS = {
    "TRAIN_PASSWORD": "hunter2",
    "TRAIN_USERS": "alice,bob",
    "OAUTH_CLIENT_SECRET": "s1",
    "OAUTH_CLIENT_ID": "id",
    "OAUTH_SCOPES": "openid",
    "OPENID_PROVIDER_URL": "https://hf.co",
    "GRADIO_SERVER_NAME": "0.0.0.0",
    "OPENAI_API_KEY": "sk-1",
    "GITHUB_TOKEN": "ghp_1",
    "AWS_SECRET_ACCESS_KEY": "aws",
    "DB_PASSWORD": "pw",
    "SSH_AUTH_SOCK": "/tmp/agent",
}
RUN_NEEDS = {
    "HF_TOKEN": "hf_1",
    "HF_HOME": "/cache/hf",
    "HF_HUB_OFFLINE": "1",
    "HUGGING_FACE_HUB_TOKEN": "hf_1",
    "CUDA_VISIBLE_DEVICES": "0,1",
    "PYTHONPATH": "/x",
    "TOKENIZERS_PARALLELISM": "false",
    "NCCL_DEBUG": "WARN",
    "WANDB_API_KEY": "w",
    "LD_LIBRARY_PATH": "/lib",
    "SPACE_ID": "me/app",
}


def test_runs_are_launched_without_the_apps_secrets(tmp_path, monkeypatch):
    quiet = {"OMP_NUM_THREADS": "3", "DS_ACCELERATOR": "cuda"}  # set ones are kept (else run_env sets them)
    assert command.run_env({**APP_SECRETS, **RUN_NEEDS, "PATH": "/bin", **quiet}) == {
        **RUN_NEEDS,
        "PATH": "/bin",
        **quiet,
    }
    for name, value in {**APP_SECRETS, **RUN_NEEDS}.items():
        monkeypatch.setenv(name, value)
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    with open(tmp_path / "train.log", "ab") as log:  # the spawn path of every launch
        proc = process.spawn(
            [sys.executable, "-c", "import time; time.sleep(30)", "finetune", str(run_dir)], run_dir, log
        )
    try:
        env = environ(proc.pid)
        assert not set(APP_SECRETS) & set(env), set(APP_SECRETS) & set(env)
        assert all(env[name] == value for name, value in RUN_NEEDS.items())
        assert env["PATH"] == os.environ["PATH"] and env["HOME"] == os.environ["HOME"]
        assert env["PYTHONUNBUFFERED"] == "1"
    finally:
        proc.kill()
        proc.wait()


# --------------------------------------------------------------------------- status under load


def test_status_polls_share_one_scan_and_follow_start_and_stop(roots, monkeypatch):
    runs, _ = roots
    scans = []
    real_scan, real_spawn = process._scan, process.spawn
    monkeypatch.setattr(process, "_scan", lambda: scans.append(time.monotonic()) or real_scan())
    manager = RunManager(runs, grace_seconds=0.2, term_seconds=1)
    proc = fake_run(manager, RUN_ID, "import time; time.sleep(60)")
    try:
        assert manager.status(RUN_ID).state == "running"
        scans.clear()
        began = time.monotonic()
        with ThreadPoolExecutor(8) as pool:  # 8 pages polling at once, fresh managers (page reloads) too
            states = [
                s
                for batch in pool.map(
                    lambda i: [
                        RunManager(runs).status().state if i % 2 else manager.status(RUN_ID).state for _ in range(25)
                    ],
                    range(8),
                )
                for s in batch
            ]
        elapsed = time.monotonic() - began
        assert len(states) == 200 and set(states) == {"running"}
        # one when the shared scan expires (once per SCAN_SECONDS), one more if a child of an
        # earlier test is reaped meanwhile (that makes the next scan fresh)
        assert len(scans) <= 2 + elapsed / process.SCAN_SECONDS, (len(scans), elapsed)
        # a stop shows at once, and so does its end; a start shows at once too
        assert manager.stop(RUN_ID).state == "stopping" and manager.status().state == "stopping"
        assert proc.wait(timeout=10) == -signal.SIGTERM
        assert settled(wait_for(manager, RUN_ID, settled, timeout=10))
        monkeypatch.setattr(
            process,
            "spawn",
            lambda argv, folder, log: real_spawn(
                [sys.executable, "-c", "import time; time.sleep(60)", "finetune", str(folder)], folder, log
            ),
        )
        assert manager.status().run_id == RUN_ID
        started = manager.start(spec())
        assert manager.status().run_id == started.run_id and manager.status().state == "running"
        assert manager.stop().state == "stopping"
        assert settled(wait_for(manager, started.run_id, settled, timeout=10))
    finally:
        proc.kill()
        proc.wait()
        for run_dir in runs.iterdir():
            kill_all(run_dir)
