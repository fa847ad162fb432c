"""Preference files: both row shapes, both source forms, every format, and clear errors."""

import json
import re
from types import SimpleNamespace

import pandas as pd
import pytest
from datasets import Dataset

from chat.prompt import build_source
from finetune.config import TrainConfig
from finetune.data import DataError
from finetune.preference_data import load_preferences, tokenize, validate

PAIR = {
    "kind": "persona",
    "context": "i love dogs.",
    "turns": ["hi! any pets?"],
    "chosen": "yes, two dogs!",
    "rejected": "no.",
}
RATED = {"kind": "none", "context": "", "turns": ["hello"], "response": "hi there", "label": True}


def write_jsonl(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


def test_dpo_rows_structured_and_flat_build_the_same_source(tmp_path):
    flat = {"texts": build_source("persona", "i love dogs.", ["hi! any pets?"]), "chosen": "yes", "rejected": "no"}
    train, held = load_preferences(write_jsonl(tmp_path / "p.jsonl", [PAIR, flat]), "dpo")
    assert train["texts"][0] == train["texts"][1] == "your persona: i love dogs. </s>  <s> hi! any pets?"
    assert train["chosen"] == ["yes, two dogs!", "yes"] and train["rejected"] == ["no.", "no"]
    assert len(held) == 0  # fewer than 10 rows: nothing held out


def test_every_tenth_row_is_held_out_unless_a_validation_file_is_given(tmp_path):
    rows = [{**PAIR, "chosen": f"yes {i}"} for i in range(25)]
    train, held = load_preferences(write_jsonl(tmp_path / "p.jsonl", rows), "dpo")
    assert held["chosen"] == ["yes 9", "yes 19"] and len(train) == 23
    val = write_jsonl(tmp_path / "v.jsonl", [PAIR])
    train, held = load_preferences(str(tmp_path / "p.jsonl"), "dpo", val)
    assert len(train) == 25 and held["chosen"] == ["yes, two dogs!"]


def test_kto_labels_from_csv_text_and_parquet_bools(tmp_path):
    frame = pd.DataFrame([{**RATED, "turns": None, "texts": "hello", "label": "false"}]).drop(
        columns=["kind", "context", "turns"]
    )
    frame.to_csv(tmp_path / "k.csv", index=False)
    train, _ = load_preferences(str(tmp_path / "k.csv"), "kto")
    assert train["label"] == [False] and train["response"] == ["hi there"]
    pd.DataFrame([RATED, {**RATED, "label": False}]).to_parquet(tmp_path / "k.parquet")
    train, _ = load_preferences(str(tmp_path / "k.parquet"), "kto")
    assert train["label"] == [True, False]


@pytest.mark.parametrize(
    ("row", "objective", "message"),
    [
        (PAIR, "kto", "DPO rows (chosen, rejected): use --objective dpo"),
        (RATED, "dpo", "KTO rows (response, label): use --objective kto"),
        ({**PAIR, "rejected": "yes, two dogs!"}, "dpo", "row 1: 'chosen' and 'rejected' are the same reply"),
        ({**PAIR, "chosen": "  "}, "dpo", "row 1: 'chosen' must be non-empty text"),
        ({**RATED, "label": "maybe"}, "kto", "row 1: 'label' must be true or false, got 'maybe'"),
        ({**PAIR, "turns": "hi"}, "dpo", "row 1: 'turns' must be a list of strings"),
        ({**PAIR, "kind": "persona", "context": ""}, "dpo", "row 1: kind 'persona' needs a non-empty context"),
        ({"chosen": "a", "rejected": "b"}, "dpo", "each row needs its source"),
        ({"texts": "a", "labels": "b"}, "dpo", "expected preference rows"),
    ],
)
def test_bad_rows_name_the_file_row_and_problem(tmp_path, row, objective, message):
    path = write_jsonl(tmp_path / "bad.jsonl", [row])
    with pytest.raises(DataError) as err:
        load_preferences(path, objective)
    assert message in str(err.value) and str(err.value).startswith(path)


def test_tokenize_gives_each_reply_its_labels_and_fits_long_sources(tiny_tokenizer):
    long_turns = [f"turn number {i} says something long enough" for i in range(40)]
    rows = validate(Dataset.from_list([{**PAIR, "turns": long_turns}]), "rows", "dpo")
    cfg = SimpleNamespace(source_prefix="chatbot: ", max_source_length=64, max_target_length=8)
    out = tokenize(rows, tiny_tokenizer, cfg, "dpo")
    assert set(out.column_names) == {"input_ids", "chosen_labels", "rejected_labels"}
    assert len(out["input_ids"][0]) <= 64
    # the newest turn survived the fitting (the oldest ones were dropped)
    assert "turn number 39" in tiny_tokenizer.decode(out["input_ids"][0], skip_special_tokens=True)
    assert (
        out["chosen_labels"][0] == tiny_tokenizer(text_target="yes, two dogs!", max_length=8, truncation=True).input_ids
    )
    kto = tokenize(validate(Dataset.from_list([RATED]), "rows", "kto"), tiny_tokenizer, cfg, "kto")
    assert set(kto.column_names) == {"input_ids", "labels", "label", "kl_labels"} and kto["label"] == [True]
    assert kto["kl_labels"] == [[-100]]  # one row: no other row's reply to pair it with
    two = tokenize(
        validate(Dataset.from_list([RATED, {**RATED, "response": "bye"}]), "rows", "kto"), tiny_tokenizer, cfg, "kto"
    )
    assert two["kl_labels"] == [two["labels"][1], two["labels"][0]]


@pytest.mark.parametrize(
    "changes, message",
    [
        ({"objective": "dpo"}, "--objective dpo needs --preference_file"),
        ({"objective": "orpo", "preference_file": "p.jsonl"}, "--objective must be one of sft, dpo, kto"),
        ({"preference_file": "p.jsonl"}, "--preference_file needs --objective dpo or kto"),
        ({"objective": "kto", "preference_file": "p.jsonl", "beta": 0.0}, "--beta must be > 0"),
        ({"objective": "dpo", "preference_file": "p.jsonl", "sft_weight": -1.0}, "--sft_weight must be >= 0"),
        ({"preference_validation_file": "v.jsonl"}, "--preference_validation_file needs --preference_file"),
        (
            {"objective": "dpo", "preference_file": "p.jsonl", "feedback_file": "f.jsonl"},
            "--feedback_file rows are SFT rows, not mixed into an --objective dpo run",
        ),
    ],
)
def test_the_objective_flags_are_checked(changes, message):
    with pytest.raises(ValueError, match=re.escape(message)):
        TrainConfig(**changes)
    assert TrainConfig(objective="dpo", preference_file="p.jsonl").beta == 0.1
