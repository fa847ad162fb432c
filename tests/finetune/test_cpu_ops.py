"""finetune/cpu_ops.py: a build of a torch extension killed mid-way leaves torch's lock file, and
every later run waits on it forever (CI timed out so); the launcher deletes such a lock, never one a
live build holds."""

import os
import signal
import subprocess
import sys
import time

import pytest
from jobs_helpers import settled, spec, wait_for

from finetune import cpu_ops
from finetune.jobs.manager import RunManager
from finetune.jobs.paths import LOG_FILE

TINY = dict(n_train=16, n_val=4, num_train_epochs=1)


def aged(path, seconds=60.0):
    past = time.time() - seconds
    os.utime(path, (past, past))
    return path


def killed_build(folder) -> None:
    """What a run stopped mid-build leaves: torch's own FileBaton taken, then the process killed."""
    folder.mkdir(parents=True)
    code = (
        "import sys, time\nfrom torch.utils.file_baton import FileBaton\n"
        "assert FileBaton(sys.argv[1]).try_acquire()\nprint('held', flush=True)\ntime.sleep(60)"
    )
    proc = subprocess.Popen([sys.executable, "-c", code, str(folder / "lock")], stdout=subprocess.PIPE, text=True)
    assert proc.stdout.readline() == "held\n"
    proc.send_signal(signal.SIGKILL)
    proc.wait(10)


@pytest.mark.skipif(not os.path.isdir("/proc/self/fd"), reason="holders are read from Linux's /proc")
def test_only_a_lock_nobody_holds_and_not_just_made_is_stale(tmp_path):
    killed_build(tmp_path / "deepspeed_shm_comm")
    aged(tmp_path / "deepspeed_shm_comm" / "lock")
    (tmp_path / "cpu_adam").mkdir()
    held = os.open(tmp_path / "cpu_adam" / "lock", os.O_CREAT | os.O_EXCL)  # as a build in progress holds it
    aged(tmp_path / "cpu_adam" / "lock")
    (tmp_path / "fresh").mkdir()
    (tmp_path / "fresh" / "lock").touch()  # a process may be making it right now
    (tmp_path / "built").mkdir()  # a folder with no lock at all
    try:
        assert cpu_ops.stale_locks(tmp_path) == [tmp_path / "deepspeed_shm_comm" / "lock"]
        assert cpu_ops.clear_stale_locks(tmp_path) == [tmp_path / "deepspeed_shm_comm" / "lock"]
        assert not (tmp_path / "deepspeed_shm_comm" / "lock").exists()
        assert (tmp_path / "cpu_adam" / "lock").exists() and (tmp_path / "fresh" / "lock").exists()
    finally:
        os.close(held)
    # Once its holder lets go, it is stale too (its build was killed).
    assert cpu_ops.stale_locks(tmp_path) == [tmp_path / "cpu_adam" / "lock"]
    assert cpu_ops.stale_locks(tmp_path / "nowhere") == []


def test_unbuilt_names_a_missing_or_locked_op(tmp_path, monkeypatch):
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path))
    assert cpu_ops.unbuilt() == ["deepspeed_shm_comm", "cpu_adam"]
    for name in ("deepspeed_shm_comm", "cpu_adam"):
        (tmp_path / name).mkdir()
        (tmp_path / name / f"{name}.so").write_bytes(b"")
    assert cpu_ops.unbuilt() == []
    (tmp_path / "cpu_adam" / "lock").touch()
    assert cpu_ops.unbuilt() == ["cpu_adam"]


@pytest.mark.skipif(not os.path.isdir("/proc/self/fd"), reason="holders are read from Linux's /proc")
def test_a_launch_deletes_the_lock_a_killed_build_left(tmp_path, monkeypatch, tiny_path):
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path / "ext"))
    killed_build(tmp_path / "ext" / "deepspeed_shm_comm")
    lock = aged(tmp_path / "ext" / "deepspeed_shm_comm" / "lock")
    manager = RunManager(tmp_path / "runs")
    # A run that fails at its data, before it builds or connects anything: only the launch is tested.
    run_id = manager.start(spec(**TINY, dataset_name="nobody/nothing")).run_id
    assert not lock.exists()
    status = wait_for(manager, run_id, settled)
    assert status.state == "failed"
    head = (tmp_path / "runs" / run_id / LOG_FILE).read_text().splitlines()[:2]
    assert head[0].startswith("=== start ")
    # No path in it: visitors read the log.
    assert head[1] == "=== deleted the lock file a killed build of a DeepSpeed op left behind"
