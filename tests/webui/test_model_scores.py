"""BLEU by kind where a user picks a model: the note under the Chat tab's model picker."""

from __future__ import annotations

import json

from webui import chat_handlers


def test_the_picker_note_shows_a_saved_models_bleu_by_kind_and_on_held_out_feedback(tmp_path):
    final = tmp_path / "20261201-120000-abcdef" / "final"
    final.mkdir(parents=True)
    results = {"eval_bleu": 21.0, "eval_bleu_persona": 30.04, "eval_bleu_topic": 11.0, "eval_bleu_feedback": 7.5}
    (final / "all_results.json").write_text(json.dumps({**results, "eval_rows_persona": 4}))
    note = chat_handlers.bleu_note(str(final))
    assert note == "20261201-120000-abcdef/final: BLEU by kind: persona 30.0 · topic 11.0 · held-out chat feedback 7.5"
    assert str(tmp_path) not in note  # no server path
    assert chat_handlers.model_bleu(str(final)) == 21.0


def test_no_note_without_saved_figures(tmp_path):
    (tmp_path / "all_results.json").write_text("not json")
    assert chat_handlers.bleu_note(str(tmp_path)) == ""
    assert chat_handlers.bleu_note(str(tmp_path / "missing")) == ""
    assert chat_handlers.bleu_note(None) == ""
