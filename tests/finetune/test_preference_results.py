"""What a preference run reports without training one: the summary's start figures and BLEU flag,
the model card's lines, the rows' reference columns looked up by row, and the dropout switched off."""

import logging

import pytest
import torch

from finetune.config import parse_args
from finetune.hub import write_model_card
from finetune.preference import PreferenceCollator
from finetune.preference_train import Preferences, WithReference, disable_dropout


def prefs(start: dict) -> Preferences:
    from datasets import Dataset

    rows = Dataset.from_dict({"row": [0, 1, 2]})
    table = WithReference(PreferenceCollator(0), "dpo", torch.zeros(3, 2))
    return Preferences("dpo", 0.1, 0.0, rows, rows, table, table, start=start)


@pytest.mark.parametrize(("final", "flagged"), [(58.5, False), (57.9, True)])
def test_the_summary_flags_a_bleu_fallen_more_than_2_points(final, flagged, caplog, tmp_path):
    start = {"start_eval_bleu": 60.0, "start_eval_pref_accuracy": 0.03, "start_eval_pref_margin": -2.3}
    with caplog.at_level(logging.WARNING):
        summary = prefs(start).summary({"eval_bleu": final})
    assert summary == {
        "objective": "dpo",
        "preference_rows": 3,
        **start,
        "bleu_drop": pytest.approx(60.0 - final),
        "bleu_drop_flag": flagged,
    }
    assert ("BLEU fell 2.10 points below its start" in caplog.text) == flagged
    cfg = parse_args(
        ["--model_name_or_path", "tiny", "--dataset_name", "sample", "--objective", "dpo", "--beta", "0.2"]
        + ["--preference_file", "/data/prefs.jsonl", "--sft_weight", "0.5"]
    )
    results = {"eval_bleu": final, "eval_pref_accuracy": 0.45, "eval_pref_margin": -1.0, "eval_pref_rows": 118}
    write_model_card(tmp_path, cfg, {**results, **summary}, 2)
    card = (tmp_path / "README.md").read_text()
    assert "- Objective: DPO (beta 0.2, SFT weight 0.5) on 3 preference rows (`prefs.jsonl`)" in card
    assert (
        "- Held-out preferences: accuracy 0.45 (start 0.03), log-probability margin -1.00 (start -2.30) on 118 rows"
        in card
    )
    assert ("fell more than 2 points: flagged" in card) == flagged and "sacreBLEU at the start: 60.00" in card


def test_a_resumed_run_keeps_its_start_figures():
    start = {"start_eval_bleu": 61.0}
    restored = prefs({})
    restored.restored(prefs(start).state())
    assert restored.start == start and prefs({}).summary({"eval_bleu": 50.0}).get("bleu_drop_flag") is None


def test_reference_columns_are_looked_up_by_row():
    table = torch.tensor([[1.0, 2.0], [3.0, 4.0], [5.0, 6.0]])
    collate = WithReference(PreferenceCollator(0), "kto", table)
    rows = [{"row": r, "input_ids": [5, 6, 2], "labels": [7, 2], "kl_labels": [8, 2], "label": r == 2} for r in (2, 0)]
    batch = collate(rows)
    assert batch["ref_logps"].tolist() == [5.0, 1.0] and batch["ref_kl"].tolist() == [6.0, 2.0]
    assert batch["row"].tolist() == [2, 0] and batch["label"].tolist() == [True, False]


def test_dropout_is_switched_off_everywhere(tiny_path):
    from chat.model import load_model

    model = load_model(str(tiny_path)).train()
    batch = {"input_ids": torch.tensor([[5, 6, 7, 2]]), "labels": torch.tensor([[8, 9, 2]])}
    disable_dropout(model)
    assert model(**batch).logits.equal(model(**batch).logits)  # training mode, no randomness left
    assert model.config.dropout > 0  # the saved config keeps the model's own rates
