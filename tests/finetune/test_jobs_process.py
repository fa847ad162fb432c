"""finetune/jobs/process.py: liveness from /proc, the busy check, and the stop escalation
(STOP file, then SIGTERM, then SIGKILL), with stub processes instead of training."""

import json
import os
import signal

import pytest
from jobs_helpers import fake_run, settled, spec, wait_for

from finetune.jobs import process
from finetune.jobs.manager import RunBusyError, RunManager


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
