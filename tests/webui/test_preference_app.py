"""Issue 27 in the app, without a browser: Compare votes reviewed beside the chat's rows, the accepted
feedback exported as DPO pairs / KTO rows, the Train tab's objective (counts, refusals, Show command's
flags, the file a run trains on), the preference accuracy plot and the model picker's figure.
Real store, real files, the real form handlers; the exported files are read back by
finetune.preference_data exactly as a run reads them."""

import json
import time

import gradio as gr
import pytest

from finetune.feedback_preferences import preference_rows
from finetune.jobs.manager import RunManager
from finetune.jobs.status import RunStatus
from finetune.preference_data import load_preferences
from webui import model_scores, review_handlers, train_handlers, train_objective, train_view
from webui.auth import AuthConfig

PASSWORD = "correct horse battery staple"
CONVERSATION = {"kind": "persona", "context": "i love jazz.", "turns": ["hi", "hello!", "what do you like?"]}


@pytest.fixture
def tab(tmp_path, monkeypatch):
    data = tmp_path / "data"
    monkeypatch.setenv("PERSONA_CHAT_RUNS", str(tmp_path / "runs"))
    monkeypatch.setenv("PERSONA_CHAT_DATA", str(data))
    return train_handlers.TrainTab(
        manager=RunManager(tmp_path / "runs"), auth=AuthConfig(password=PASSWORD), gpus=0, data_root=data
    )


@pytest.fixture
def token(tab):
    return tab.auth.logins.issue()


def rate(tab, rating, response, original="", status="pending", i=0):
    row = {**CONVERSATION, "turns": [*CONVERSATION["turns"][:-1], f"what do you like {i}?"]}
    return tab.feedback_store().add(
        **row, response=response, original=original, rating=rating, model="tiny", visitor=f"v{i}", status=status
    )


def vote(tab, winner="a", a="jazz, mostly.", b="i i i", i=0):
    pair = {**CONVERSATION, "turns": [f"what do you like {i}?"], "reply_a": a, "reply_b": b}
    return tab.feedback_store().vote(model_a="m1", model_b="m2", winner=winner, visitor=f"w{i}", pair=pair)


def form(tab, **changes) -> dict:
    return {**train_handlers.default_form(tab), **changes}


# --------------------------------------------------------------------------- review


def test_votes_wait_in_the_review_table_beside_the_rows_and_only_a_trainer_sees_them(tab, token):
    row = rate(tab, "correction", "i love jazz.", original="i i a")
    time.sleep(0.01)
    vid = vote(tab, "b", a="no.", b="jazz and blues.")
    label, counts, frame = review_handlers.refresh(tab, None, None, "pending")
    assert label["label"] == "Feedback from the chat (2 pending)"  # the vote counts too
    assert "Compare votes: 1 pending, 0 accepted, 0 rejected" in counts and frame.empty  # a visitor: no rows
    _, _, frame = review_handlers.refresh(tab, token, None, "pending")
    assert frame["id"].tolist() == [f"v{vid}", row]  # newest first, the vote named apart
    assert frame["rating"].tolist()[0] == "⚖️ vote"
    assert frame["response"].tolist()[0] == "✔ jazz and blues. / ✘ no."
    assert frame["model"].tolist()[0] == "m2 vs m1"  # the winner first

    shown, detail, response = review_handlers.details(tab, token, None, f"v{vid}", "chatbot: ")
    assert shown == f"v{vid}" and response == "jazz and blues."
    assert "chatbot: " in detail and "Chosen: the winner's reply (`m2`)" in detail and "no." in detail
    with pytest.raises(gr.Error, match="accept or reject the vote"):
        review_handlers.save_edit(tab, token, None, f"v{vid}", "something else")
    with pytest.raises(gr.Error, match="log"):
        review_handlers.set_status(tab, None, None, f"v{vid}", "accepted")
    with pytest.raises(gr.Error, match="not a row of the table"):
        review_handlers.set_status(tab, token, None, "vx1", "accepted")
    assert review_handlers.set_status(tab, token, None, f"v{vid}", "accepted") == f"Vote v{vid}: accepted."
    assert tab.feedback_store().vote_counts() == {"pending": 0, "accepted": 1, "rejected": 0}


def test_accept_all_takes_the_pending_rows_and_votes_the_page_counted(tab, token):
    rate(tab, "like", "jazz!")
    vote(tab, i=1)
    seen = review_handlers.newest_pending(tab)
    late = vote(tab, i=2)  # after the page was drawn: waits
    assert review_handlers.accept_all(tab, token, None, seen) == "1 pending row and 1 Compare vote accepted."
    assert [v.id for v in tab.feedback_store().votes("pending")] == [late]


def test_dpo_and_kto_exports_go_to_the_trainers_browser_in_the_training_format(tab, token, tmp_path):
    with pytest.raises(gr.Error, match="log"):
        review_handlers.export_preference_file(tab, None, None, "dpo")
    with pytest.raises(gr.Error, match="no DPO rows"):
        review_handlers.export_preference_file(tab, token, None, "dpo")
    rate(tab, "correction", "i love jazz.", original="i i a", status="accepted")
    tab.feedback_store().set_vote_status([vote(tab, "a", i=1)], "accepted")
    vote(tab, "tie", i=2)  # a tie: no pair
    rate(tab, "like", "jazz!", status="accepted", i=3)
    rate(tab, "dislike", "i i i", original="i i i", status="accepted", i=4)
    for objective, rows in (("dpo", 2), ("kto", 2)):
        download, note = review_handlers.export_preference_file(tab, token, None, objective)
        assert download["name"].startswith(f"feedback-{objective}-") and download["name"].endswith(".jsonl")
        assert f"Exported {rows} {objective.upper()}" in note
        saved = tmp_path / download["name"]  # what the browser saves
        saved.write_text(download["text"])
        train, _ = load_preferences(str(saved), objective)
        assert len(train) == rows
    kto = [json.loads(line) for line in saved.read_text().splitlines()]
    assert [(r["response"], r["label"]) for r in kto] == [("jazz!", True), ("i i i", False)]
    with pytest.raises(gr.Error, match="dpo or kto"):
        review_handlers.export_preference_file(tab, token, None, "../etc")


# --------------------------------------------------------------------------- the Train tab's objective


def test_the_objectives_line_counts_each_kind_and_says_what_is_too_few(tab):
    rate(tab, "correction", "i love jazz.", original="i i a", status="accepted")
    rate(tab, "like", "jazz!", status="accepted", i=1)
    counts = train_objective.preference_counts(tab.feedback_store())
    line = train_objective.counts_line(counts, "dpo")
    assert "**1** pair from corrections · **0** pairs from Compare votes · **1** KTO row from" in line
    assert "⚠️ DPO needs at least 2 preference pairs" in line and "there is 1" in line
    tab.feedback_store().set_vote_status([vote(tab)], "accepted")
    line = train_objective.counts_line(train_objective.preference_counts(tab.feedback_store()), "dpo")
    assert "⚠️" not in line and "DPO trains on 2 (under 10 rows none are held out" in line
    for i in range(10):
        rate(tab, "correction", f"jazz {i}.", original="i i a", status="accepted", i=10 + i)
    line = train_objective.counts_line(train_objective.preference_counts(tab.feedback_store()), "dpo")
    assert "DPO trains on 11 and measures preference accuracy on 1 held out" in line


def test_show_command_prints_the_objective_and_the_exported_preference_file(tab):
    values = form(tab, objective="dpo", beta=0.25, sft_weight=0.5)
    assert train_handlers.show_command(tab, None, values).startswith("# no command: DPO needs at least 2")
    with pytest.raises(ValueError, match="KTO needs at least 2"):
        train_handlers.spec_from_form(tab, form(tab, objective="kto"), None)
    for i in range(3):
        rate(tab, "correction", f"jazz {i}.", original="i i a", status="accepted", i=i)
    command = train_handlers.show_command(tab, None, values)
    assert "--objective dpo \\\n" in command and "--beta 0.25 \\\n" in command and "--sft_weight 0.5 \\\n" in command
    (path,) = [line.split()[1] for line in command.splitlines() if line.strip().startswith("--preference_file")]
    assert path.startswith(str(tab.data_root)) and path.endswith("/dpo.jsonl")  # under the data root, never sent
    assert [json.loads(line) for line in open(path)] == preference_rows(tab.feedback_store(), "dpo")
    spec = train_handlers.spec_from_form(tab, values, None)
    assert (spec.config.objective, spec.config.preference_file) == ("dpo", path)  # the same rows: the same file
    rate(tab, "correction", "more jazz.", original="i i a", status="accepted", i=9)
    assert train_handlers.spec_from_form(tab, values, None).config.preference_file != path  # new rows, new file
    # SFT: no preference flags, whatever beta says
    sft = train_handlers.spec_from_form(tab, form(tab, beta=0.25), None).config
    assert (sft.objective, sft.preference_file, sft.beta) == ("sft", None, 0.1)
    with pytest.raises(ValueError, match="objective must be one of"):
        train_handlers.spec_from_form(tab, form(tab, objective="orpo"), None)
    with pytest.raises(ValueError, match="beta"):
        train_handlers.spec_from_form(tab, form(tab, objective="dpo", beta=0), None)


def test_starting_a_dpo_run_needs_the_login(tab):
    for i in range(3):
        rate(tab, "correction", f"jazz {i}.", original="i i a", status="accepted", i=i)
    with pytest.raises(gr.Error, match="log"):
        train_handlers.start_run(tab, None, None, None, form(tab, objective="dpo"))
    assert tab.manager.runs() == []


# --------------------------------------------------------------------------- seeing whether it helped


def test_the_preference_accuracy_plot_shows_for_runs_that_report_it(tab, monkeypatch):
    status = RunStatus(
        run_id="r", state="running", total_steps=40, eval_pref_accuracy=0.75, eval_bleu=3.0,
        pref_points=[{"step": 20, "pref_accuracy": 0.5}, {"step": 40, "pref_accuracy": 0.75}],
    )  # fmt: skip
    assert train_view.pref_frame(status).to_dict("records") == [
        {"step": 20, "accuracy": 50.0},
        {"step": 40, "accuracy": 75.0},
    ]
    assert "BLEU 3.00 · preference accuracy 75%" in train_view.run_markdown(status)
    monkeypatch.setattr(tab.manager, "status", lambda *a: status)

    def pref_update(cache):  # the live view's preference plot (4th after the cache)
        cache, *out = train_view.live_view(tab, cache)
        return cache, out[3]

    cache, update = pref_update(None)
    assert update["visible"] is True and update["y_lim"] == [0, 100] and len(update["value"]) == 2
    cache, update = pref_update(cache)  # sent again once after new limits (gradio redraws)
    assert len(update["value"]) == 2 and update["visible"] is True
    cache, update = pref_update(cache)
    assert update == gr.skip()
    monkeypatch.setattr(tab.manager, "status", lambda *a: RunStatus(run_id="s", total_steps=40))  # an SFT run
    _, update = pref_update(cache)
    assert update["visible"] is False


def test_the_model_picker_shows_a_runs_preference_accuracy(tmp_path):
    final = tmp_path / "20261203-120000-abcdef" / "final"
    final.mkdir(parents=True)
    results = {"eval_bleu": 20.0, "eval_pref_accuracy": 0.8333, "eval_pref_rows": 12}
    (final / "all_results.json").write_text(json.dumps(results))
    assert model_scores.with_bleu("run", str(final)) == "run · BLEU 20.0 · pref 83%"
    assert model_scores.bleu_note(str(final)).endswith(". Preference accuracy 83% (12 held-out rows).")
    (final / "all_results.json").write_text(json.dumps({"eval_bleu": 20.0}))  # an SFT run: as before
    assert model_scores.with_bleu("run", str(final)) == "run · BLEU 20.0"
    assert "reference" not in model_scores.bleu_note(str(final))
