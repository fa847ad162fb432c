"""The first minutes of a run as a user lives them: a real CPU run through RunManager writes
`phase` events while it sets up, and its train.log holds one line per fact (no launcher
banners, no FutureWarnings, no progress-bar redraws or escape codes); a DeepSpeed run on the
CPU without a C++ compiler fails at once with a clear error."""

import json
import os
import subprocess
import sys
import time

import pytest
import torch
from jobs_helpers import settled, spec, wait_for
from test_jobs_status import failed_run

from chat.layout import ROOT
from finetune import cpu_ops, parts
from finetune.jobs.manager import RunManager
from finetune.jobs.status import RunStatus, status_of
from finetune.parts import TrainingError, check_compiler

TINY = {"n_val": 8, "num_beams": 1, "val_min_target_length": 2, "logging_steps": 2}


def test_real_run_writes_phases_and_a_quiet_log(tiny_path, roots, monkeypatch):
    runs, _ = roots
    manager = RunManager(runs)
    # What the run's phases say depends on whether this machine has built DeepSpeed's CPU
    # communication op yet (the first CPU run builds it, about a minute): asked here, as the run's
    # main process will. (The CPU recipe trains with torch's AdamW: no CPU Adam op to build.)
    with monkeypatch.context() as env:
        env.setenv("ACCELERATE_USE_DEEPSPEED", "true")
        connecting = parts.connecting_phase()
    run_id = manager.start(spec(**TINY, n_train=64, max_train_steps=4)).run_id
    status = wait_for(manager, run_id, settled)
    assert status.state == "finished", status.error or status.log_tail
    run_dir = runs / run_id
    events = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    names = [e["event"] for e in events]
    phases = [e["phase"] for e in events if e["event"] == "phase"]
    assert names.index("start") == len(phases)  # every phase comes before the start, once (main process)
    if connecting.startswith("building"):  # the two processes race to build it: "or waiting" may be said
        connecting = phases[2] if phases[2].startswith("building DeepSpeed's CPU communication op") else connecting
    assert phases[:5] == ["loading the tokenizer", "loading data", connecting, "tokenizing", "loading the model"]
    assert phases[5:] == ["preparing DeepSpeed"], phases
    log = (run_dir / "train.log").read_text()
    assert log.count("Setting accelerator to CPU") <= 1, log
    assert "OMP_NUM_THREADS" not in log and "FutureWarning" not in log, log
    assert "\x1b[" not in log and "\r" not in log, log
    assert "\x1b[" not in status.log_tail and "\r" not in status.log_tail


def test_deepspeed_on_cpu_without_a_compiler_fails_clearly(tmp_path):
    empty = tmp_path / "bin"  # a PATH without c++/g++ (python is run by its full path)
    empty.mkdir()
    out = tmp_path / "run"
    env = {**os.environ, "PATH": str(empty), "ACCELERATE_USE_DEEPSPEED": "true", "CUDA_VISIBLE_DEVICES": ""}
    env.pop("CXX", None)
    proc = subprocess.run(
        [sys.executable, "-m", "finetune", "--model_name_or_path", "tiny", "--output_dir", str(out)],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert proc.returncode == 1, proc.stderr[-3000:]
    events = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [e["event"] for e in events] == ["error"]  # before any loading
    assert events[0]["kind"] == "TrainingError"
    message = events[0]["message"]
    assert "C++ compiler" in message and "c++/g++" in message and "apt-get install g++" in message
    assert "make run" in message
    assert message in proc.stderr and "Traceback" not in proc.stderr


def test_the_compiler_check(tmp_path, monkeypatch):
    monkeypatch.setenv("PATH", str(tmp_path))
    monkeypatch.delenv("CXX", raising=False)
    monkeypatch.setenv("ACCELERATE_USE_DEEPSPEED", "true")
    with pytest.raises(TrainingError, match="none was found"):
        check_compiler()
    (tmp_path / "my-cxx").symlink_to("/bin/true")  # $CXX is enough
    monkeypatch.setenv("CXX", "my-cxx")
    check_compiler()
    monkeypatch.delenv("CXX")
    (tmp_path / "g++").symlink_to("/bin/true")
    check_compiler()
    (tmp_path / "g++").unlink()
    monkeypatch.setenv("ACCELERATE_USE_DEEPSPEED", "false")  # no DeepSpeed: nothing to build
    check_compiler()


# --------------------------------------------------------------------------- what RunStatus makes of it


def with_launch_time(run_dir, started):
    info = json.loads((run_dir / "run.json").read_text())
    (run_dir / "run.json").write_text(json.dumps({**info, "started": started}))
    return run_dir


def test_status_has_the_phase_and_the_time_since_launch(tmp_path):
    phases = [{"event": "phase", "phase": "loading the tokenizer"}, {"event": "phase", "phase": "loading the model"}]
    run_dir = with_launch_time(failed_run(tmp_path, events=phases), time.time() - 65)
    status = status_of(run_dir)
    assert status.phase == "loading the model" and status.step == status.total_steps == 0
    assert 64 <= status.seconds_since_launch < 75
    with open(run_dir / "metrics.jsonl", "a") as fh:  # once the start event is written, no phase
        fh.write(json.dumps({"event": "start", "time": time.time(), "total_steps": 10, "resumed_at": 0}) + "\n")
    assert status_of(run_dir).phase is None and RunStatus().seconds_since_launch is None


def test_a_resumed_attempt_starts_its_speed_and_eta_afresh(tmp_path):
    now = time.time()
    earlier = [
        {"event": "start", "total_steps": 100, "resumed_at": 0},
        {"event": "log", "step": 10, "loss": 2.0, "samples_per_second": 99.0},
        {"event": "checkpoint", "step": 10, "path": "x"},
        {"event": "stopped", "step": 10},
    ]
    run_dir = failed_run(
        tmp_path, earlier_events=earlier, events=[{"event": "phase", "phase": "restoring a checkpoint"}]
    )
    status = status_of(run_dir)
    assert status.phase == "restoring a checkpoint" and status.launched_at is None
    assert status.step == 10 and status.total_steps == 100 and status.loss_points == [{"step": 10, "loss": 2.0}]
    assert status.samples_per_second is None  # not the earlier attempt's (the ETA is this attempt's already)
    with open(run_dir / "metrics.jsonl", "a") as fh:
        for event in (
            {"event": "start", "time": now - 20, "total_steps": 100, "resumed_at": 10},
            {"event": "log", "time": now, "step": 20, "loss": 1.5, "samples_per_second": 5.0},
        ):
            fh.write(json.dumps(event) + "\n")
    status = status_of(run_dir)
    assert status.phase is None and status.samples_per_second == 5.0


def test_the_log_tail_has_no_escape_codes_or_redraws(tmp_path):
    log = "\x1b[32mgreen\x1b[0m line\nbar 1/4\rbar 4/4\x1b[A\n\x1b[2Kdone\n"
    status = status_of(failed_run(tmp_path, log=log))
    assert status.log_tail.splitlines() == ["green line", "bar 4/4", "done"]


@pytest.mark.parametrize("preset", [None, "max_split_size_mb:64"])
def test_the_entry_point_lets_the_cuda_allocator_grow_segments_unless_configured(preset):
    """`python -m finetune` turns on expandable segments before torch starts CUDA (the first
    evaluation's growing beam caches), and leaves a user's own allocator setting alone."""
    env = {k: v for k, v in os.environ.items() if k != "PYTORCH_CUDA_ALLOC_CONF"}
    if preset:
        env["PYTORCH_CUDA_ALLOC_CONF"] = preset
    code = (
        "import os, runpy, sys\n"
        "sys.argv = ['finetune', '--help']\n"
        "try:\n    runpy.run_module('finetune', run_name='__main__')\n"
        "except SystemExit as end:\n    assert not end.code\n"
        "print(os.environ['PYTORCH_CUDA_ALLOC_CONF'])"
    )
    proc = subprocess.run(
        [sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True, timeout=120, check=False
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "usage: python -m finetune" in proc.stdout  # the real CLI ran
    assert proc.stdout.strip().splitlines()[-1] == (preset or "expandable_segments:True")


def test_the_phase_line_says_when_deepspeed_builds_its_cpu_ops(tmp_path, monkeypatch):
    """The first CPU run on a machine spent ~55 s in "connecting the processes" while DeepSpeed
    compiled its shared-memory op: the phase says what is really happening, and only then; and a
    build folder locked by an interrupted build (every later run waits on it) is named."""
    if torch.cuda.is_available():
        pytest.skip("DeepSpeed builds these ops on CPU runs only")
    monkeypatch.setenv("ACCELERATE_USE_DEEPSPEED", "true")
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path))  # an empty extension cache: nothing built
    assert cpu_ops.cpu_op_state("connect") == cpu_ops.cpu_op_state("prepare") == "unbuilt"
    assert parts.connecting_phase().startswith("building DeepSpeed's CPU communication op (the first CPU run")
    assert not list(tmp_path.iterdir())  # asking makes nothing (torch's own helper made the folder)
    for name in ("deepspeed_shm_comm", "cpu_adam"):  # what torch's extension cache holds once they are built
        (tmp_path / name).mkdir()
        (tmp_path / name / f"{name}.so").write_bytes(b"")
    assert cpu_ops.cpu_op_state("connect") == cpu_ops.cpu_op_state("prepare") == "built"
    assert parts.connecting_phase() == "connecting the processes"
    (tmp_path / "deepspeed_shm_comm" / "lock").write_bytes(b"")  # torch's build lock, left by a killed build
    assert cpu_ops.cpu_op_state("connect") == "locked"
    said = parts.connecting_phase()
    assert said.startswith("building DeepSpeed's CPU communication op, or waiting while another process builds it")
    assert f"{tmp_path}/deepspeed_shm_comm/lock`: delete that file" in said
    monkeypatch.delenv("ACCELERATE_USE_DEEPSPEED")  # not a DeepSpeed run: nothing to build
    assert cpu_ops.cpu_op_state("connect") is None and parts.connecting_phase() == "connecting the processes"
