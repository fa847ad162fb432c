"""Why a write failed, in words: the file and the cause, the same for every save of the project.

Checkpoints, the final model, all_results.json, metrics.jsonl (``finetune.checkpoint``), the
feedback store and its exports (``finetune.feedback``), uploads copied into the data root and a
run's folder (the app) all report a failed write as ``cannot write FILE: CAUSE``, the cause as the
operating system names it: "File too large (EFBIG)", "Read-only file system (EROFS)", "Permission
denied (EACCES)", "Disk quota exceeded (EDQUOT)". A full disk keeps its own message with the free
space (``checkpoint.saving``).

Where the cause comes from: Python's OSError carries its errno (and often the file); safetensors'
Rust errors end in "(os error N)"; torch.save's C++ writer says only "[enforce fail at
inline_container.cc:672] . unexpected pos" or "iostream error", so the cause is found afterwards:
a file that reached this process's file-size limit (RLIMIT_FSIZE, ``ulimit -f``) is EFBIG, a
nearly full disk is ENOSPC, and a probe write into the same folder names any other (a read-only
filesystem, a missing permission, a quota).
"""

from __future__ import annotations

import contextlib
import errno
import json
import os
import re
import resource
import secrets
import shutil
from pathlib import Path

DISK_FULL = (errno.ENOSPC,)  # (a quota, EDQUOT, is named as such: the disk may have room)
DISK_FULL_TEXT = ("No space left on device", "StorageFull", "os error 28")
STREAM_ERRORS = ("iostream error", "unexpected pos", "PytorchStreamWriter failed")  # torch.save, no errno
LOW_SPACE = 64 * 2**20  # less free than this after a C++ write error: the disk is full
_OS_ERROR = re.compile(r"\(os error (\d+)\)")  # how Rust (safetensors, tokenizers) prints an errno


class WriteError(OSError):
    """A write that failed, saying which file and why (``str``: "cannot write FILE: CAUSE")."""

    def __init__(self, file: str | Path, cause: str, code: int | None = None):
        super().__init__(code, f"cannot write {file}: {cause}")
        self.file, self.cause = str(file), cause

    def __str__(self) -> str:
        return self.strerror


def human_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024:
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} TiB"


def free_space(path: Path) -> tuple[int, str]:
    """(bytes free, mount point) of the filesystem ``path`` is on (or would be on)."""
    path = Path(os.path.abspath(path))
    while not path.exists():
        path = path.parent
    free = shutil.disk_usage(path).free
    while not os.path.ismount(path):
        path = path.parent
    return free, str(path)


def errno_text(code: int) -> str:
    """ "File too large (EFBIG)": the system's words for an errno, and its name."""
    return f"{os.strerror(code)} ({errno.errorcode.get(code, code)})"


def file_size_limit() -> int | None:
    """This process's file-size limit in bytes (RLIMIT_FSIZE), None when there is none."""
    soft, _ = resource.getrlimit(resource.RLIMIT_FSIZE)
    return None if soft == resource.RLIM_INFINITY else soft


def _chain(err: BaseException):
    seen = []
    while err is not None and err not in seen:  # the C++ error is often the context of another
        seen.append(err)
        yield err
        err = err.__cause__ or err.__context__


def _probe(folder: Path) -> OSError | None:
    """The error a small write into ``folder`` (or its nearest existing parent) meets, if any."""
    while not folder.is_dir() and folder != folder.parent:
        folder = folder.parent
    probe = folder / f".write-probe-{secrets.token_hex(4)}"
    try:
        with open(probe, "wb") as fh:
            fh.write(b"\0" * 4096)
            fh.flush()
            os.fsync(fh.fileno())
    except OSError as err:
        return err
    finally:
        with contextlib.suppress(OSError):
            probe.unlink()
    return None


def _over_size_limit(where: Path) -> Path | None:
    """A file under ``where`` as large as the file-size limit: the write that hit it."""
    limit = file_size_limit()
    if limit is None or not where.exists():
        return None
    files = [where] if where.is_file() else [p for p in where.rglob("*") if p.is_file() and not p.is_symlink()]
    return next((p for p in files if p.stat().st_size >= limit), None)


def is_disk_full(err: BaseException, where: Path) -> bool:
    """Is ``err`` (or an exception it came from) a full disk, for a write into ``where``?"""
    for e in _chain(err):
        if isinstance(e, OSError) and e.errno in DISK_FULL:
            return True
        text = str(e)
        if any(t in text for t in DISK_FULL_TEXT):
            return True
        if any(t in text for t in STREAM_ERRORS) and free_space(where)[0] < LOW_SPACE:
            return True
    return False


def write_error(err: BaseException, where: Path) -> WriteError | None:
    """``err``, met while writing into ``where`` (a file, or a folder being filled), as a WriteError
    naming the file and the cause; None when it is no failed write (a bug stays what it is)."""
    where = Path(where)
    for e in _chain(err):
        if isinstance(e, WriteError):
            return e
        if isinstance(e, OSError) and e.errno:
            return _named(e.errno, e.filename or where, where)
        found = _OS_ERROR.search(str(e))
        if found:
            return _named(int(found.group(1)), where, where)
    if not any(t in str(e) for e in _chain(err) for t in STREAM_ERRORS):
        return None
    return diagnose(where, (str(err).strip().splitlines() or [type(err).__name__])[0])  # torch's C++ writer


def diagnose(where: Path, detail: str) -> WriteError:
    """A failed write into ``where`` whose error named no cause (torch's C++ writer, SQLite): the
    cause found afterwards (a file at the file-size limit, a nearly full disk, what a probe write
    meets), else ``detail``, the error's own words."""
    hit = _over_size_limit(where)
    if hit is not None:
        return _named(errno.EFBIG, hit, where)
    if free_space(where)[0] < LOW_SPACE:
        return _named(errno.ENOSPC, where, where)
    probed = _probe(where if where.is_dir() else where.parent)
    if probed is not None and probed.errno:
        return _named(probed.errno, where, where)
    return WriteError(where, f"the write failed and the system gave no reason ({detail})")


def replace_text(path: Path, text: str) -> None:
    """Write ``path`` in one rename (a reader never sees half of it); a WriteError if it fails."""
    tmp = path.with_name(f".{path.name}.{secrets.token_hex(4)}.tmp")
    try:
        with writing(path):
            tmp.write_text(text)
            os.replace(tmp, path)
    finally:
        with contextlib.suppress(OSError):
            tmp.unlink()


def write_jsonl(path: Path, records) -> Path:
    """Write ``records`` (dicts) as JSON lines in one rename, synced first: a reader sees the whole
    file or none. The OSError of a failed write is the caller's to explain (``write_error``)."""
    tmp = path.with_name(f".{path.name}.{secrets.token_hex(4)}.tmp")
    try:
        with open(tmp, "w", encoding="utf-8") as fh:
            for record in records:
                fh.write(json.dumps(record, ensure_ascii=False) + "\n")
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)
    return path


def _named(code: int, file, where: Path) -> WriteError:
    cause = errno_text(code)
    if code == errno.EFBIG:
        limit = file_size_limit()
        hit = _over_size_limit(where) if file == where else None
        file = hit or file
        if limit is not None:
            cause += f": this process may write files of at most {human_bytes(limit)} (its RLIMIT_FSIZE, ulimit -f)"
    elif code in DISK_FULL:
        free, mount = free_space(where)
        cause += f": {human_bytes(free)} free on {mount}"
    return WriteError(file, cause, code)


@contextlib.contextmanager
def writing(where: str | Path):
    """Around a write into ``where``: a failed write becomes a WriteError naming the file and the
    cause; anything else passes unchanged."""
    try:
        yield
    except Exception as err:
        failure = write_error(err, Path(where))
        if failure is None or failure is err:
            raise
        raise failure from err
