"""Where runs and uploads live, the files of a run folder, and which local paths a run may use.

The roots are read from the environment at call time (``PERSONA_CHAT_RUNS``,
``PERSONA_CHAT_DATA``), so tests and the app can point them elsewhere without re-importing.
A model or data file given as a local path must resolve, symlinks followed, inside one of
``allowed_roots()``: the runs root (finished runs' final/ folders), the data root (validated
uploads), the shipped sample, the bundled demo model (what the chat serves offline, so it can be
retrained on chat feedback), and the root of every RunManager of this process.
"""

from __future__ import annotations

import json
import os
import re
from pathlib import Path

from chat.layout import DEMO_DIR, ROOT, SAMPLE_DIR
from finetune.writes import writing

RUNS_ROOT = Path("runs")  # PERSONA_CHAT_RUNS's default, relative to the working directory
DATA_ROOT = Path("data/uploads")  # PERSONA_CHAT_DATA's default

# The run folder (see finetune/jobs/__init__.py for what each file holds).
RUN_ID_RE = re.compile(r"^\d{8}-\d{6}-[0-9a-f]{6}$")  # launch time + random suffix: sorts by age
RUN_FILE = "run.json"
LOG_FILE = "train.log"
SPLIT_DIR = "data"

# Roots of the RunManagers created in this process: a manager may be given a root other than
# PERSONA_CHAT_RUNS, and its finished runs must still be valid base models. Only grows; read by
# allowed_roots(). The one piece of module state here.
_MANAGER_ROOTS: set[Path] = set()


def runs_root() -> Path:
    """Where the Train tab writes runs and the model picker finds finished ones (PERSONA_CHAT_RUNS)."""
    return Path(os.environ.get("PERSONA_CHAT_RUNS", RUNS_ROOT))


def data_root() -> Path:
    """Where the app keeps validated uploads (PERSONA_CHAT_DATA, read at call time); an allowed root."""
    return Path(os.environ.get("PERSONA_CHAT_DATA", DATA_ROOT)).expanduser().resolve()


def allow_root(root: Path) -> None:
    """Make ``root`` (a RunManager's runs root) an allowed root for the rest of this process."""
    _MANAGER_ROOTS.add(Path(root).expanduser().resolve())


def allowed_roots() -> list[Path]:
    """Folders a local model or data path may resolve into (read at call time)."""
    out = []
    for root in (runs_root(), data_root(), SAMPLE_DIR, DEMO_DIR, *sorted(_MANAGER_ROOTS.copy())):
        resolved = root.expanduser().resolve()
        if resolved not in out:
            out.append(resolved)
    return out


def _looks_like_path(value: str) -> bool:
    return value.startswith(("/", ".", "~")) or "\\" in value or value.count("/") > 1 or ".." in Path(value).parts


def local_path(value: str, what: str) -> Path | None:
    """``value`` as a resolved local path if it is one (else None: a Hub id or keyword).

    A value is a local path when it looks like one (absolute, ``./``, ``~``, ``..``, more than
    one ``/``) or exists relative to the working directory or the repository root (the CLI
    would load an existing ``user/name`` folder instead of the Hub repo). A local path must
    resolve inside ``allowed_roots()``; containment is checked before existence, so an
    outside path is refused the same way whether or not it exists."""
    raw = Path(value).expanduser()
    candidates = [raw] if raw.is_absolute() else [Path.cwd() / raw, ROOT / raw]
    existing = [c for c in candidates if c.exists()]
    if not existing and not _looks_like_path(value):
        return None
    path = (existing or candidates)[0].resolve()
    roots = allowed_roots()
    if not any(path.is_relative_to(root) for root in roots):
        raise ValueError(
            f"{what} {value!r} is a local path outside the allowed folders "
            f"({', '.join(str(r) for r in roots)}); upload the file or pick a finished run"
        )
    if not path.exists():
        raise ValueError(f"{what} {value!r}: no such file or folder")
    return path


def split_files(run_dir: Path) -> tuple[Path, Path]:
    """Where an uploaded train file's train / held-out validation parts go in a run folder."""
    return run_dir / SPLIT_DIR / "train.jsonl", run_dir / SPLIT_DIR / "validation.jsonl"


def read_info(run_dir: Path) -> dict:
    """run.json as a dict (OSError / ValueError when it is missing or unreadable)."""
    return json.loads((run_dir / RUN_FILE).read_text())


def write_info(run_dir: Path, info: dict) -> None:
    """Replace run.json in one rename, so a reader never sees half of it. A read-modify-write
    must hold ``process.LOCK``."""
    tmp = run_dir / f".{RUN_FILE}.tmp"
    with writing(run_dir / RUN_FILE):  # a failed write names run.json and the cause
        tmp.write_text(json.dumps(info, indent=2))
        os.replace(tmp, run_dir / RUN_FILE)
