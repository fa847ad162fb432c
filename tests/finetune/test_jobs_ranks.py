"""finetune/jobs: a run is all of its processes. torch elastic starts each rank in a session of
its own (not in the launcher's process group), so a rank can hang through a stop or outlive its
launcher; real 2-process CPU runs of the tiny model, a rank frozen with SIGSTOP."""

import json
import os
import signal
import time

import pytest
from jobs_helpers import environ, kill_all, settled, spec, training_processes, wait_for

from finetune.jobs import process
from finetune.jobs.manager import RunBusyError, RunManager

# long enough never to finish during a test (each test kills it)
LONG = {
    "n_val": 8,
    "num_beams": 1,
    "per_device_train_batch_size": 8,
    "per_device_eval_batch_size": 8,
    "n_train": 1400,
    "num_train_epochs": 50,
}
SECRETS = {
    "TRAIN_PASSWORD": "hunter2-password",
    "OAUTH_CLIENT_SECRET": "oauth-secret",
    "TRAIN_USERS": "alice",
    "GRADIO_MCP_SERVER": "true",
}
TOKEN = "hf_NotARealTokenButNeededByRuns123"


@pytest.fixture
def training(tiny_path, roots, monkeypatch):
    """(manager, run folder, launcher pid, rank pids) of a real run past its first step, started
    with the app's secrets in the environment; whatever is left of it is killed afterwards."""
    runs, _ = roots
    for name, value in {**SECRETS, "HF_TOKEN": TOKEN}.items():
        monkeypatch.setenv(name, value)
    manager = RunManager(runs, grace_seconds=1, term_seconds=2)
    run_id = manager.start(spec(**LONG)).run_id
    run_dir = runs / run_id
    try:
        status = wait_for(manager, run_id, lambda s: s.step >= 1 or settled(s))
        assert status.state == "running", status.error or status.log_tail
        launcher = json.loads((run_dir / "run.json").read_text())["pid"]
        procs = training_processes(run_dir)
        ranks = sorted(pid for pid, (ppid, _) in procs.items() if ppid == launcher)
        assert launcher in procs and len(ranks) == 2, procs
        # the fault's cause: each rank leads a process group of its own, not the launcher's
        assert all(procs[r][1] == r != launcher for r in ranks)
        yield manager, run_dir, launcher, ranks
    finally:
        kill_all(run_dir)


def watch_until_settled(manager, run_dir, timeout=60) -> tuple:
    """Poll the status, and the run's processes right after each status: (last status, list of
    (state, live processes))."""
    seen, deadline = [], time.monotonic() + timeout
    while True:
        status = manager.status(run_dir.name)
        seen.append((status.state, len(training_processes(run_dir))))
        if settled(status) or time.monotonic() > deadline:
            return status, seen
        time.sleep(0.1)


def test_stop_ends_every_process_of_a_run_with_a_hung_rank(training):
    manager, run_dir, launcher, ranks = training
    for pid in (launcher, *ranks):  # the training processes got HF_TOKEN, none of the app's secrets
        env = environ(pid)
        assert env.get("HF_TOKEN") == TOKEN and "PATH" in env and not set(SECRETS) & set(env)
    os.kill(ranks[0], signal.SIGSTOP)  # hung: the other rank blocks at its next collective
    assert manager.stop(run_dir.name).state == "stopping"
    with pytest.raises(RunBusyError, match=f"run {run_dir.name} is still running"):
        manager.resume(run_dir.name)
    with pytest.raises(RunBusyError):
        manager.start(spec(**LONG))
    status, seen = watch_until_settled(manager, run_dir)
    # stopped/failed only once every process has ended; never "failed ... killed" with ranks alive
    assert status.state == "failed" and "was killed" in status.error, (status.error, seen)
    assert all(state in ("running", "stopping") for state, alive in seen if alive), seen
    assert training_processes(run_dir) == {} and not process.run_alive(run_dir, process.snapshot(0))


def test_a_rank_that_outlives_its_launcher_blocks_new_runs_until_stopped(training):
    manager, run_dir, launcher, ranks = training
    os.kill(ranks[0], signal.SIGSTOP)  # so it cannot react to its launcher's death
    os.kill(launcher, signal.SIGKILL)
    deadline = time.monotonic() + 15
    while process.proc_stat(launcher) is not None and time.monotonic() < deadline:  # reaped by the manager
        time.sleep(0.1)
    assert process.proc_stat(launcher) is None and ranks[0] in training_processes(run_dir)
    assert json.loads((run_dir / "run.json").read_text())["exit_code"] == -signal.SIGKILL
    assert manager.status(run_dir.name).state == "running"  # not "failed": a rank still writes here
    assert RunManager(manager.root).status().run_id == run_dir.name
    with pytest.raises(RunBusyError, match=f"run {run_dir.name} is still running"):
        manager.start(spec(**LONG))
    with pytest.raises(RunBusyError):
        manager.resume(run_dir.name)
    assert manager.stop().state == "stopping"  # the default run is the one with a live rank
    status, seen = watch_until_settled(manager, run_dir)
    assert settled(status) and training_processes(run_dir) == {}, seen
    assert all(state in ("running", "stopping") for state, alive in seen if alive), seen
