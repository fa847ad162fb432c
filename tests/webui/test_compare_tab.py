"""The Compare tab (webui/compare_handlers.py, webui/compare_tab.py): the same message to two
real models (the bundled demo model serving, the tiny preset as a finished run), votes in a
real feedback store, win rates; choosing the models needs the login, chatting and voting not.
The last test launches the app and goes through its endpoints as a client would (slow)."""

import shutil
from pathlib import Path
from types import SimpleNamespace

import gradio as gr
import pytest

from chat.compare import CompareSlot
from chat.engine import DEMO_DIR, MAX_MESSAGE_CHARS, ChatEngine, Conversation, load_checkpoint
from finetune import feedback
from finetune.feedback import FeedbackStore
from finetune.jobs.manager import RunManager
from webui import chat_handlers, compare_handlers, train_handlers
from webui.auth import AuthConfig

PASSWORD = "compare-pass"
PERSONA = "i love dogs."


@pytest.fixture(scope="module")
def serving():
    return ChatEngine(load_checkpoint(str(DEMO_DIR), optimize="none"), f"serving {DEMO_DIR}")


@pytest.fixture(scope="module")
def runs(tiny_path, tmp_path_factory) -> Path:
    """A runs root whose one finished run is the tiny preset."""
    root = tmp_path_factory.mktemp("runs")
    shutil.copytree(tiny_path, root / "tiny-run" / "final")
    return root


@pytest.fixture
def tab(runs, tmp_path, monkeypatch):
    monkeypatch.setenv("PERSONA_CHAT_DATA", str(tmp_path / "data"))
    return train_handlers.TrainTab(manager=RunManager(runs), auth=AuthConfig(password=PASSWORD), gpus=0)


@pytest.fixture
def slot(serving):
    return CompareSlot(serving, optimize="none")


@pytest.fixture
def store(tmp_path):
    return FeedbackStore(tmp_path / "votes.sqlite3")


def run_spec(runs: Path) -> str:
    return str(runs / "tiny-run" / "final")


def request(host: str = "203.0.113.7"):
    """What the handlers read of a gr.Request: its headers and client address."""
    return SimpleNamespace(headers={}, client=SimpleNamespace(host=host))


def choose(slot, tab, token, a=None, b=None, hub=None) -> list[str]:
    return list(compare_handlers.choose_models(slot, tab, token, None, a, b, hub))


def chosen(slot, tab) -> tuple[str, str]:
    choices = compare_handlers.model_choices(slot, tab.manager.root)
    a, b = compare_handlers.default_choices(slot, choices, tab.manager.root)
    notes = choose(slot, tab, tab.auth.logins.issue(), a, b)
    assert notes[-1].startswith("✅ Comparing"), notes
    return a, b


def send(slot, message, history_a=None, history_b=None, kind="persona", context=PERSONA) -> list[tuple]:
    return list(compare_handlers.send(slot, message, kind, context, history_a or [], history_b or []))


def interactive(updates) -> list[bool]:
    return [u["interactive"] for u in updates]


# --------------------------------------------------------------------------- choosing


def test_defaults_are_the_serving_model_and_the_newest_run(slot, tab, runs):
    choices = compare_handlers.model_choices(slot, runs)
    assert compare_handlers.default_choices(slot, choices, runs) == (str(DEMO_DIR), run_spec(runs))
    assert "No models chosen yet" in compare_handlers.pair_markdown(slot)


def test_choosing_needs_the_login(slot, tab, runs):
    for token in (None, "forged-token"):
        notes = choose(slot, tab, token, str(DEMO_DIR), run_spec(runs))
        assert notes == ["🔒 Cannot choose the models to compare: log in first (Train tab: enter the password)."]
    no_login = train_handlers.TrainTab(manager=tab.manager, auth=AuthConfig(), gpus=0)
    [note] = choose(slot, no_login, None, str(DEMO_DIR), run_spec(runs))
    assert note.startswith("🔒 Cannot choose the models to compare: no login is configured")
    assert slot.pair is None and slot.extra is None


def test_only_listed_models_or_a_hub_id(slot, tab, runs, tmp_path):
    token = tab.auth.logins.issue()
    elsewhere = tmp_path / "elsewhere"
    shutil.copytree(runs / "tiny-run" / "final", elsewhere)  # a real model, but not one of the choices
    assert choose(slot, tab, token, str(DEMO_DIR), str(elsewhere)) == [
        "⚠️ That model is not in the list; press Refresh and pick one."
    ]
    assert "not a Hub model id" in choose(slot, tab, token, str(DEMO_DIR), None, "../etc/passwd")[0]
    assert "is a folder on this server" in choose(slot, tab, token, str(DEMO_DIR), None, "chat/demo_model")[0]
    assert "two different models" in choose(slot, tab, token, str(DEMO_DIR), str(DEMO_DIR))[-1]
    assert slot.pair is None and slot.extra is None


def test_a_logged_in_trainer_chooses_and_the_page_shows_it(slot, tab, runs):
    assert chosen(slot, tab) == (str(DEMO_DIR), run_spec(runs))
    assert slot.pair == (str(DEMO_DIR), run_spec(runs)) and slot.loaded_spec == run_spec(runs)
    pair = compare_handlers.pair_markdown(slot)
    assert "tiny-run/final" in pair and "demo model" in pair and str(runs) not in pair  # no server paths
    assert [u["label"] for u in compare_handlers.pane_labels(slot)] == [
        "A · demo model (tiny, bundled)",
        "B · tiny-run/final",
    ]


# --------------------------------------------------------------------------- chatting


def test_before_a_choice_a_message_says_why_nothing_happens(slot):
    *_, (box, pane_a, pane_b, pending, note, *buttons) = send(slot, "hello")
    assert box == gr.skip() and pane_a == pane_b == [] and pending is None
    assert note.startswith("⚠️ No models to compare yet") and interactive(buttons) == [False] * 3


def test_both_models_reply_each_with_its_own_history(slot, tab, runs):
    chosen(slot, tab)
    extra = slot.extra
    outputs = send(slot, "hello there")
    assert all(out[0] == "" for out in outputs)  # the message box is cleared at once
    assert not any(interactive(out[5:]) != [False] * 3 for out in outputs[:-1])  # no vote on half a pair
    box, pane_a, pane_b, pending, note, *buttons = outputs[-1]
    reply_a = tab_reply(slot.serving, [], "hello there")
    reply_b = tab_reply(extra, [], "hello there")
    assert chat_handlers.history_to_turns(pane_a) == ["hello there", reply_a]
    assert chat_handlers.history_to_turns(pane_b) == ["hello there", reply_b]
    conversation = {"kind": "persona", "context": PERSONA, "turns": ["hello there"]}
    assert pending == {
        "a": str(DEMO_DIR),
        "b": run_spec(runs),
        "message": "hello there",
        "pair": {**conversation, "reply_a": reply_a, "reply_b": reply_b},  # what a vote keeps (issue 27)
    }
    assert interactive(buttons) == [True] * 3 and note.startswith("Which reply is better?")

    # The next message: each model sees its own earlier reply, not the other's.
    *_, (_, pane_a2, pane_b2, pending2, _, *_) = send(slot, "do you have pets?", pane_a, pane_b)
    turns_a, turns_b = chat_handlers.history_to_turns(pane_a2), chat_handlers.history_to_turns(pane_b2)
    assert turns_a[:3] == ["hello there", reply_a, "do you have pets?"]
    assert turns_b[:3] == ["hello there", reply_b, "do you have pets?"]
    assert turns_a[3] == tab_reply(slot.serving, turns_a[:2], "do you have pets?")
    assert turns_b[3] == tab_reply(extra, turns_b[:2], "do you have pets?")
    assert pending2["message"] == "do you have pets?"
    assert pending2["pair"] is None  # two different conversations by now: no preference pair to keep


def tab_reply(engine, turns, message) -> str:
    return engine.reply(Conversation("persona", PERSONA, list(turns)), message)[0]


@pytest.mark.parametrize(
    ("message", "kind", "expected"),
    [
        ("x" * (MAX_MESSAGE_CHARS + 1), "persona", "The message is too long"),
        ("   ", "persona", "Type a message first"),
        ("hi", "bogus", "Unknown kind"),
        ("hi", "persona", "needs a context"),
    ],
)
def test_bad_input_reaches_neither_model(slot, tab, monkeypatch, message, kind, expected):
    chosen(slot, tab)
    # Both engines' generate() calls go through the serving engine's batcher.
    monkeypatch.setattr(slot.serving._batcher, "submit", lambda *a, **k: pytest.fail("a model was called"))
    context = "" if expected == "needs a context" else PERSONA
    [(box, pane_a, pane_b, pending, note, *buttons)] = send(slot, message, kind=kind, context=context)
    assert expected in note and pending is None and pane_a == pane_b == [] and box == gr.skip()


# --------------------------------------------------------------------------- votes


def test_anyone_votes_once_per_reply_pair_and_sees_the_win_rates(slot, tab, runs, store):
    chosen(slot, tab)
    *_, (_, _, _, pending, _, *_) = send(slot, "hello there")
    table, left, note, *buttons = compare_handlers.vote(store, tab, pending, "b", request())
    assert left is None and note.startswith("✅") and interactive(buttons) == [False] * 3
    (kept,) = store.votes("pending")  # the vote keeps both replies; it waits for a trainer's review
    assert (kept.turns, kept.chosen, kept.rejected) == (
        ["hello there"],
        pending["pair"]["reply_b"],
        pending["pair"]["reply_a"],
    )
    assert table.to_dict("records") == [
        {
            "Model": "demo model (tiny, bundled)",  # A first, as in the panes
            "Against": "tiny-run/final",
            "Wins": 0,
            "Losses": 1,
            "Ties": 0,
            "Votes": 1,
            "Win rate": "0%",
        }
    ]
    # The same pair again (the page's state is cleared after a vote): refused, nothing stored.
    again = compare_handlers.vote(store, tab, left, "a", request())
    assert again[1] is None and again[2].startswith("⚠️ Nothing to vote on")
    assert [r["total"] for r in store.win_rates()] == [1]
    # Another reply pair, another visitor: a tie counts half.
    *_, (_, _, _, pending, _, *_) = send(slot, "what do you do?")
    table, *_ = compare_handlers.vote(store, tab, pending, "tie", request("198.51.100.9"))
    row = table.to_dict("records")[0]
    assert (row["Wins"], row["Losses"], row["Ties"], row["Votes"], row["Win rate"]) == (0, 1, 1, 2, "25%")
    # The store keeps the pair in its own order; without the pair, that order is shown.
    [plain] = compare_handlers.win_rate_frame(store).to_dict("records")
    assert {plain["Model"], plain["Against"]} == {row["Model"], row["Against"]}
    assert (plain["Wins"] + plain["Losses"], plain["Ties"], plain["Votes"]) == (1, 1, 2)
    bogus = compare_handlers.vote(store, tab, pending, "both", request())
    assert bogus[2].startswith("⚠️ Unknown vote") and [r["total"] for r in store.win_rates()] == [2]


def test_the_visitor_key_is_the_client_address_hashed(slot, tab, store):
    chosen(slot, tab)
    *_, (_, _, _, pending, _, *_) = send(slot, "hello there")
    compare_handlers.vote(store, tab, pending, "a", request("192.0.2.1"))
    import sqlite3

    with sqlite3.connect(store.path) as con:
        [(visitor, message)] = con.execute("SELECT visitor, message FROM votes").fetchall()
    assert visitor == store.visitor_key("192.0.2.1") and "192.0.2.1" not in visitor and message == "hello there"


# --------------------------------------------------------------------------- the app


def test_the_app_has_a_compare_tab_between_chat_and_train(serving, tmp_path, monkeypatch):
    import app

    monkeypatch.setenv("PERSONA_CHAT_RUNS", str(tmp_path / "runs"))
    demo = app.build_demo(serving)
    tabs = [b.label for b in demo.blocks.values() if isinstance(b, gr.Tab)]
    assert tabs == ["Chat", "Compare", "Train"]
    names = {d.api_name for d in demo.fns.values()}
    assert {"compare_send", "compare_load", "compare_vote_a", "compare_vote_b", "compare_vote_tie"} <= names
    assert [d.api_name for d in demo.fns.values() if d.api_visibility == "public"] == ["chat"]
    assert demo.compare.slot.serving is serving and demo.compare.slot.extra is None
    assert [p.label for p in demo.compare.panes] == ["A", "B"]


def test_compare_through_the_launched_app(tmp_path, tiny_path, monkeypatch):
    """Anonymous: choosing refused, chatting before a choice explained. Logged in: choose. Anonymous
    again: both reply, one vote counted, a second vote on the same pair refused; past the votes a
    visitor may cast on a pair (lowered here to 3 a day), the page says why a vote was not counted."""
    from served_app import App, Caller

    shutil.copytree(tiny_path, tmp_path / "runs" / "tiny-run" / "final")  # the run the pickers list
    served = App(tmp_path, AuthConfig(password=PASSWORD))
    try:
        anonymous = Caller(served.url)
        b = str(served.runs / "tiny-run" / "final")
        assert anonymous("compare_load", str(DEMO_DIR), b, "").startswith("🔒 Cannot choose the models")
        trainer = Caller(served.url)
        trainer("train_login", PASSWORD)
        assert trainer("compare_load", str(DEMO_DIR), b, "").startswith("✅ Comparing")
        out = anonymous("compare_send", "hello there", "persona", PERSONA, [], [])
        pane_a, pane_b, note = out[1], out[2], out[3]
        assert len(pane_a) == len(pane_b) == 2 and note.startswith("Which reply is better?")
        table, note, *_ = anonymous("compare_vote_a")
        assert note.startswith("✅") and table["data"][0][2:6] == [1, 0, 0, 1]
        assert anonymous("compare_vote_b")[1].startswith("⚠️ Nothing to vote on")
        assert [r["total"] for r in FeedbackStore().win_rates()] == [1]
        monkeypatch.setattr(feedback, "VOTES_PER_PAIR_PER_DAY", (3, 24 * 3600))
        notes = []
        for i in range(3):
            anonymous("compare_send", f"message {i}", "persona", PERSONA, [], [])
            notes.append(anonymous("compare_vote_b")[1])
        assert notes[:2] == ["✅ Thanks, your vote is saved: B is better."] * 2
        assert notes[2].startswith("⚠️ The vote was not saved: you have voted 3 times on these two models")
        assert "not counted: try again in" in notes[2]
        assert [r["total"] for r in FeedbackStore().win_rates()] == [3]
    finally:
        served.close()
