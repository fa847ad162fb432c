"""finetune.data through the CLI entry point and load_raw/tokenize: bad data fails early and clearly."""

import json
import logging
import os
from pathlib import Path
from unittest.mock import ANY

import pandas as pd
import pytest
from datasets import Dataset, DatasetDict

from chat.layout import SAMPLE_DIR
from chat.prompt import build_source, format_context, join_source
from finetune.cli import main
from finetune.config import parse_args
from finetune.data import DataError, load_raw, tokenize

SAMPLE = SAMPLE_DIR
PREFIX = "chatbot: "
GOOD = [
    {"texts": "context: happy  <s> i got the job!", "labels": "congrats!"},
    {"texts": "hello there. </s> <s> hi! how are you?", "labels": "i am fine."},
]


@pytest.fixture(autouse=True)
def _datasets_cache(tmp_path, monkeypatch, tiny_path):
    """Keep datasets' Arrow cache out of the home directory (and build the tiny preset up front)."""
    import datasets.config

    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", tmp_path / "hf-datasets-cache")


def write(path: Path, rows=None, raw=None) -> Path:
    """Write rows as .jsonl/.json, .csv or .parquet (or raw text/bytes as is)."""
    if raw is not None:
        path.write_bytes(raw) if isinstance(raw, bytes) else path.write_text(raw)
    elif path.suffix in (".jsonl", ".json"):
        path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    elif path.suffix == ".csv":
        pd.DataFrame(rows).to_csv(path, index=False)
    elif path.suffix == ".parquet":
        pd.DataFrame(rows).to_parquet(path)
    else:
        raise AssertionError(path)
    return path


def run_main(caplog, train, val, out, *extra, model="tiny"):
    """The real CLI entry point; returns (exit code, the finetune error records)."""
    caplog.clear()
    with caplog.at_level(logging.INFO):
        rc = main(
            [
                "--model_name_or_path",
                model,
                "--train_file",
                str(train),
                "--validation_file",
                str(val),
                "--output_dir",
                str(out),
                *extra,
            ]
        )
    errors = [r for r in caplog.records if r.name.startswith("finetune") and r.levelno >= logging.ERROR]
    return rc, errors


def error_event(out: Path, kind: str, message: str, file) -> dict:
    """The one thing a run that failed before training leaves in its output dir: its error event
    (after the ``phase`` events of setup)."""
    assert sorted(p.name for p in out.iterdir()) == ["metrics.jsonl"]
    lines = [row for row in (out / "metrics.jsonl").read_text().splitlines() if '"event": "phase"' not in row]
    assert len(lines) == 1, lines
    event = json.loads(lines[0])
    assert event == {"event": "error", "time": ANY, "kind": kind, "message": message, "file": file}
    assert isinstance(event["time"], float)
    return event


def assert_fails_before_training(caplog, tmp_path, train, val, *needles, bad=None, precreate_out=False):
    """main() fails with one clear log line and one DataError event naming ``bad`` (default: train)."""
    out = tmp_path / "out"
    if precreate_out:
        out.mkdir()
    rc, errors = run_main(caplog, train, val, out)
    assert rc == 1
    assert len(errors) == 1, [r.getMessage() for r in errors]
    message = errors[0].getMessage()
    assert errors[0].exc_info is None and "Traceback" not in caplog.text
    for needle in needles:
        assert needle in message, f"{needle!r} not in {message!r}"
    error_event(out, "DataError", message, str(bad or train))
    return message


# --------------------------------------------------------------------------- bad files, every format

NUMBER_LABEL = {  # where a non-string label shows up, per format (csv/parquet columns have one type)
    ".jsonl": ([GOOD[0], {"texts": "a b", "labels": 3}], "row 2"),
    ".csv": ([{"texts": "a", "labels": 1}, {"texts": "b", "labels": 2}], "row 1"),
    ".parquet": ([{"texts": "a", "labels": 1}, {"texts": "b", "labels": 2}], "row 1"),
}


def bad_cases():
    for ext in (".jsonl", ".csv", ".parquet"):
        yield pytest.param(
            ext,
            [{"texts": "a b"}],
            ["expected columns 'texts' and 'labels'", "found texts"],
            id=f"{ext}-missing-column",
        )
        yield pytest.param(
            ext,
            [{"text": "a", "label": "b"}],
            ["expected columns 'texts' and 'labels'", "found label, text"],
            id=f"{ext}-misnamed-columns",
        )
        rows, row = NUMBER_LABEL[ext]
        yield pytest.param(ext, rows, [row, "'labels' must be text"], id=f"{ext}-number-label")
        yield pytest.param(
            ext, [*GOOD, {"texts": "x", "labels": None}], ["row 3", "'labels' is empty"], id=f"{ext}-null-label"
        )
        yield pytest.param(
            ext, [GOOD[0], {"texts": None, "labels": "y"}], ["row 2", "'texts' is empty"], id=f"{ext}-null-text"
        )
        yield pytest.param(
            ext, [GOOD[0], {"texts": "x", "labels": "   "}], ["row 2", "'labels' is empty"], id=f"{ext}-blank-label"
        )


@pytest.mark.parametrize("ext, rows, needles", list(bad_cases()))
def test_bad_rows_fail_naming_file_row_and_problem(ext, rows, needles, tmp_path, caplog):
    train = write(tmp_path / f"train{ext}", rows)
    val = write(tmp_path / "val.jsonl", GOOD)
    assert_fails_before_training(caplog, tmp_path, train, val, str(train), *needles)


EMPTY = {
    "jsonl-empty": ("train.jsonl", ""),
    "jsonl-blank-lines": ("train.jsonl", "\n  \n\n"),
    "json-empty": ("train.json", ""),
    "csv-empty": ("train.csv", ""),
    "csv-header-only": ("train.csv", "texts,labels\n"),
}


@pytest.mark.parametrize("name, raw", EMPTY.values(), ids=EMPTY.keys())
def test_empty_file_fails(name, raw, tmp_path, caplog):
    train = write(tmp_path / name, raw=raw)
    assert_fails_before_training(caplog, tmp_path, train, write(tmp_path / "v.jsonl", GOOD), str(train), "no rows")


def test_empty_parquet_fails(tmp_path, caplog):
    train = tmp_path / "train.parquet"
    pd.DataFrame({"texts": pd.Series([], dtype=str), "labels": pd.Series([], dtype=str)}).to_parquet(train)
    assert_fails_before_training(caplog, tmp_path, train, write(tmp_path / "v.jsonl", GOOD), str(train), "no rows")


def test_empty_validation_split_names_the_validation_file(tmp_path, caplog):
    train = write(tmp_path / "train.jsonl", GOOD)
    val = write(tmp_path / "val.csv", raw="texts,labels\n")
    message = assert_fails_before_training(
        caplog, tmp_path, train, val, str(val), "no rows", bad=val, precreate_out=True
    )
    assert str(train) not in message


@pytest.mark.parametrize(
    "raw, needles",
    [
        ('{"texts": "a", "labels": "b"}\n{"texts": "a", labels: "b"}\n', ["row 2", "not valid JSON"]),
        (
            '{"texts": "a", "labels": "b"}\n{"texts": "a", "labels": "b"}\n{"texts": "a", "lab',
            ["row 3", "not valid JSON"],
        ),
        ('{"texts": "a", "labels": "b"}\n["a", "b"]\n', ["row 2", "expected a JSON object"]),
        (b"\xff\xfe\x00garbage\x00\n", ["row 1", "not valid JSON"]),
    ],
    ids=["unquoted-key", "truncated-last-line", "array-line", "binary"],
)
def test_invalid_json_line(raw, needles, tmp_path, caplog):
    train = write(tmp_path / "train.jsonl", raw=raw)
    assert_fails_before_training(caplog, tmp_path, train, write(tmp_path / "v.jsonl", GOOD), str(train), *needles)


def test_corrupt_parquet(tmp_path, caplog):
    train = write(tmp_path / "train.parquet", raw=b"this is not parquet at all")
    assert_fails_before_training(
        caplog, tmp_path, train, write(tmp_path / "v.jsonl", GOOD), str(train), "cannot read the file"
    )


def test_missing_file(tmp_path, caplog):
    val = tmp_path / "nope" / "validation.jsonl"
    assert_fails_before_training(
        caplog, tmp_path, write(tmp_path / "t.jsonl", GOOD), val, str(val), "no such file", bad=val
    )


def test_directory_instead_of_file(tmp_path, caplog):
    train = tmp_path / "train.jsonl"
    train.mkdir()
    assert_fails_before_training(caplog, tmp_path, train, write(tmp_path / "v.jsonl", GOOD), str(train))


@pytest.mark.skipif(not hasattr(os, "geteuid") or os.geteuid() == 0, reason="root can read any file")
def test_unreadable_file(tmp_path, caplog):
    train = write(tmp_path / "train.jsonl", GOOD)
    train.chmod(0)
    try:
        assert_fails_before_training(caplog, tmp_path, train, write(tmp_path / "v.jsonl", GOOD), str(train))
    finally:
        train.chmod(0o644)


@pytest.mark.parametrize("name", ["train.txt", "train.tsv", "train.jsonl.gz", "train"])
def test_unsupported_extension(name, tmp_path, caplog):
    train = write(tmp_path / name, raw="texts\tlabels\na\tb\n")
    assert_fails_before_training(
        caplog, tmp_path, train, write(tmp_path / "v.jsonl", GOOD), str(train), "unsupported file type"
    )


# --------------------------------------------------------------------------- good files


def cfg_for(train, val, *extra):
    return parse_args(
        ["--model_name_or_path", "tiny", "--train_file", str(train), "--validation_file", str(val), *extra]
    )


@pytest.mark.parametrize("ext", [".jsonl", ".csv", ".parquet"])
def test_flat_files_load_with_exactly_texts_and_labels(ext, tmp_path):
    rows = [{**r, "extra": i} for i, r in enumerate(GOOD)]
    raw = load_raw(cfg_for(write(tmp_path / f"t{ext}", rows), write(tmp_path / f"v{ext}", rows)))
    for split in ("train", "validation"):
        assert raw[split].column_names == ["texts", "labels"]
        assert raw[split]["texts"] == [r["texts"] for r in GOOD]
        assert raw[split]["labels"] == [r["labels"] for r in GOOD]


STRUCTURED = [
    {
        "kind": "persona",
        "context": "i am a chef.\ni love jazz.",
        "turns": ["hi!", "hello.", "what do you do?"],
        "response": "  i cook for a living. ",
    },
    {"kind": "emotion", "context": "happy", "turns": ["i got the job <s> today!"], "response": "congrats!"},
    {"kind": "task", "context": "booking flight", "turns": ["i need a flight."], "response": "where to?"},
    {"kind": "topic", "context": "jazz", "turns": ["tell me about jazz"], "response": "it is from new orleans."},
    {"kind": "none", "context": None, "turns": ["hi", "hey", "how are you?"], "response": "good, you?"},
]


@pytest.mark.parametrize("ext", [".jsonl", ".parquet"])
def test_structured_rows_go_through_build_source(ext, tmp_path):
    raw = load_raw(cfg_for(write(tmp_path / f"t{ext}", STRUCTURED), write(tmp_path / "v.jsonl", STRUCTURED[:2])))
    assert raw["train"].column_names == ["texts", "labels"]
    assert raw["train"]["texts"] == [build_source(r["kind"], r["context"], r["turns"]) for r in STRUCTURED]
    assert raw["train"]["texts"][0] == (
        "your persona: i am a chef. i love jazz. </s>  <s> hi! </s> <s> hello. </s> <s> what do you do?"
    )
    assert raw["train"]["texts"][1] == "context: happy  <s> i got the job today!"
    assert raw["train"]["labels"] == [r["response"].strip() for r in STRUCTURED]
    assert len(raw["validation"]) == 2


@pytest.mark.parametrize(
    "bad, needles",
    [
        ({"kind": "chat"}, ["row 2", "unknown kind 'chat'"]),
        ({"context": ""}, ["row 2", "needs a non-empty context"]),
        ({"turns": ["hi", " <s> "]}, ["row 2", "turn 2 is empty"]),
        ({"turns": []}, ["row 2", "turns"]),
        ({"response": ""}, ["row 2", "'response'"]),
    ],
)
def test_bad_structured_row_is_named(bad, needles, tmp_path, caplog):
    train = write(tmp_path / "train.jsonl", [STRUCTURED[1], {**STRUCTURED[0], **bad}, STRUCTURED[2]])
    assert_fails_before_training(caplog, tmp_path, train, write(tmp_path / "v.jsonl", GOOD), str(train), *needles)


def test_structured_csv_turns_must_be_a_list(tmp_path, caplog):
    train = write(tmp_path / "train.csv", STRUCTURED[:1])  # a csv cell holds the list as text
    assert_fails_before_training(
        caplog, tmp_path, train, write(tmp_path / "v.jsonl", GOOD), str(train), "row 1", "'turns' must be a list"
    )


# --------------------------------------------------------------------------- the shipped sample, n_train / n_val


def kind_of(texts: str) -> str:
    for prefix, kind in (
        ("your persona: ", "persona"),
        ("context: ", "emotion"),
        ("domain: ", "task"),
        ("topic: ", "topic"),
    ):
        if texts.startswith(prefix):
            return kind
    assert "  <s> " not in texts
    return "none"


def test_sample_dataset():
    raw = load_raw(parse_args(["--model_name_or_path", "tiny", "--dataset_name", "sample"]))
    assert len(raw["train"]) >= 1000 and len(raw["validation"]) >= 100
    for split in ("train", "validation"):
        assert raw[split].column_names == ["texts", "labels"]
        assert {kind_of(t) for t in raw[split]["texts"]} == {"persona", "emotion", "task", "topic", "none"}
    rows = {split: set(zip(raw[split]["texts"], raw[split]["labels"])) for split in ("train", "validation")}
    assert not rows["train"] & rows["validation"]  # the README promises no validation row is in train


def first_rows(path: Path, n: int) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()[:n]]


def test_n_train_n_val_take_the_first_rows_in_order():
    raw = load_raw(
        parse_args(["--model_name_or_path", "tiny", "--dataset_name", "sample", "--n_train", "7", "--n_val", "3"])
    )
    for split, n in (("train", 7), ("validation", 3)):
        expected = first_rows(SAMPLE / f"{split}.jsonl", n)
        assert raw[split]["texts"] == [r["texts"] for r in expected]
        assert raw[split]["labels"] == [r["labels"] for r in expected]


def test_n_train_larger_than_the_file_keeps_all_rows(tmp_path):
    rows = [{"texts": f"row {i}", "labels": f"label {i}"} for i in range(5)]
    raw = load_raw(
        cfg_for(write(tmp_path / "t.jsonl", rows), write(tmp_path / "v.jsonl", rows), "--n_train", "50", "--n_val", "2")
    )
    assert raw["train"]["texts"] == [r["texts"] for r in rows]
    assert raw["validation"]["texts"] == ["row 0", "row 1"]


def test_n_train_cuts_before_validation(tmp_path, caplog):
    """A bad row after the first N is never looked at (the seed cut first), one inside is."""
    rows = [*GOOD, {"texts": "x", "labels": None}]
    train, val = write(tmp_path / "t.jsonl", rows), write(tmp_path / "v.jsonl", GOOD)
    assert len(load_raw(cfg_for(train, val, "--n_train", "2"))["train"]) == 2
    with pytest.raises(DataError, match="row 3"):
        load_raw(cfg_for(train, val, "--n_train", "3"))


# --------------------------------------------------------------------------- tokenization


def sample_cfg(*extra):
    return parse_args(
        ["--model_name_or_path", "tiny", "--dataset_name", "sample", "--n_train", "32", "--n_val", "16", *extra]
    )


def test_pad_to_max_length_pads_labels_with_minus_100(tiny_tokenizer):
    cfg = sample_cfg(
        "--pad_to_max_length", "--max_source_length", "64", "--max_target_length", "24", "--val_max_target_length", "32"
    )
    raw = load_raw(cfg)
    data = tokenize(raw, tiny_tokenizer, cfg)
    pad = tiny_tokenizer.pad_token_id
    for split, max_target in (("train", 24), ("validation", 32)):
        assert set(data[split].column_names) == {"input_ids", "attention_mask", "labels"}
        padded_somewhere = False
        for row, label in zip(data[split], raw[split]["labels"]):
            assert len(row["input_ids"]) == 64 and len(row["attention_mask"]) == 64
            assert len(row["labels"]) == max_target
            real = tiny_tokenizer(text_target=label, max_length=max_target, truncation=True).input_ids
            assert row["labels"] == real + [-100] * (max_target - len(real))
            assert pad not in row["labels"]
            n = sum(row["attention_mask"])
            assert row["input_ids"][n:] == [pad] * (64 - n) and pad not in row["input_ids"][:n]
            assert row["input_ids"][n - 1] == tiny_tokenizer.eos_token_id
            padded_somewhere |= n < 64
        assert padded_somewhere


def test_dynamic_padding_by_default(tiny_tokenizer):
    cfg = sample_cfg("--max_target_length", "64", "--val_max_target_length", "8", "--val_min_target_length", "1")
    assert cfg.pad_to_max_length is False
    raw = load_raw(cfg)
    data = tokenize(raw, tiny_tokenizer, cfg)
    train = data["train"]
    assert len({len(ids) for ids in train["input_ids"]}) > 1
    assert len({len(ids) for ids in train["labels"]}) > 1
    for row, texts, label in zip(train, raw["train"]["texts"], raw["train"]["labels"]):
        assert -100 not in row["labels"] and tiny_tokenizer.pad_token_id not in row["input_ids"]
        assert row["attention_mask"] == [1] * len(row["input_ids"])
        assert row["labels"] == tiny_tokenizer(text_target=label).input_ids
        full = tiny_tokenizer(PREFIX + texts).input_ids
        if len(full) <= cfg.max_source_length:
            assert row["input_ids"] == full  # the prefix is applied, nothing else changes
    val_lengths = [len(ids) for ids in data["validation"]["labels"]]
    assert max(val_lengths) == 8  # val_max_target_length applies to validation labels
    assert all(ids[-1] == tiny_tokenizer.eos_token_id for ids in data["validation"]["labels"])


def test_long_dialogue_keeps_context_and_newest_turn(tiny_tokenizer):
    context_text = format_context("persona", "i am a dad. i love jazz.")
    turns = [f"turn {i}: i like to walk my dog in the park every morning" for i in range(10)] + ["what about you?"]
    long_source = join_source(context_text, turns)
    max_src = 48
    assert len(tiny_tokenizer(PREFIX + long_source).input_ids) > max_src
    one = Dataset.from_dict({"texts": [long_source, "hi there"], "labels": ["i play the piano.", "hello"]})
    cfg = sample_cfg("--max_source_length", str(max_src))
    data = tokenize(DatasetDict({"train": one, "validation": one}), tiny_tokenizer, cfg)
    ids = data["train"][0]["input_ids"]
    assert len(ids) <= max_src
    # The result is exactly the prefix, the context and the newest turns (the oldest are gone).
    kept = next(
        k for k in range(len(turns)) if ids == tiny_tokenizer(PREFIX + join_source(context_text, turns[k:])).input_ids
    )
    assert 0 < kept < len(turns) - 1
    assert len(tiny_tokenizer(PREFIX + join_source(context_text, turns[kept - 1 :])).input_ids) > max_src
    text = tiny_tokenizer.decode(ids)
    assert text.strip().startswith(PREFIX + context_text + "  <s> ")
    assert text.endswith("what about you?</s>")
    assert "turn 0:" not in text
    assert data["train"][1]["input_ids"] == tiny_tokenizer(PREFIX + "hi there").input_ids


# --------------------------------------------------------------------------- bad model id


def test_unknown_model_fails_with_a_clear_message(tmp_path, caplog, capsys):
    out = tmp_path / "out"
    train, val = write(tmp_path / "t.jsonl", GOOD), write(tmp_path / "v.jsonl", GOOD)
    rc, errors = run_main(caplog, train, val, out, model="nobody/does-not-exist")
    assert rc != 0
    assert len(errors) == 1 and errors[0].exc_info is None
    message = errors[0].getMessage()
    assert "nobody/does-not-exist" in message
    assert "offline" in message.lower() or "HF_HUB_OFFLINE" in message
    assert "tiny" in message  # says what to do instead
    assert "Traceback" not in caplog.text and "Traceback" not in capsys.readouterr().err
    error_event(out, "ModelLoadError", message, None)  # a Hub id: no file


def test_unloadable_hub_dataset_is_a_data_error_without_a_file(tmp_path, caplog):
    out = tmp_path / "out"
    caplog.clear()
    with caplog.at_level(logging.INFO):
        rc = main(
            ["--model_name_or_path", "tiny", "--dataset_name", "nobody/no-such-dataset", "--output_dir", str(out)]
        )
    assert rc == 1
    errors = [r for r in caplog.records if r.name.startswith("finetune") and r.levelno >= logging.ERROR]
    assert len(errors) == 1 and "nobody/no-such-dataset" in errors[0].getMessage()
    error_event(out, "DataError", errors[0].getMessage(), None)


def test_length_grouped_sampler_orders_by_length_and_is_reproducible():
    import random

    from finetune.data import LengthGroupedSampler

    rng = random.Random(0)
    lengths = [rng.randint(5, 200) for _ in range(1003)]
    sampler = LengthGroupedSampler(
        lengths, group_size=10, seed=3, mega=5
    )  # a bigger window than the default, for the test
    first = list(sampler)
    assert sorted(first) == list(range(len(lengths)))  # every row once per epoch
    assert list(sampler) == first  # the order depends on seed and epoch only (resume relies on it)
    sampler.set_epoch(1)
    assert list(sampler) != first
    sampler.set_epoch(0)

    def padded(order):  # tokens a batch costs when padded to its longest row
        return sum(
            max(lengths[i] for i in order[s : s + 10]) * len(order[s : s + 10]) for s in range(0, len(order), 10)
        )

    shuffled = list(range(len(lengths)))
    rng.shuffle(shuffled)
    assert padded(first) < 0.75 * padded(shuffled)
    assert set(first[-3:]) != set(first[:3])  # still shuffled, not one global sort
    # Whole groups of 10 come first and the 3 left over last, so the loader's cuts into batches
    # of 10 line up with the groups: every full batch is a sorted run of one mega-batch.
    for s in range(0, 1000, 10):
        batch = [lengths[i] for i in first[s : s + 10]]
        assert batch == sorted(batch, reverse=True)
