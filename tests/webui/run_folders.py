"""Run folders written by the real training CLI, for the runs view's tests: three short runs on the
demo model (one continued from another's final model, one stopped early), a corrupt folder and a
foreign one. The two independent runs train side by side."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from chat.layout import DEMO_DIR, ROOT

# App-style ids (finetune.jobs.paths.RUN_ID_RE): the view sorts them by launch time.
FIRST, SECOND, STOPPED = "20261203-100000-aaaaaa", "20261203-110000-bbbbbb", "20261203-090000-cccccc"
CORRUPT, FOREIGN = "20261203-080000-dddddd", "holiday-photos"
FAST = (
    "--dataset_name sample --n_train 16 --n_val 60 --num_beams 1 --val_min_target_length 2 "
    "--per_device_train_batch_size 8 --per_device_eval_batch_size 60 --logging_steps 1 --max_train_steps 2"
).split()


def _launch(out: Path, *args: str) -> subprocess.Popen:
    cmd = [sys.executable, "-m", "finetune", *FAST, *args, "--output_dir", str(out)]
    return subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def _wait(proc: subprocess.Popen) -> None:
    out, _ = proc.communicate(timeout=600)
    assert proc.returncode == 0, out[-3000:]


def make_runs(root: Path) -> dict[str, Path]:
    """The five folders under ``root`` (created), by id."""
    root.mkdir(parents=True, exist_ok=True)
    folders = {name: root / name for name in (FIRST, SECOND, STOPPED, CORRUPT, FOREIGN)}
    folders[STOPPED].mkdir()
    (folders[STOPPED] / "STOP").touch()  # asked to stop before it starts: it stops at its first check
    first = _launch(folders[FIRST], "--model_name_or_path", str(DEMO_DIR), "--learning_rate", "1e-4")
    stopped = _launch(folders[STOPPED], "--model_name_or_path", str(DEMO_DIR), "--learning_rate", "1e-4")
    _wait(first)
    second = _launch(folders[SECOND], "--model_name_or_path", str(folders[FIRST] / "final"), "--learning_rate", "3e-4")
    _wait(stopped)
    _wait(second)
    folders[CORRUPT].mkdir()
    (folders[CORRUPT] / "run.json").write_text('{"spec": {"config": ')  # cut short
    folders[FOREIGN].mkdir()
    (folders[FOREIGN] / "beach.jpg").write_bytes(b"\xff\xd8")
    return folders
