"""Training on feedback rows (issue 13): mixing a feedback file into the train split, a held-out
feedback split, BLEU per kind of dialogue, and the model card's figures. The real run is in
tests/finetune/test_train.py (slow)."""

import json
import logging
from collections import Counter
from pathlib import Path

import pytest
import sacrebleu

from chat.layout import SAMPLE_DIR
from chat.prompt import KINDS, build_source
from finetune.cli import main
from finetune.config import parse_args
from finetune.data import DataError, load_raw, mix, tokenize
from finetune.evaluate import OTHER_KIND, bleu_by_kind, scores, source_kind
from finetune.hub import write_model_card

PREFIX = "chatbot: "
# Rows as the app's feedback export writes them: structured, with extra keys the loader ignores.
FEEDBACK = [
    {"kind": "persona", "context": "i am a pilot.", "turns": ["hi! what do you do?"], "response": "i fly planes."},
    {"kind": "emotion", "context": "proud", "turns": ["i won the race!"], "response": "well done, you earned it."},
    {"kind": "none", "context": "", "turns": ["hey", "hi", "what is up?"], "response": "not much, you?"},
]
FEEDBACK = [{**row, "id": i, "rating": "correction", "model": "tiny"} for i, row in enumerate(FEEDBACK, 1)]


@pytest.fixture(autouse=True)
def _datasets_cache(tmp_path, monkeypatch, tiny_path):
    import datasets.config

    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", tmp_path / "hf-datasets-cache")


def write(path: Path, rows) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def sample_cfg(*extra):
    return parse_args(["--model_name_or_path", "tiny", "--dataset_name", "sample", "--n_train", "40", *extra])


def sources(rows) -> list[str]:
    return [build_source(r["kind"], r["context"], r["turns"]) for r in rows]


# --------------------------------------------------------------------------- mixing


@pytest.mark.parametrize("ratio", [0.1, 0.5, 0.9])
def test_feedback_rows_are_mixed_in_at_the_ratio(ratio, tmp_path):
    feedback = write(tmp_path / "fb.jsonl", FEEDBACK * 4)  # 12 rows
    raw = load_raw(sample_cfg("--feedback_file", str(feedback), "--feedback_ratio", str(ratio), "--seed", "3"))
    base = load_raw(sample_cfg())["train"]
    texts = Counter(raw["train"]["texts"])
    fb_texts = set(sources(FEEDBACK))
    fb_rows = sum(n for t, n in texts.items() if t in fb_texts)
    # every base row (n_train cuts it before mixing) and every feedback row is seen at least once
    assert set(base["texts"]) | fb_texts == set(texts)
    assert raw["train"].column_names == ["texts", "labels"] and "feedback" not in raw
    # ~ratio of the rows are feedback rows, the rest the base split seen about once
    share = fb_rows / len(raw["train"])
    assert abs(share - ratio) < 0.2, (share, len(raw["train"]))
    assert len(raw["train"]) - fb_rows >= len(base)
    # the same seed gives the same split on every process; labels stay with their sources
    again = load_raw(sample_cfg("--feedback_file", str(feedback), "--feedback_ratio", str(ratio), "--seed", "3"))
    assert again["train"]["texts"] == raw["train"]["texts"]
    pairs = set(zip(raw["train"]["texts"], raw["train"]["labels"]))
    assert {(s, r["response"]) for s, r in zip(sources(FEEDBACK), FEEDBACK)} <= pairs


def test_ratio_one_trains_on_the_feedback_rows_only(tmp_path):
    feedback = write(tmp_path / "fb.jsonl", FEEDBACK)
    raw = load_raw(sample_cfg("--feedback_file", str(feedback), "--feedback_ratio", "1"))
    assert raw["train"]["texts"] == sources(FEEDBACK)
    assert raw["train"]["labels"] == [r["response"] for r in FEEDBACK]
    assert len(raw["validation"]) == len(load_raw(sample_cfg())["validation"])


def test_flat_feedback_rows_and_a_held_out_split(tmp_path):
    flat = write(tmp_path / "fb.jsonl", [{"texts": "context: sad  <s> i lost my keys.", "labels": "oh no!"}])
    held = write(tmp_path / "held.jsonl", FEEDBACK[:2])
    cfg = sample_cfg("--feedback_file", str(flat), "--feedback_validation_file", str(held), "--n_val", "5")
    raw = load_raw(cfg)
    assert "context: sad  <s> i lost my keys." in raw["train"]["texts"]
    assert raw["feedback"]["texts"] == sources(FEEDBACK[:2]) and len(raw["validation"]) == 5


def test_tokenize_handles_the_feedback_split(tmp_path, tiny_tokenizer):
    held = write(tmp_path / "held.jsonl", FEEDBACK)
    files = ["--feedback_file", str(held), "--feedback_validation_file", str(held)]
    cfg = sample_cfg(*files, "--n_val", "4", "--max_target_length", "6", "--val_max_target_length", "64")
    data = tokenize(load_raw(cfg), tiny_tokenizer, cfg)
    assert set(data) == {"train", "validation", "feedback"} and len(data["feedback"]) == 3
    # (less the end-of-sequence token, as evaluation decodes them)
    decoded = tiny_tokenizer.batch_decode([ids[:-1] for ids in data["feedback"]["input_ids"]])
    assert [source_kind(d, PREFIX) for d in decoded] == ["persona", "emotion", "none"]
    # held-out rows are evaluated: their labels keep the evaluation's length, not the training one
    assert max(len(ids) for ids in data["feedback"]["labels"]) > 6
    assert max(len(ids) for ids in data["train"]["labels"]) <= 6


def test_an_extreme_ratio_is_refused_before_it_fills_memory():
    from datasets import Dataset

    base = Dataset.from_dict({"texts": ["a"] * 1000, "labels": ["b"] * 1000})
    with pytest.raises(DataError, match="would make an epoch of about 1,000,000,000 rows"):
        mix(base, base.select(range(1)), 1e-9, seed=0)


@pytest.mark.parametrize("which", ["--feedback_file", "--feedback_validation_file"])
def test_a_bad_feedback_file_fails_naming_it(which, tmp_path, caplog):
    good = write(tmp_path / "fb.jsonl", FEEDBACK)
    bad = write(tmp_path / "bad.jsonl", [FEEDBACK[0], {**FEEDBACK[1], "kind": "chat"}])
    files = {"--feedback_file": str(good), "--feedback_validation_file": str(good), which: str(bad)}
    out = tmp_path / "out"
    caplog.clear()
    with caplog.at_level(logging.INFO):
        rc = main(
            ["--model_name_or_path", "tiny", "--dataset_name", "sample", "--output_dir", str(out)]
            + [part for flag, path in files.items() for part in (flag, path)]
        )
    assert rc == 1
    events = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    error = events[-1]
    assert error["event"] == "error" and error["kind"] == "DataError" and error["file"] == str(bad)
    assert error["message"] == f"{bad}: row 2: unknown kind 'chat': expected one of {', '.join(KINDS)}"
    assert not (out / "checkpoints").exists()


def test_a_missing_feedback_file_is_named(tmp_path):
    with pytest.raises(DataError, match="nothing.jsonl: no such file") as err:
        load_raw(sample_cfg("--feedback_file", str(tmp_path / "nothing.jsonl")))
    assert err.value.file == str(tmp_path / "nothing.jsonl")


# --------------------------------------------------------------------------- BLEU per kind


def test_source_kind_reads_decoded_inputs():
    rows = [json.loads(line) for line in (SAMPLE_DIR / "validation.jsonl").read_text().splitlines()]
    kinds = {source_kind(f" {PREFIX}{r['texts']}", PREFIX) for r in rows}  # decoding adds a leading space
    assert kinds == set(KINDS)
    assert source_kind("topic: rain  <s> hi", "") == "topic"
    assert source_kind("chatbot: hi there </s> <s> hello", PREFIX) == "none"
    assert source_kind("chatbot: mood: odd  <s> hi", PREFIX) == OTHER_KIND  # a context no kind made


def test_bleu_by_kind_scores_each_group_alone():
    preds = ["the cat sat on the mat", "a dog ran in the park today", "hello there my friend", "nothing alike"]
    refs = ["the cat sat on the mat", "a dog ran in the park today", "hello there my friend", "quite different text"]
    kinds = ["persona", "persona", "none", "none"]
    out = bleu_by_kind(preds, refs, kinds)
    assert set(out) == {"eval_bleu_persona", "eval_rows_persona", "eval_bleu_none", "eval_rows_none"}
    assert out["eval_bleu_persona"] == pytest.approx(100.0) and out["eval_rows_persona"] == 2
    assert out["eval_bleu_none"] == pytest.approx(sacrebleu.corpus_bleu(preds[2:], [refs[2:]]).score)
    assert out["eval_bleu_none"] < 100.0 and out["eval_rows_none"] == 2
    assert bleu_by_kind([], [], []) == {}


def test_bleu_by_kind_reuses_the_whole_corpus_score_for_a_kind_with_every_row():
    preds, refs = ["the cat sat on the mat", "hello there my friend"], ["the cat sat on a mat", "hello there friend"]
    whole = sacrebleu.corpus_bleu(preds, [refs]).score
    assert bleu_by_kind(preds, refs, ["none", "none"], whole=whole) == bleu_by_kind(preds, refs, ["none", "none"])
    # a kind with only some rows is still scored on its own rows, whatever whole says
    mixed = bleu_by_kind(preds, refs, ["none", "persona"], whole=-1.0)
    assert mixed["eval_bleu_none"] == pytest.approx(sacrebleu.corpus_bleu(preds[:1], [refs[:1]]).score)
    assert mixed["eval_bleu_persona"] == pytest.approx(sacrebleu.corpus_bleu(preds[1:], [refs[1:]]).score)


def test_scores_are_the_figures_beside_bleu_and_loss():
    results = {"eval_bleu": 1.0, "eval_loss": 2.0, "eval_samples": 3, "eval_seconds": 4.0, "samples": []}
    extra = {"eval_bleu_task": 5.0, "eval_rows_task": 3, "eval_bleu_feedback": 6.0, "eval_loss_feedback": 7.0}
    assert scores({**results, **extra, "eval_rows_feedback": 2}) == {**extra, "eval_rows_feedback": 2}


# --------------------------------------------------------------------------- model card


def test_model_card_shows_bleu_by_kind_and_held_out_feedback(tmp_path):
    cfg = sample_cfg(
        "--feedback_file", "/srv/data/feedback/exports/1/train.jsonl",
        "--feedback_validation_file", "/srv/data/feedback/exports/1/heldout.jsonl",
        "--feedback_ratio", "0.25",
    )  # fmt: skip
    results = {
        "eval_bleu": 7.5,
        "eval_samples": 10,
        "train_samples": 40,
        "eval_bleu_persona": 12.345,
        "eval_rows_persona": 6,
        "eval_bleu_none": 1.0,
        "eval_rows_none": 4,
        "eval_bleu_feedback": 3.25,
        "eval_loss_feedback": 4.5,
        "eval_rows_feedback": 2,
    }
    folder = tmp_path / "final"
    folder.mkdir()
    write_model_card(folder, cfg, results, 1)
    card = (folder / "README.md").read_text()
    assert "BLEU by kind" in card and "| persona | 12.35 | 6 |" in card and "| none | 1.00 | 4 |" in card
    assert card.index("| persona |") < card.index("| none |") and "| emotion |" not in card
    assert "Held-out feedback: sacreBLEU 3.25, eval loss 4.50 on 2 rows (`heldout.jsonl`)" in card
    assert "`train.jsonl` mixed in at ratio 0.25" in card
    assert "/srv/data" not in card.split("Trained with:")[0]  # file names only, not the server's folders
    # a run without feedback or per-kind figures: neither section
    plain = tmp_path / "plain"
    plain.mkdir()
    write_model_card(plain, sample_cfg(), {"eval_bleu": 1.0}, 1)
    text = (plain / "README.md").read_text().split("Trained with:")[0]  # (the command names this test file)
    assert "BLEU by kind" not in text and "feedback" not in text.lower()
