"""Uploaded data files: checked as training would check them, within limits, and split when they come alone.

An upload is untrusted, and its size on disk says little: a 431-byte parquet file can hold 0.9 GB of
text. So the check runs in a child process (``finetune/jobs/upload_check.py``) that streams the file (parquet row
batches, csv blocks, json line by line), stops at the first row over a limit (MAX_UPLOAD_*, named in
the refusal with the file and the row), and has its address space and CPU time capped (CHECK_*):
whatever the file claims, the app's process only waits for the verdict, and nothing is written to
the datasets cache (the child never imports datasets). The size on disk is checked first, here.

An uploaded train file given without a validation file holds out its last 10% of rows (at least
one) as the validation split, written by the same kind of child to the run's own ``data/`` folder:
the upload is never modified, a run is self-contained, resume sees the same split, and no
validation row is also trained on. The data root (``paths.data_root()``) keeps the Train tab's
validated copies, one folder each: ``clean_data_root`` removes those no run.json names once they are
old, and ``ensure_room`` refuses a copy that would take the root over MAX_DATA_ROOT_BYTES.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import subprocess
import sys
import time
from collections.abc import Iterable
from pathlib import Path

from chat.layout import ROOT
from finetune.jobs.paths import RUN_FILE, RUN_ID_RE, allowed_roots, data_root, read_info, split_files
from finetune.jobs.upload_check import megabytes

log = logging.getLogger(__name__)

MB = 2**20
MAX_UPLOAD_BYTES = 50 * MB  # 50 MB on disk, checked before a file is parsed
MAX_UPLOAD_ROWS = 1_000_000
MAX_UPLOAD_DECODED_BYTES = 512 * MB  # of text: what training would load, whatever the file's compression
MAX_UPLOAD_CELL_BYTES = 64 * 1024  # a source is at most a few hundred tokens (~2 KB); 64 KB is generous
MAX_UPLOAD_LINE_BYTES = 16 * MAX_UPLOAD_CELL_BYTES  # a json line / csv row: two cells, JSON escapes (\uXXXX) included
MAX_JSON_DOCUMENT_BYTES = 16 * MB  # a .json array or object is parsed whole; JSON lines are read line by line
CHECK_MEMORY_BYTES = 512 * MB  # address space the checking process may add to what its imports take
CHECK_SECONDS = 120  # CPU seconds of the checking process (1M structured json rows take ~20 s)

VALIDATION_FRACTION = 0.1  # held out of an uploaded train file that comes without a validation file
MAX_DATA_ROOT_BYTES = 2 * 2**30  # all validated copies together (40 uploads at the 50 MB limit)
UPLOAD_KEEP_SECONDS = 24 * 3600  # an upload no run uses is removed after this long
UPLOAD_KEEP_WHEN_FULL_SECONDS = 3600  # ... or after this long, when the data root is full

# finetune.data's column sets (not imported in the checking process: finetune.data loads torch and datasets)
CHECK_CODE = "from finetune.jobs.upload_check import main; main()"


def _limits() -> dict:
    """The limits as the child gets them, read at call time (tests lower them)."""
    return {
        "rows": MAX_UPLOAD_ROWS,
        "text_bytes": MAX_UPLOAD_DECODED_BYTES,
        "cell_bytes": MAX_UPLOAD_CELL_BYTES,
        "line_bytes": MAX_UPLOAD_LINE_BYTES,
        "document_bytes": MAX_JSON_DOCUMENT_BYTES,
        "memory_bytes": CHECK_MEMORY_BYTES,
        "seconds": CHECK_SECONDS,
    }


# --------------------------------------------------------------------------- the app's side


def _run_check(path, name: str | None, mode: str, **request) -> dict:
    """Size-check ``path`` here, then run ``mode`` on it in a confined child: its answer, or a
    DataError with the refusal (which starts with ``name``, by default the path)."""
    from finetune.data import DataError  # lazy: finetune.data imports datasets

    file, name, limits = Path(path), name or str(path), _limits()
    try:
        size = file.stat().st_size
    except OSError:
        raise DataError(f"{name}: no such file", file=str(path)) from None
    if size > MAX_UPLOAD_BYTES:
        raise DataError(
            f"{name}: the file is {size / MB:.1f} MB; the limit is {MAX_UPLOAD_BYTES / MB:g} MB", file=str(path)
        )
    request = {"mode": mode, "path": str(file.resolve()), "name": name, "limits": limits, **request}
    env = {
        **os.environ,
        "ARROW_DEFAULT_MEMORY_POOL": "system",  # malloc: the address-space cap is what it uses
        "MALLOC_ARENA_MAX": "2",
        "OMP_NUM_THREADS": "1",
        "PYTHONIOENCODING": "utf-8",
        "PYTHONPATH": os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH")) if p),
    }
    started = time.monotonic()
    try:
        done = subprocess.run(
            [sys.executable, "-c", CHECK_CODE],
            input=json.dumps(request),
            capture_output=True,
            text=True,
            encoding="utf-8",
            env=env,
            cwd=ROOT,
            timeout=2 * limits["seconds"],
            check=False,
        )
        answer = json.loads(done.stdout.strip().splitlines()[-1]) if done.returncode == 0 else None
    except subprocess.TimeoutExpired:
        answer = {"error": f"{name}: checking the file took over {2 * limits['seconds']} s (the limit for an upload)"}
    except (IndexError, ValueError):  # no answer
        answer = None
    if not isinstance(answer, dict):  # killed: over the CPU limit, or out of memory outside Python
        log.warning("upload check of %s ended with exit code %s: %s", path, done.returncode, done.stderr[-2000:])
        answer = {
            "error": f"{name}: the check of the file was stopped (exit code {done.returncode}): reading it "
            f"needs more than {megabytes(limits['memory_bytes'])} of memory or {limits['seconds']} s "
            "(the limits for an upload)"
        }
    log.info(
        "upload check (%s) of %s: %s in %.1f s, peak memory %s",
        mode,
        path,
        answer.get("error", "valid"),
        time.monotonic() - started,
        megabytes(answer.get("peak_bytes") or 0),
    )
    if "error" in answer:
        raise DataError(answer["error"], file=str(path))
    return answer


def validate_upload(path, source_prefix: str = "chatbot: ", name: str | None = None) -> dict:
    """Check an uploaded .jsonl/.json/.csv/.parquet file as training would, within the limits.

    Returns ``{"rows": n, "preview": [...]}`` with the first 3 encoder inputs exactly as built
    for the model (``source_prefix`` + the MuDoConv source, before long dialogues are fitted);
    raises ``finetune.data.DataError`` naming the file (``name``: what the user calls it, by
    default the path), the row and the problem or limit."""
    answer = _run_check(path, name, "check")
    return {"rows": answer["rows"], "preview": [source_prefix + text for text in answer["preview"]]}


def write_split(train_file: str, run_dir: Path, name: str | None = None) -> tuple[int, int]:
    """Hold out the last VALIDATION_FRACTION of ``train_file``'s rows (at least one) into the
    run's data/ folder; returns (train rows, validation rows)."""
    train_path, val_path = split_files(run_dir)
    train_path.parent.mkdir(parents=True, exist_ok=True)
    answer = _run_check(
        train_file,
        name,
        "split",
        outputs=[str(train_path.resolve()), str(val_path.resolve())],
        fraction=VALIDATION_FRACTION,
    )
    return answer["train"], answer["validation"]


# --------------------------------------------------------------------------- the data root


def _tree_bytes(folder: Path) -> int:
    return sum(p.lstat().st_size for p in folder.rglob("*") if p.is_file() and not p.is_symlink())


def referenced_uploads(root: Path | None = None, runs_roots: Iterable[Path] | None = None) -> set[str]:
    """Names of the upload folders under ``root`` that some run's spec names (any path in its
    run.json "spec" inside ``root``). An unreadable run.json raises OSError / ValueError: a
    cleaner must not guess which uploads that run needs."""
    root = Path(root or data_root()).resolve()
    names = set()
    for runs in runs_roots if runs_roots is not None else allowed_roots():
        for run_dir in Path(runs).iterdir() if Path(runs).is_dir() else ():
            if not (RUN_ID_RE.match(run_dir.name) and (run_dir / RUN_FILE).is_file()):
                continue
            stack = [read_info(run_dir).get("spec")]
            while stack:  # every string in the spec, at any depth: old and new spec forms alike
                value = stack.pop()
                if isinstance(value, dict):
                    stack += value.values()
                elif isinstance(value, list):
                    stack += value
                elif isinstance(value, str) and Path(value).is_absolute() and Path(value).is_relative_to(root):
                    names.update(Path(value).relative_to(root).parts[:1])
    return names


def clean_data_root(
    root: Path | None = None,
    runs_roots: Iterable[Path] | None = None,
    max_age_s: float = UPLOAD_KEEP_SECONDS,
    now: float | None = None,
) -> list[Path]:
    """Remove the upload folders under ``root`` (default: the data root) that no run uses and that
    nothing in has changed for ``max_age_s``; returns them. Only folders named as accept_upload
    names them are touched; with a run.json it cannot read, it removes nothing (and logs why)."""
    root = Path(root or data_root()).resolve()
    if not root.is_dir():
        return []
    try:
        used = referenced_uploads(root, runs_roots)
    except (OSError, ValueError) as err:
        log.warning("data root not cleaned: a run.json cannot be read (%s)", err)
        return []
    now = time.time() if now is None else now
    removed = []
    for folder in sorted(root.iterdir()):
        if not RUN_ID_RE.match(folder.name) or folder.name in used or not folder.is_dir() or folder.is_symlink():
            continue
        try:
            if now - max([folder.lstat().st_mtime, *(p.lstat().st_mtime for p in folder.rglob("*"))]) > max_age_s:
                shutil.rmtree(folder)
                removed.append(folder)
        except OSError as err:  # removed meanwhile, or not ours to remove: the next round retries
            log.warning("could not remove upload %s: %s", folder, err)
    if removed:
        log.info("removed %d unused upload folder(s) from %s", len(removed), root)
    return removed


def ensure_room(
    size: int, root: Path | None = None, runs_roots: Iterable[Path] | None = None, max_bytes: int | None = None
) -> None:
    """Refuse (ValueError) to add ``size`` bytes to the data root if it would then hold over MAX_DATA_ROOT_BYTES
    even after removing the uploads no run uses that are over UPLOAD_KEEP_WHEN_FULL_SECONDS old."""
    root = Path(root or data_root())
    max_bytes = MAX_DATA_ROOT_BYTES if max_bytes is None else max_bytes
    used = _tree_bytes(root) if root.is_dir() else 0
    if used + size <= max_bytes:
        return
    clean_data_root(root, runs_roots, max_age_s=UPLOAD_KEEP_WHEN_FULL_SECONDS)
    used = _tree_bytes(root)
    if used + size > max_bytes:
        raise ValueError(
            f"the app's storage for uploads is full ({megabytes(used)} of {megabytes(max_bytes)} in use, by "
            "uploads that runs use or that are under an hour old); try again later"
        )
