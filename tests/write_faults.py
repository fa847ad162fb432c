"""Write failures made real for the tests (issue 28 item 5): a file-size limit in a child process
(RLIMIT_FSIZE) and a read-only folder, never a mock."""

from __future__ import annotations

import contextlib
import os
import resource
import shutil
import subprocess
from pathlib import Path

import pytest


def file_size_limit(fsize: int):
    """A subprocess ``preexec_fn`` that limits the child's files to ``fsize`` bytes (Python ignores
    SIGXFSZ, so a write past the limit fails with EFBIG instead of killing the child)."""

    def limit():
        resource.setrlimit(resource.RLIMIT_FSIZE, (fsize, fsize))

    return limit


@contextlib.contextmanager
def read_only(folder: Path):
    """``folder`` made read-only for real: a read-only bind mount as root (permissions do not stop
    root), else a folder without write permission; skipped where neither works. Yields the errno
    name a write there meets (EROFS or EACCES)."""
    folder.mkdir(parents=True, exist_ok=True)
    if os.geteuid() != 0:
        folder.chmod(0o555)
        try:
            yield "EACCES"
        finally:
            folder.chmod(0o755)
        return
    if shutil.which("mount") is None:
        pytest.skip("no mount command")
    for args in (["--bind", str(folder), str(folder)], ["-o", "remount,bind,ro", str(folder)]):
        done = subprocess.run(["mount", *args], capture_output=True, text=True, check=False)
        if done.returncode != 0:
            subprocess.run(["umount", "-l", str(folder)], check=False, capture_output=True)
            pytest.skip(f"cannot make a read-only bind mount here: {done.stderr.strip()}")
    try:
        yield "EROFS"
    finally:
        subprocess.run(["umount", "-l", str(folder)], check=False)
