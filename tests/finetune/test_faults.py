"""Faults a real run meets: a full disk while saving (a small tmpfs as the output dir; skipped
where mounting is not permitted) and a launcher killed with SIGKILL (its ranks must not train on)."""

import errno
import shutil
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest
from test_train import FAST, accelerate, errors, events, free_port, launch

from chat.layout import ROOT
from finetune import checkpoint as ckpt
from finetune import writes
from finetune.checkpoint import TrainingError


@pytest.fixture
def small_disk(tmp_path):
    """small_disk(mib) -> the mount point of a fresh tmpfs that size (root only)."""
    mounted = []

    def mount(mib: int) -> Path:
        folder = tmp_path / f"disk-{mib}m"
        folder.mkdir()
        if shutil.which("mount") is None:
            pytest.skip("no mount command")
        done = subprocess.run(
            ["mount", "-t", "tmpfs", "-o", f"size={mib}m", "tmpfs", str(folder)],
            check=False,
            capture_output=True,
            text=True,
        )
        if done.returncode != 0:
            pytest.skip(f"cannot mount a tmpfs here: {done.stderr.strip()}")
        mounted.append(folder)
        return folder

    yield mount
    for folder in mounted:
        subprocess.run(["umount", "-l", str(folder)], check=False)


# --------------------------------------------------------------------------- a full disk


@pytest.mark.parametrize("mib", [8, 16])
def test_disk_full_during_a_checkpoint(mib, small_disk):
    """A ~19 MB ZeRO-2 checkpoint on a smaller disk: at 8 MiB both ranks' writes fail, at 16 MiB
    usually only the last writer's (the other rank then loses its peer in DeepSpeed's barrier).
    This used to be an "internal" RuntimeError (iostream error / unexpected pos) naming no file,
    with a half-written .step_2.tmp folder left behind."""
    disk = small_disk(mib)
    out = disk / "run"
    proc = launch(
        ["--output_dir", str(out), "--max_train_steps", "6", "--checkpointing_steps", "2"],
        launcher=accelerate("--main_process_port", str(free_port())),
    )
    assert proc.returncode != 0
    step_2 = out / "checkpoints" / "step_2"
    [error] = errors(out)  # one event, whichever rank the disk filled up on
    assert events(out)[-1] == error and set(error) == {"event", "time", "kind", "message", "file", "step"}
    assert error == {**error, "kind": "TrainingError", "file": str(step_2), "step": 2}
    assert error["message"].startswith(f"disk full while saving {step_2}: ")
    assert error["message"].endswith(f" free on {disk}")
    assert "disk full while saving" in proc.stderr and "internal error" not in proc.stderr
    assert not list((out / "checkpoints").iterdir())  # the half-written folder is gone


def test_disk_full_during_the_final_save(small_disk):
    disk = small_disk(4)  # metrics.jsonl fits, the ~8 MB final model does not
    out = disk / "run"
    proc = launch(
        ["--output_dir", str(out), "--max_train_steps", "2"],
        launcher=accelerate("--main_process_port", str(free_port())),
    )
    assert proc.returncode != 0
    assert [e["event"] for e in events(out)][-2:] == ["eval", "error"]  # no `done`
    [error] = errors(out)
    assert error == {**error, "kind": "TrainingError", "file": str(out / "final")}
    assert error["message"].startswith(f"disk full while saving {out / 'final'}: ")
    assert "internal error" not in proc.stderr
    assert sorted(p.name for p in out.iterdir()) == ["metrics.jsonl"]  # no final/, no .final.tmp


def test_disk_full_is_told_apart_from_other_write_errors(tmp_path):
    assert ckpt.is_disk_full(OSError(errno.ENOSPC, "No space left on device"), tmp_path)
    assert ckpt.is_disk_full(
        RuntimeError("Error while serializing: IoError(Os { code: 28, kind: StorageFull })"), tmp_path
    )
    assert not ckpt.is_disk_full(PermissionError(errno.EACCES, "Permission denied"), tmp_path)
    if ckpt.free_space(tmp_path)[0] > writes.LOW_SPACE:  # torch's C++ errors say nothing: only a full disk counts
        try:
            try:
                raise RuntimeError("basic_ios::clear: iostream error")
            except RuntimeError:
                raise RuntimeError("[enforce fail at inline_container.cc:672] . unexpected pos 6208 vs 6100") from None
        except RuntimeError as err:
            assert not ckpt.is_disk_full(err, tmp_path)


def test_a_save_that_fails_on_two_ranks_records_one_event(tmp_path):
    """Without mounting anything: the OSError a full disk raises, inside `saving` as two ranks see it
    (each removes the half-written folder; the second one sees the first one's event)."""
    out, target = tmp_path / "run", tmp_path / "run" / "checkpoints" / "step_3"
    tmp = target.with_name(".step_3.tmp")
    failures = []
    for rank in (0, 1):
        tmp.mkdir(parents=True, exist_ok=True)
        full = pytest.raises(TrainingError, match=f"^disk full while saving {target}: .* free on /")
        with full as info, ckpt.saving(target, out, tmp=tmp, step=3):
            (tmp / f"shard_{rank}").write_bytes(b"x" * 100)
            raise OSError(errno.ENOSPC, "No space left on device")
        assert info.value.recorded and info.value.file == str(target) and not tmp.exists()
        failures.append(info.value)
    # a rank whose part of the save broke because another one's failed (e.g. its peer disconnected)
    other = pytest.raises(TrainingError, match=r"failed on another process \(Connection closed by peer\)")
    with other as info, ckpt.saving(target, out, tmp=tmp, step=3):
        raise RuntimeError("Connection closed by peer")
    assert info.value.recorded
    [error] = events(out)

    from finetune.cli import error_event
    from finetune.config import parse_args

    assert {k: v for k, v in error.items() if k not in ("event", "time")} == error_event(failures[0], parse_args(FAST))
    assert error["message"].startswith("disk full") and error["step"] == 3
    # a failure that is not a full disk, with nothing recorded by another rank, stays what it was
    with pytest.raises(KeyError), ckpt.saving(out / "final", out):
        raise KeyError("bug")


# --------------------------------------------------------------------------- the launcher dies


def run_processes(out: Path) -> list[psutil.Process]:
    """The live processes of the run writing to ``out`` (launcher, agent, ranks: all name it)."""
    found = []
    for proc in psutil.process_iter(["cmdline", "status"]):
        if str(out) in " ".join(proc.info["cmdline"] or []) and proc.info["status"] != psutil.STATUS_ZOMBIE:
            found.append(proc)
    return found


@pytest.mark.parametrize("agent", ["in the launcher", "a middle process"])
def test_ranks_end_when_the_launcher_is_killed(agent, tiny_path, tmp_path):
    """torch elastic starts each rank in its own session: a SIGKILL of `accelerate launch` used to
    leave both ranks training to the end (and with torchrun as a middle process, that one too)."""
    out = tmp_path / "run"
    if agent == "in the launcher":  # the real tree: accelerate launch (elastic agent) -> 2 ranks
        launcher, expected = accelerate("--main_process_port", str(free_port())), 3
    else:  # accelerate launch -> torchrun (the agent) -> 2 ranks: PDEATHSIG alone misses the top one dying
        config = tmp_path / "one_process.yaml"
        config.write_text(
            "compute_environment: LOCAL_MACHINE\ndistributed_type: 'NO'\nnum_processes: 1\n"
            "num_machines: 1\nmixed_precision: 'no'\nuse_cpu: true\n"
        )
        launcher = [
            sys.executable,
            "-m",
            "accelerate.commands.launch",
            "--config_file",
            str(config),
            "-m",
            "torch.distributed.run",
            "--nproc_per_node",
            "2",
            "--master_port",
            str(free_port()),
        ]
        expected = 4
    cmd = [*launcher, "-m", "finetune", *FAST, "--output_dir", str(out), "--max_train_steps", "5000"]
    with open(tmp_path / "log.txt", "w") as log:
        proc = subprocess.Popen(cmd, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + 180
        while not (out / "metrics.jsonl").is_file() or not any(e["event"] == "log" for e in events(out)):
            assert proc.poll() is None and time.monotonic() < deadline, (tmp_path / "log.txt").read_text()[-3000:]
            time.sleep(0.2)
        assert len(run_processes(out)) == expected
        proc.kill()
        proc.wait()
        killed = time.monotonic()
        while run_processes(out) and time.monotonic() < killed + 30:
            time.sleep(0.2)
        left = [p.info["cmdline"][:4] for p in run_processes(out)]
        assert not left, left
        ev = [e["event"] for e in events(out)]
        assert "done" not in ev and ev[-2:] == ["checkpoint", "stopped"], ev[-3:]  # SIGTERM: checkpoint, stop
    finally:
        for leftover in run_processes(out):  # never leave a run training on the shared CPU
            leftover.kill()
