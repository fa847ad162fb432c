"""Reviewing the chat's feedback in the Train tab (webui/review_handlers.py) and training on it
("Add accepted chat feedback" in webui/train_handlers.py): real store, real files, no browser."""

import json
import time
from pathlib import Path

import gradio as gr
import pytest

from chat.layout import DEMO_DIR
from finetune.feedback import encoder_text
from finetune.jobs.manager import RunManager
from finetune.jobs.spec import JobSpec, app_config
from webui import review_handlers, train_handlers
from webui.auth import AuthConfig

PASSWORD = "correct horse battery staple"


@pytest.fixture
def tab(tmp_path, monkeypatch):
    data = tmp_path / "data"
    monkeypatch.setenv("PERSONA_CHAT_RUNS", str(tmp_path / "runs"))
    monkeypatch.setenv("PERSONA_CHAT_DATA", str(data))
    return train_handlers.TrainTab(
        manager=RunManager(tmp_path / "runs"), auth=AuthConfig(password=PASSWORD), gpus=0, data_root=data
    )


def add(tab, n: int, rating: str = "correction", status: str = "pending") -> list[int]:
    store = tab.feedback_store()
    return [
        store.add(
            kind="persona",
            context="i love jazz.",
            turns=[f"hi {i}", "hello!", f"what do you like {i}?"],
            response=f"i love jazz {i}.",
            original=f"i i a {i}",
            rating=rating,
            model="tiny",
            visitor=f"v{i}",
            status=status,
        )
        for i in range(n)
    ]


def form(tab, **changes) -> dict:
    return {**train_handlers.default_form(tab), **changes}


# --------------------------------------------------------------------------- review


def test_visitors_see_counts_and_the_login_hint_never_rows(tab):
    add(tab, 3)
    label, counts, rows = review_handlers.refresh(tab, None, None, "pending")
    assert label["label"] == "Feedback from the chat (3 pending)"
    assert counts.startswith("3 pending · 0 accepted · 0 rejected") and "Log in" in counts
    assert rows.empty and list(rows.columns) == review_handlers.COLUMNS
    for forged in (None, "forged-token"):
        with pytest.raises(gr.Error, match="log in first"):
            review_handlers.details(tab, forged, None, 1, "chatbot: ")
        with pytest.raises(gr.Error, match="log in first"):
            review_handlers.set_status(tab, forged, None, 1, "accepted")
        with pytest.raises(gr.Error, match="log in first"):
            review_handlers.save_edit(tab, forged, None, 1, "hacked")
        with pytest.raises(gr.Error, match="log in first"):
            review_handlers.accept_all(tab, forged, None, 10**6)
        with pytest.raises(gr.Error, match="log in first"):
            review_handlers.export_file(tab, forged, None)
    assert tab.feedback_store().counts() == {"pending": 3, "accepted": 0, "rejected": 0}


def test_a_trainer_reads_the_exact_encoder_text_then_edits_accepts_rejects(tab):
    token = tab.auth.logins.issue()
    first, second = add(tab, 2)
    _, counts, rows = review_handlers.refresh(tab, token, None, "pending")
    assert rows["id"].tolist() == [second, first]  # newest first
    assert rows.iloc[0].to_dict() | {"age": "-"} == {
        "id": second, "rating": "✏️ correction", "kind": "persona", "context": "i love jazz.",
        "last user turn": "what do you like 1?", "response": "i love jazz 1.", "model": "tiny", "age": "-",
    }  # fmt: skip
    row_id, detail, response = review_handlers.details(tab, token, None, first, "chatbot: ")
    expected = encoder_text(tab.feedback_store().get(first), "chatbot: ")
    assert row_id == first and f"```text\n{expected}\n```" in detail and "i i a 0" in detail
    assert response == "i love jazz 0." and expected.startswith("chatbot: ")
    _, detail, _ = review_handlers.details(tab, token, None, first, "")  # the form's prefix, whatever it is
    assert f"```text\n{encoder_text(tab.feedback_store().get(first), '')}\n```" in detail

    assert "saved" in review_handlers.save_edit(tab, token, None, first, "i play the saxophone.")
    assert tab.feedback_store().get(first).response == "i play the saxophone."
    assert review_handlers.set_status(tab, token, None, first, "accepted") == f"Row {first}: accepted."
    review_handlers.set_status(tab, token, None, second, "rejected")
    assert tab.feedback_store().counts() == {"pending": 0, "accepted": 1, "rejected": 1}
    _, _, accepted = review_handlers.refresh(tab, token, None, "accepted")
    assert accepted["id"].tolist() == [first]
    assert review_handlers.refresh(tab, token, None, "all")[2]["id"].tolist() == [second, first]
    with pytest.raises(gr.Error, match="select a row"):
        review_handlers.set_status(tab, token, None, None, "accepted")
    with pytest.raises(gr.Error, match="no feedback row #999"):
        review_handlers.details(tab, token, None, 999, "chatbot: ")
    with pytest.raises(gr.Error, match="status must be"):
        review_handlers.refresh(tab, token, None, "everything")


def test_accept_all_stops_at_the_newest_row_the_page_counted(tab):
    token = tab.auth.logins.issue()
    ids = add(tab, 5)
    seen = review_handlers.newest_pending(tab)
    assert seen == (ids[-1], 0)  # (the newest row, the newest vote: none)
    late = add(tab, 1)[0]  # arrives after the page was drawn
    assert review_handlers.accept_all(tab, token, None, seen) == "5 pending rows accepted."
    assert [r.id for r in tab.feedback_store().rows("pending")] == [late]


def test_export_is_one_jsonl_of_accepted_good_replies_in_the_training_format(tab):
    token = tab.auth.logins.issue()
    with pytest.raises(gr.Error, match="no accepted rows"):
        review_handlers.export_file(tab, token, None)
    add(tab, 25, status="accepted")
    add(tab, 2, rating="dislike", status="accepted")  # no better reply to learn: not exported
    add(tab, 3)  # pending
    download, note = review_handlers.export_file(tab, token, None)
    assert download["name"].startswith("feedback-") and download["name"].endswith(".jsonl")
    assert note == f"Exported 25 accepted rows: your browser saves them as **{download['name']}**."
    rows = [json.loads(line) for line in download["text"].splitlines()]
    assert len(rows) == 25 and {"kind", "context", "turns", "response"} <= set(rows[0])  # no held-out part
    # kept on the server under the data root (not gradio's folders), once per set of rows
    (kept,) = (tab.data_root / "feedback" / "exports").glob("accepted-*/train.jsonl")
    assert kept.read_text() == download["text"]
    assert review_handlers.export_file(tab, token, None)[0]["text"] == download["text"]
    assert len(list((tab.data_root / "feedback" / "exports").iterdir())) == 1


def test_age():
    assert [review_handlers.age(s) for s in (5, 65, 7300, 90000)] == ["5 s", "1 min", "2 h", "1 d"]
    assert review_handlers.rows_frame([], now=time.time()).empty


# --------------------------------------------------------------------------- training on it


def test_no_accepted_rows_is_a_clear_error_and_nothing_starts(tab):
    add(tab, 2)  # pending only
    values = form(tab, use_feedback=True)
    assert "no accepted rows" in train_handlers.show_command(tab, None, values)
    with pytest.raises(gr.Error, match="no accepted rows"):
        train_handlers.start_run(tab, tab.auth.logins.issue(), None, None, values)
    assert tab.manager.runs() == []


def test_feedback_mixes_into_any_source_and_show_command_prints_the_export(tab):
    add(tab, 25, status="accepted")
    spec = train_handlers.spec_from_form(tab, form(tab, use_feedback=True, feedback_ratio=0.25), None)
    cfg = spec.config
    assert cfg.dataset_name == "sample" and cfg.feedback_ratio == 0.25
    train, heldout = Path(cfg.feedback_file), Path(cfg.feedback_validation_file)
    assert train.is_relative_to(tab.data_root.resolve()) and heldout.parent == train.parent
    assert len(train.read_text().splitlines()) == 23 and len(heldout.read_text().splitlines()) == 2
    # the same rows again: the same export (Show command costs no disk), and the command names it
    command = train_handlers.show_command(tab, None, form(tab, use_feedback=True, feedback_ratio=0.25))
    assert f"--feedback_file {train}" in command and f"--feedback_validation_file {heldout}" in command
    assert "--feedback_ratio 0.25" in command and "--dataset_name sample" in command
    assert len(list(train.parent.parent.iterdir())) == 1
    add(tab, 1, status="accepted")  # new rows: a new export
    again = train_handlers.spec_from_form(tab, form(tab, use_feedback=True), None)
    assert Path(again.config.feedback_file).parent != train.parent and again.config.feedback_ratio == 0.5
    # unticked: no feedback fields at all
    plain = train_handlers.spec_from_form(tab, form(tab), None).config
    assert plain.feedback_file is None and plain.feedback_validation_file is None


def test_ticking_feedback_preselects_the_served_run(tab):
    run_dir = tab.manager.root / "20250101-000000-abcdef"
    (run_dir / "final").mkdir(parents=True)
    (run_dir / "final" / "config.json").write_text("{}")
    (run_dir / "final" / "model.safetensors").write_bytes(b"")  # config and weights: a complete model
    spec = JobSpec(app_config("tiny", dataset_name="sample"))
    (run_dir / "run.json").write_text(json.dumps({"run_id": run_dir.name, "spec": spec.to_dict(), "metrics_offset": 0}))
    final = run_dir / "final"
    assert tab.manager.finished_runs() == [(run_dir.name, str(final))]
    slider, model, lr, adapter = train_handlers.feedback_toggled(tab, True, "tiny")
    assert slider["visible"] and model == gr.skip()  # nothing served that is a run (no engine: tab.serving unset)
    assert adapter["value"] == "lora"  # on a CPU (this tab has no GPU) the retrain trains a LoRA adapter
    tab.gpus = 1
    assert train_handlers.feedback_toggled(tab, True, "tiny")[3] == gr.skip()  # a GPU: as the form says
    assert train_handlers.feedback_toggled(tab, False, "tiny")[3] == gr.skip()
    tab.gpus = 0
    tab.serving = lambda: str(DEMO_DIR)  # the bundled demo model (served offline) can be retrained too
    assert train_handlers.feedback_toggled(tab, True, "tiny")[1]["value"] == str(DEMO_DIR)
    assert ("demo model (bundled; what the chat serves offline)", str(DEMO_DIR)) in train_handlers.base_model_choices(
        tab
    )
    tab.serving = lambda: str(final)
    slider, model, lr, _ = train_handlers.feedback_toggled(tab, True, "tiny")
    assert model["value"] == str(final) and lr == train_handlers.learning_rate_for(str(final))
    assert train_handlers.feedback_toggled(tab, False, "tiny")[0]["visible"] is False
