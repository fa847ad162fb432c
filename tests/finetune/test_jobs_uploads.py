"""finetune/jobs/uploads.py: uploaded data checked as training would check it (size first), and
an upload without a validation file split into the run folder."""

import json
import os
import shutil
import time
from pathlib import Path

import pytest
from jobs_helpers import good_rows, launcher_args, spec, write_jsonl

from finetune.config import parse_args
from finetune.data import DataError
from finetune.jobs import uploads as uploads_module
from finetune.jobs.command import build_command
from finetune.jobs.paths import write_info
from finetune.jobs.uploads import MAX_UPLOAD_BYTES, ensure_room, validate_upload, write_split


def test_validate_upload(roots):
    _, uploads = roots
    good = write_jsonl(uploads / "good.jsonl", good_rows(5))
    result = validate_upload(good)
    assert result["rows"] == 5
    assert result["preview"] == [f"chatbot: context: happy  <s> hello number {i}" for i in range(3)]
    assert validate_upload(good, source_prefix="")["preview"][0] == "context: happy  <s> hello number 0"

    structured = write_jsonl(
        uploads / "s.jsonl", [{"kind": "persona", "context": "i like tea.", "turns": ["hi"], "response": "hello!"}]
    )
    assert validate_upload(structured)["preview"][0].startswith("chatbot: your persona: i like tea.")

    bad = write_jsonl(uploads / "bad.jsonl", [*good_rows(2), {"texts": "x", "labels": "  "}])
    with pytest.raises(DataError, match=r"bad\.jsonl: row 3: column 'labels' is empty"):
        validate_upload(bad)
    with pytest.raises(DataError, match="no such file"):
        validate_upload(uploads / "missing.jsonl")
    assert MAX_UPLOAD_BYTES == 50 * 2**20


def test_upload_size_limit_is_checked_first(roots, monkeypatch):
    _, uploads = roots
    big = uploads / "big.jsonl"
    big.write_bytes(b"not json at all\n" * 100)
    monkeypatch.setattr(uploads_module, "MAX_UPLOAD_BYTES", 1000)
    with pytest.raises(DataError, match="the limit is"):
        validate_upload(big)


def test_uploaded_train_file_alone_is_split(roots, tmp_path):
    _, uploads = roots
    train = write_jsonl(uploads / "train.jsonl", good_rows(25))
    made = spec(split_train_file=str(train))
    assert made.holds_out_validation
    run_dir = tmp_path / "run"
    assert write_split(made.split_train_file, run_dir) == (23, 2)
    cfg = parse_args(launcher_args(build_command(made, run_dir)).training_script_args)
    t, v = Path(cfg.train_file), Path(cfg.validation_file)
    assert t.parent == v.parent == (run_dir / "data").resolve()
    assert [json.loads(line)["labels"] for line in v.read_text().splitlines()] == ["hi 23!", "hi 24!"]
    assert len(t.read_text().splitlines()) == 23 and train.read_text() == "".join(
        json.dumps(r) + "\n" for r in good_rows(25)
    )  # the upload itself is untouched
    with pytest.raises(DataError, match="at least 2"):
        write_split(str(write_jsonl(uploads / "one.jsonl", good_rows(1))), tmp_path / "r2")


# --------------------------------------------------------------------------- the data root's upload folders

HOUR = 3600


def upload_folder(root: Path, name: str, age_s: float, size: int = 100) -> Path:
    """An upload folder as accept_upload leaves it, last modified ``age_s`` ago."""
    folder = root / name
    folder.mkdir(parents=True)
    (folder / "train.jsonl").write_bytes(b"x" * size)
    then = time.time() - age_s
    for path in (folder / "train.jsonl", folder):
        os.utime(path, (then, then))
    return folder


def test_clean_data_root_removes_only_old_uploads_no_run_uses(roots):
    runs, data = roots
    used = upload_folder(data, "20240101-000000-aaaaaa", 72 * HOUR)
    used_by_old_run = upload_folder(data, "20240101-000000-bbbbbb", 72 * HOUR)
    unused_old = upload_folder(data, "20240101-000000-cccccc", 25 * HOUR)
    unused_young = upload_folder(data, "20240101-000000-dddddd", 23 * HOUR)
    not_an_upload = upload_folder(data, "notes", 72 * HOUR)  # not named as accept_upload names them
    made = spec(split_train_file=str(used / "train.jsonl"))
    for run_id, run_spec in (
        ("20240102-000000-000001", made.to_dict()),
        ("20240102-000000-000002", {"model": "tiny", "train_file": str(used_by_old_run / "x")}),
    ):
        (runs / run_id).mkdir(parents=True)
        write_info(runs / run_id, {"run_id": run_id, "spec": run_spec})
    assert uploads_module.referenced_uploads(data) == {used.name, used_by_old_run.name}

    assert uploads_module.clean_data_root() == [unused_old]
    assert sorted(p.name for p in data.iterdir()) == sorted(
        p.name for p in (used, used_by_old_run, unused_young, not_an_upload)
    )
    later = time.time() + 2 * HOUR
    assert uploads_module.clean_data_root(now=later) == [unused_young]

    # a run.json it cannot read: which uploads that run needs is unknown, so nothing is removed
    (runs / "20240102-000000-000003").mkdir()
    (runs / "20240102-000000-000003" / "run.json").write_text("{not json")
    shutil.rmtree(runs / "20240102-000000-000001")
    assert uploads_module.clean_data_root(now=later) == [] and used.is_dir()


def test_ensure_room_cleans_when_full_then_refuses(roots):
    runs, data = roots
    used = upload_folder(data, "20240101-000000-aaaaaa", 72 * HOUR, size=600)
    (runs / "20240102-000000-000001").mkdir(parents=True)
    write_info(runs / "20240102-000000-000001", {"spec": spec(split_train_file=str(used / "train.jsonl")).to_dict()})
    stale = upload_folder(data, "20240101-000000-bbbbbb", 2 * HOUR, size=300)  # under a day old, over an hour
    fresh = upload_folder(data, "20240101-000000-cccccc", 0.1 * HOUR, size=300)
    ensure_room(300, data, max_bytes=1500)  # fits: nothing removed
    assert stale.is_dir()
    ensure_room(100, data, max_bytes=1200)  # full: the unused upload over an hour old goes
    assert not stale.exists() and used.is_dir() and fresh.is_dir()
    with pytest.raises(ValueError, match=r"storage for uploads is full \(0 MB of 0 MB in use"):
        ensure_room(301, data, max_bytes=1200)
    assert used.is_dir() and fresh.is_dir()


SPLIT_UNDER_A_LIMIT = """
import json, resource, sys
from pathlib import Path
from finetune.jobs.uploads import write_split
train, run_dir, limit = sys.argv[1], Path(sys.argv[2]), int(sys.argv[3])
resource.setrlimit(resource.RLIMIT_FSIZE, (limit, limit))  # inherited by the splitting child
try:
    print(json.dumps({"split": write_split(train, run_dir)}))
except Exception as err:
    print(json.dumps({"kind": type(err).__name__, "error": str(err)}))
"""


def test_a_split_under_a_file_size_limit_names_the_file_and_the_limit(roots, tmp_path):
    """Issue 28: the split's write failure used to read "cannot read the file: [Errno 27] File too large"."""
    import subprocess
    import sys

    from chat.layout import ROOT

    _, uploads = roots
    train = write_jsonl(uploads / "train.jsonl", good_rows(2000))  # ~130 KB; the split's train part too
    run_dir = tmp_path / "run"
    done = subprocess.run(
        [sys.executable, "-c", SPLIT_UNDER_A_LIMIT, str(train), str(run_dir), str(16 * 1024)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
    )
    answer = json.loads(done.stdout.strip().splitlines()[-1])
    data = run_dir / "data"
    assert answer == {
        "kind": "DataError",
        "error": f"cannot write {data / '.train.jsonl.tmp'}: File too large (EFBIG): this process may write files "
        "of at most 16.0 KiB (its RLIMIT_FSIZE, ulimit -f)",
    }
    assert list(data.iterdir()) == []  # no half-written split left
