"""Shared by the tests of finetune/jobs (tests/finetune/test_jobs_*.py): data files, specs as the
Train tab makes them, the launcher's parse of a command, waiting for a run (the ``roots`` fixture
is in conftest.py)."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from finetune.jobs.manager import RunManager
from finetune.jobs.spec import JobSpec, app_config
from finetune.jobs.status import RunStatus

TIMEOUT = 180  # seconds any single wait for a run may take
LAUNCH = ("strategy", "precision", "num_gpus", "split_train_file")


def spec(model: str = "tiny", **changes) -> JobSpec:
    """A JobSpec as the Train tab starts it: the app's preset for ``model`` on the sample (unless
    ``changes`` give data files), then ``changes`` (TrainConfig names, or launch settings)."""
    launch = {name: changes.pop(name) for name in LAUNCH if name in changes}
    if "train_file" not in changes and "split_train_file" not in launch:
        changes.setdefault("dataset_name", "sample")
    return JobSpec(app_config(model, **changes), **launch)


def write_jsonl(path: Path, rows) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def good_rows(n):
    return [{"texts": f"context: happy  <s> hello number {i}", "labels": f"hi {i}!"} for i in range(n)]


def launcher_args(argv):
    """The launcher's own parse of an argv (its training_script_args are the CLI's flags)."""
    from accelerate.commands.launch import launch_command_parser

    assert argv[:3] == [sys.executable, "-m", "accelerate.commands.launch"]
    return launch_command_parser().parse_args(argv[3:])


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


def fake_run(manager: RunManager, run_id: str, code: str) -> subprocess.Popen:
    """A run dir whose 'training' process is a stub that looks like ours (argv has finetune + run dir)."""
    run_dir = manager.root / run_id
    run_dir.mkdir(parents=True)
    proc = subprocess.Popen(
        [sys.executable, "-c", code, "finetune", "--output_dir", str(run_dir)], start_new_session=True
    )
    info = {
        "run_id": run_id,
        "spec": spec().to_dict(),
        "argv": ["python", "-m", "finetune"],
        "pid": proc.pid,
        "pgid": proc.pid,
        "started": time.time(),
        "metrics_offset": 0,
        "log_offset": 0,
        "attempts": [],
    }
    (run_dir / "run.json").write_text(json.dumps(info))
    # Until the child has exec'd, /proc shows it with pytest's argv: a run not alive yet, which a
    # Stop at once would leave alone (seen on a busy 2-core CI machine). Wait until it is ours.
    deadline = time.monotonic() + TIMEOUT
    while proc.pid not in training_processes(run_dir):
        assert proc.poll() is None and time.monotonic() < deadline, "the stub run never showed up in /proc"
        time.sleep(0.01)
    return proc


def training_processes(run_dir: Path) -> dict[int, tuple[int, int]]:
    """pid -> (ppid, pgid) of every live (not zombie) process whose argv has "finetune" and the
    run folder: read from /proc here, not through finetune/jobs/process.py, which is under test."""
    found = {}
    for entry in os.listdir("/proc"):
        try:
            stat = Path(f"/proc/{entry}/stat").read_text()
            args = Path(f"/proc/{entry}/cmdline").read_bytes().split(b"\0")
        except (OSError, ValueError):
            continue
        fields = stat[stat.rindex(")") + 2 :].split()
        if fields[0] not in "ZX" and b"finetune" in args and str(run_dir).encode() in args:
            found[int(entry)] = (int(fields[1]), int(fields[2]))
    return found


def environ(pid: int) -> dict[str, str]:
    """The environment a process started with, from /proc/<pid>/environ."""
    raw = Path(f"/proc/{pid}/environ").read_bytes()
    return dict(item.decode().split("=", 1) for item in raw.split(b"\0") if b"=" in item)


def kill_all(run_dir: Path, timeout: float = 15) -> None:
    """Test cleanup: SIGKILL whatever of the run is left, and wait until it is gone."""
    deadline = time.monotonic() + timeout
    while (left := training_processes(run_dir)) and time.monotonic() < deadline:
        for pid in left:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        time.sleep(0.1)


# run.json's "spec" as written by finetune/runner.py's RunSpec, before finetune/jobs
OLD_SPEC = {
    "model": "tiny",
    "dataset": "sample",
    "validation_file": None,
    "n_train": 200,
    "n_val": 8,
    "epochs": 2,
    "learning_rate": 0.001,
    "train_batch_size": 8,
    "eval_batch_size": 8,
    "max_source_length": 128,
    "max_target_length": 8,
    "source_prefix": "-x: ",
    "strategy": "zero2",
    "precision": "auto",
    "num_gpus": 0,
    "checkpointing_steps": 5,
    "num_beams": 1,
    "push_to_hub": False,
    "hub_model_id": None,
    "hub_private": False,
    "logging_steps": 2,
}
