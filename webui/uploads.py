"""Gradio's upload folder, kept bounded, and the background thread that cleans it and the data root.

Anyone who can open the app can POST files to gradio's upload route (``/gradio_api/upload``): no
login (gradio's own ``auth`` would lock the public chat too), any type, each up to
``launch(max_file_size=...)``. Gradio keeps them in its upload folder (``GRADIO_TEMP_DIR``, by
default ``<tmp>/gradio``), one ``<sha256>/<name>`` folder per file, and never deletes them unless
``gr.Blocks(delete_cache=(frequency, age))`` is set; even then it removes only files this process
received (by ctime) and no empty folders, and it has no cap on the total: ten 5 MB files arrive in
half a second, faster than any age removes them. Nor does it remove the empty ``tmp*`` file that
``gr.File(type="filepath")`` leaves in the folder on every upload event (gradio 6.31,
components/file.py). ``clean_gradio_uploads`` removes every file older than MAX_AGE_S and, while
the folder holds more than MAX_BYTES, the oldest first; ``start_cleaner`` runs it every few seconds.

The Train tab copies an upload out of the folder (into the data root) as soon as it is validated,
so nothing the app needs stays there long. The folder must be gradio's alone: this app sets no
file-valued component defaults or cached examples, which gradio would keep in it for good.
"""

from __future__ import annotations

import contextlib
import logging
import os
import threading
import time
from dataclasses import dataclass
from pathlib import Path

from finetune.jobs.uploads import clean_data_root

log = logging.getLogger(__name__)

MAX_AGE_S = 30 * 60  # an upload waits in the queue for its check at most minutes; then it is copied out
MAX_BYTES = 500 * 2**20  # 10 uploads at the 50 MB limit
EMPTY_DIR_AGE_S = 60  # a fresh empty <sha256> folder may be about to receive its file
CLEAN_EVERY_S = 10.0  # at ~100 MB/s of uploads, the folder overshoots MAX_BYTES by ~1 GB at most


@dataclass
class Cleaned:
    removed: int = 0  # files
    freed: int = 0  # bytes
    left: int = 0  # bytes still in the folder


def upload_folder() -> Path:
    from gradio.utils import get_upload_folder

    return Path(get_upload_folder())


def clean_gradio_uploads(
    folder: Path | None = None, max_age_s: float = MAX_AGE_S, max_bytes: int = MAX_BYTES, now: float | None = None
) -> Cleaned:
    """Remove the files in gradio's upload folder (or ``folder``) last modified over ``max_age_s``
    ago, then the oldest while the rest holds over ``max_bytes``; then empty folders. Symlinks are
    removed as links, never followed."""
    root = Path(folder) if folder is not None else upload_folder()
    now = time.time() if now is None else now
    files, dirs = [], []  # (mtime, size, path), taken before anything is removed
    for dirpath, dirnames, filenames in os.walk(root):  # does not follow symlinked folders
        for names, found in ((dirnames, dirs), (filenames, files)):
            for name in names:
                path = Path(dirpath, name)
                with contextlib.suppress(OSError):  # removed meanwhile
                    stat = path.lstat()
                    found.append((stat.st_mtime, stat.st_size, path))
    files.sort()  # oldest first
    out = Cleaned(left=sum(size for _, size, _ in files))
    for mtime, size, path in files:
        if now - mtime <= max_age_s and out.left <= max_bytes:
            break  # every later file is newer still
        try:
            path.unlink(missing_ok=True)
        except OSError as err:
            log.warning("could not remove upload %s: %s", path, err)
            continue
        out.removed, out.freed, out.left = out.removed + 1, out.freed + size, out.left - size
    for mtime, _, sub in sorted(dirs, key=lambda d: len(d[2].parts), reverse=True):  # deepest first
        if now - mtime > EMPTY_DIR_AGE_S:
            with contextlib.suppress(OSError):  # refused: not empty (or a symlink), or gone
                sub.rmdir()
    if out.removed:
        log.info(
            "removed %d file(s), %.1f MB, from gradio's upload folder %s (%.1f MB left)",
            out.removed,
            out.freed / 2**20,
            root,
            out.left / 2**20,
        )
    return out


def start_cleaner(
    incoming: Path | None = None,
    data_root: Path | None = None,
    every_s: float = CLEAN_EVERY_S,
    stop: threading.Event | None = None,
) -> threading.Thread:
    """Every ``every_s`` seconds, until ``stop`` is set: clean gradio's upload folder (or
    ``incoming``) and the data root (finetune.jobs.uploads.clean_data_root), in a daemon thread.
    A failed round is logged; the next one runs anyway."""
    stop = stop or threading.Event()

    def loop():
        while True:
            try:
                clean_gradio_uploads(incoming)
                clean_data_root(data_root)
            except Exception:  # the thread must outlive any one bad round
                log.exception("cleaning the upload folders failed")
            if stop.wait(every_s):
                return

    thread = threading.Thread(target=loop, name="upload-cleaner", daemon=True)
    thread.start()
    return thread
