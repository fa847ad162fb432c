"""BLEU by kind where a user picks a model: the note under the Chat tab's model picker."""

from __future__ import annotations

import json
import shutil

import pytest

from chat.layout import DEMO_DIR
from finetune.jobs.spec import app_config
from finetune.measure import comparable, measure_of, saved_measure
from webui import chat_handlers, model_scores


def test_the_picker_note_shows_a_saved_models_bleu_by_kind_and_on_held_out_feedback(tmp_path):
    final = tmp_path / "20261201-120000-abcdef" / "final"
    final.mkdir(parents=True)
    results = {"eval_bleu": 21.0, "eval_bleu_persona": 30.04, "eval_bleu_topic": 11.0, "eval_bleu_feedback": 7.5}
    (final / "all_results.json").write_text(json.dumps({**results, "eval_rows_persona": 4}))
    note = model_scores.bleu_note(str(final))
    assert note == (
        "20261201-120000-abcdef/final: BLEU 21.0 on an unknown measure (no training_args.json). "
        "By kind: persona 30.0 · topic 11.0 · held-out chat feedback 7.5."
    )
    assert str(tmp_path) not in note  # no server path
    assert chat_handlers.model_bleu(str(final)) == 21.0


def test_no_note_without_saved_figures(tmp_path):
    (tmp_path / "all_results.json").write_text("not json")
    assert model_scores.bleu_note(str(tmp_path)) == ""
    assert model_scores.bleu_note(str(tmp_path / "missing")) == ""
    assert model_scores.bleu_note(None) == ""


def test_the_demo_models_bleu_is_measured_like_the_train_tabs_runs():
    """The demo model was scored with a minimum length of 1 and no n-gram blocking (BLEU 60.0), runs
    of the Train tab with 20 and 3 (22.8 for a better model): its recorded figure is now measured
    the way a run of the Train tab's default form measures (python -m finetune.rescore; weights kept)."""
    tab_run = app_config("tiny", dataset_name="sample").to_dict()  # the form's defaults: the sample, every row
    assert comparable(saved_measure(DEMO_DIR), measure_of(tab_run))
    results = json.loads((DEMO_DIR / "all_results.json").read_text())
    assert results["rescored"]["previous"]["eval_bleu"] == pytest.approx(60.0, abs=0.01)
    assert results["rescored"]["previous_measure"]["val_min_target_length"] == 1
    assert 15 < results["eval_bleu"] < 40 and results["eval_samples"] == 187
    note = model_scores.bleu_note(str(DEMO_DIR))
    assert note.startswith(f"demo model (tiny, bundled): BLEU {results['eval_bleu']:.1f} on 187 rows of the sample's")
    assert "beams 4, length 20-64, n-gram blocking 3 (3 from the input), repetition penalty 1.2" in note


def test_figures_measured_otherwise_are_not_compared(tmp_path):
    run = tmp_path / "run" / "final"
    shutil.copytree(DEMO_DIR, run, ignore=shutil.ignore_patterns("*.safetensors"))
    args = json.loads((run / "training_args.json").read_text())
    (run / "all_results.json").write_text(json.dumps({"eval_bleu": 7.0, "eval_samples": 8}))
    (run / "training_args.json").write_text(json.dumps({**args, "n_val": 8, "num_beams": 1}))
    assert not chat_handlers.same_measure(str(run), str(DEMO_DIR))
    note = model_scores.bleu_note(str(run), serving=str(DEMO_DIR))
    assert note.startswith("run/final: BLEU 7.0 on 8 rows of the sample's validation split; beams 1,")
    assert "Not comparable with the serving model's BLEU" in note and "measured another way (187 rows" in note
    (run / "training_args.json").write_text(json.dumps({**args, **saved_measure(DEMO_DIR)}))
    assert chat_handlers.same_measure(str(run), str(DEMO_DIR))  # the same settings: comparable
    assert "Not comparable" not in model_scores.bleu_note(str(run), serving=str(DEMO_DIR))
    assert measure_of({"dataset_name": "sample"}) is None  # a record that does not say: nothing to compare
    upload = measure_of({**args, "validation_file": "/srv/runs/r1/validation.jsonl", "dataset_name": None})
    assert upload["validation_file"] == "validation.jsonl"  # by name: no server folder in what people see
