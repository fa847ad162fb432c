"""finetune/jobs/uploads.py: uploaded data checked as training would check it (size first), and
an upload without a validation file split into the run folder."""

import json
from pathlib import Path

import pytest
from jobs_helpers import good_rows, launcher_args, spec, write_jsonl

from finetune.config import parse_args
from finetune.data import DataError
from finetune.jobs import uploads as uploads_module
from finetune.jobs.command import build_command
from finetune.jobs.uploads import MAX_UPLOAD_BYTES, validate_upload, write_split


def test_validate_upload(roots):
    _, uploads = roots
    good = write_jsonl(uploads / "good.jsonl", good_rows(5))
    result = validate_upload(good)
    assert result["rows"] == 5
    assert result["preview"] == [f"chatbot: context: happy  <s> hello number {i}" for i in range(3)]
    assert validate_upload(good, source_prefix="")["preview"][0] == "context: happy  <s> hello number 0"

    structured = write_jsonl(uploads / "s.jsonl", [{"kind": "persona", "context": "i like tea.", "turns": ["hi"],
                                                     "response": "hello!"}])
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
    assert [json.loads(l)["labels"] for l in v.read_text().splitlines()] == ["hi 23!", "hi 24!"]
    assert len(t.read_text().splitlines()) == 23 and train.read_text() == "".join(
        json.dumps(r) + "\n" for r in good_rows(25))  # the upload itself is untouched
    with pytest.raises(DataError, match="at least 2"):
        write_split(str(write_jsonl(uploads / "one.jsonl", good_rows(1))), tmp_path / "r2")
