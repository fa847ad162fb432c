"""Uploaded data files: checked as training would check them, and split when they come alone.

An uploaded train file given without a validation file holds out its last 10% of rows (at
least one) as the validation split. Both parts are written to the run's own ``data/`` folder
(not next to the upload), so the upload is never modified, a run is self-contained, resume
sees the same split, and no validation row is also trained on.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

from finetune.jobs.paths import split_files

MAX_UPLOAD_BYTES = 50 * 1024 * 1024  # 50 MB, checked before a file is parsed
VALIDATION_FRACTION = 0.1  # held out of an uploaded train file that comes without a validation file


def _check_size(path: Path) -> None:
    from finetune.data import DataError  # lazy: finetune.data imports datasets

    try:
        size = path.stat().st_size
    except OSError:
        raise DataError(f"{path}: no such file") from None
    if size > MAX_UPLOAD_BYTES:
        raise DataError(f"{path}: the file is {size / 2**20:.1f} MB; the limit is {MAX_UPLOAD_BYTES / 2**20:g} MB")


def _load_upload(path) -> datasets.Dataset:  # noqa: F821
    from finetune.data import _read_file, validate

    file = Path(path)
    _check_size(file)
    return validate(_read_file(str(file)), str(file))


def validate_upload(path, source_prefix: str = "chatbot: ") -> dict:
    """Check an uploaded .jsonl/.json/.csv/.parquet file as training would.

    Returns ``{"rows": n, "preview": [...]}`` with the first 3 encoder inputs exactly as built
    for the model (``source_prefix`` + the MuDoConv source, before long dialogues are fitted);
    raises ``finetune.data.DataError`` naming the file, row and problem (size checked first)."""
    ds = _load_upload(path)
    return {"rows": len(ds), "preview": [source_prefix + text for text in ds[: 3]["texts"]]}


def write_split(train_file: str, run_dir: Path) -> tuple[int, int]:
    """Hold out the last VALIDATION_FRACTION of ``train_file``'s rows (at least one) into the
    run's data/ folder; returns (train rows, validation rows)."""
    from finetune.data import DataError

    ds = _load_upload(train_file)
    n = len(ds)
    if n < 2:
        raise DataError(f"{train_file}: {n} row; at least 2 are needed to hold out a validation split "
                        "(or upload a validation file)")
    n_val = max(1, int(n * VALIDATION_FRACTION))
    train_path, val_path = split_files(run_dir)
    train_path.parent.mkdir(parents=True, exist_ok=True)
    for path, rows in ((train_path, range(n - n_val)), (val_path, range(n - n_val, n))):
        part = ds.select(rows)
        tmp = path.with_name(f".{path.name}.tmp")  # renamed into place: resume never sees half a file
        with open(tmp, "w", encoding="utf-8") as fh:
            fh.writelines(json.dumps({"texts": text, "labels": label}, ensure_ascii=False) + "\n"
                          for text, label in zip(part["texts"], part["labels"]))
        os.replace(tmp, path)
    return n - n_val, n_val
