"""A write that fails for another reason than a full disk names the file and the cause (issue 28
item 5): real runs under a real file-size limit (RLIMIT_FSIZE, set in the child process) and into a
real read-only folder (a read-only bind mount as root, a folder without write permission otherwise).
Before: "internal error: RuntimeError: [enforce fail at inline_container.cc:672] . unexpected pos",
naming no file. The app's own writes (feedback store and export, uploads, run folders) are in
tests/finetune/test_feedback.py and tests/webui/test_train_handlers.py."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from test_train import FAST, errors, events
from write_faults import file_size_limit, read_only

from chat.layout import ROOT
from finetune import writes
from finetune.jobs.status import status_of

MIB = 2**20


def run(out: Path, *args: str, fsize: int | None = None) -> subprocess.CompletedProcess:
    """``python -m finetune`` on one process (no launcher), with a file-size limit of ``fsize`` bytes."""
    return subprocess.run(
        [sys.executable, "-m", "finetune", *FAST, "--n_train", "32", "--output_dir", str(out), *args],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=600,
        check=False,
        preexec_fn=file_size_limit(fsize) if fsize is not None else None,
    )


def page_error(out: Path) -> str:
    """What the Train tab shows for the run in ``out`` (finetune.jobs.status)."""
    if not (out / "run.json").exists():
        (out / "run.json").write_text(json.dumps({"argv": [], "spec": {}}))
    return status_of(out).error or ""


def test_a_file_size_limit_during_a_checkpoint_names_the_file_and_the_limit(tiny_path, tmp_path):
    """The tiny model's weights (4.6 MiB) fit under 8 MiB, its optimizer state (9.3 MiB, torch.save's
    C++ writer: no errno) does not: the cause is found and named."""
    out = tmp_path / "run"
    proc = run(out, "--max_train_steps", "2", "--checkpointing_steps", "1", fsize=8 * MIB)
    assert proc.returncode == 1
    [error] = errors(out)
    assert events(out)[-1] == error
    target = out / "checkpoints" / "step_1"
    assert error == {**error, "kind": "TrainingError", "file": str(target), "step": 1}
    message = error["message"]
    assert message.startswith(f"saving {target} failed: cannot write {out / 'checkpoints' / '.step_1.tmp'}/")
    assert "optimizer.bin: File too large (EFBIG): this process may write files of at most 8.0 MiB" in message
    assert "inline_container" not in message and "internal error" not in proc.stderr
    assert message in proc.stderr  # the log's one line says it too
    assert "File too large (EFBIG)" in page_error(out) and "optimizer.bin" in page_error(out)
    assert not (out / "checkpoints" / ".step_1.tmp").exists() and not target.exists()  # nothing half-written


def test_a_file_size_limit_during_the_final_save(tiny_path, tmp_path):
    """safetensors' own error (Rust, "os error 27") on model.safetensors (4.6 MiB over a 4 MiB limit)."""
    out = tmp_path / "run"
    proc = run(out, "--max_train_steps", "1", fsize=4 * MIB)
    assert proc.returncode == 1
    [error] = errors(out)
    assert [e["event"] for e in events(out)][-2:] == ["eval", "error"]
    assert error == {**error, "kind": "TrainingError", "file": str(out / "final")}
    assert error["message"] == (  # (safetensors removes its file on failure: the folder is named)
        f"saving {out / 'final'} failed: cannot write {out / '.final.tmp'}: File too large (EFBIG): "
        "this process may write files of at most 4.0 MiB (its RLIMIT_FSIZE, ulimit -f)"
    )
    assert "File too large (EFBIG)" in page_error(out)
    assert not (out / "final").exists() and not (out / ".final.tmp").exists()


def test_a_read_only_checkpoints_folder_names_it_and_the_cause(tiny_path, tmp_path):
    out = tmp_path / "run"
    with read_only(out / "checkpoints") as name:
        proc = run(out, "--max_train_steps", "2", "--checkpointing_steps", "1")
    assert proc.returncode == 1
    [error] = errors(out)
    assert error == {**error, "kind": "TrainingError", "file": str(out / "checkpoints" / "step_1"), "step": 1}
    assert f"cannot write {out / 'checkpoints' / '.step_1.tmp'}: " in error["message"]
    assert f"({name})" in error["message"] and "internal error" not in proc.stderr
    assert f"({name})" in page_error(out)


# --------------------------------------------------------------------------- the cause of each kind of error

CHILD = """
import json, resource, sys
from pathlib import Path
from finetune import writes
from finetune.checkpoint import MetricsWriter
folder, limit = Path(sys.argv[1]), int(sys.argv[2])
resource.setrlimit(resource.RLIMIT_FSIZE, (limit, limit))
found = {}
for name, write in (
    ("metrics", lambda: MetricsWriter(folder, enabled=True).write("log", text="x" * 2 * limit)),
    ("results", lambda: writes.replace_text(folder / "all_results.json", "y" * 2 * limit)),
):
    try:
        write()
    except writes.WriteError as err:
        found[name] = [str(err), err.file]
print(json.dumps(found))
"""


def test_metrics_and_results_writes_name_their_file_and_the_limit(tmp_path):
    done = subprocess.run(
        [sys.executable, "-c", CHILD, str(tmp_path), str(64 * 1024)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
    )
    assert done.returncode == 0, done.stderr
    found = json.loads(done.stdout.strip().splitlines()[-1])
    limit = "File too large (EFBIG): this process may write files of at most 64.0 KiB"
    assert found["metrics"] == [f"cannot write {tmp_path / 'metrics.jsonl'}: {limit} (its RLIMIT_FSIZE, ulimit -f)",
                                str(tmp_path / "metrics.jsonl")]  # fmt: skip
    assert found["results"][0].startswith(f"cannot write {tmp_path / 'all_results.json'}: {limit}")
    assert not (tmp_path / "all_results.json").exists() and not list(tmp_path.glob(".all_results*"))


def test_torchs_silent_writer_errors_are_diagnosed_and_bugs_stay_bugs(tmp_path):
    silent = RuntimeError("[enforce fail at inline_container.cc:672] . unexpected pos 576 vs 534")
    silent.__context__ = RuntimeError("basic_ios::clear: iostream error")
    with read_only(tmp_path / "ro") as name:
        failure = writes.write_error(silent, tmp_path / "ro" / "step_1")
        assert f"({name})" in str(failure) and failure.file == str(tmp_path / "ro" / "step_1")
    found = writes.write_error(silent, tmp_path)  # a folder that takes writes: the error's own words
    assert str(found).endswith(
        "the system gave no reason ([enforce fail at inline_container.cc:672] . unexpected pos 576 vs 534)"
    )
    assert writes.write_error(KeyError("bug"), tmp_path) is None
    quota = writes.write_error(OSError(122, "Disk quota exceeded"), tmp_path / "x.bin")
    assert str(quota) == f"cannot write {tmp_path / 'x.bin'}: Disk quota exceeded (EDQUOT)"
    assert not writes.is_disk_full(OSError(122, "Disk quota exceeded"), tmp_path)  # a quota is no full disk
