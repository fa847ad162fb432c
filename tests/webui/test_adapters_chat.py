"""LoRA adapters in the app's handlers (issue 25 item 4): the model picker lists adapter runs with
their base, loading one whose base serves attaches it, a chat in the Chat tab and a conversation
through /chat keep the model they started with, and the Compare tab compares two adapters of the
served base. Real adapters made with peft (tests/adapter_files.py) on the bundled demo model."""

from __future__ import annotations

import os
import time

import gradio as gr
import pytest
from adapter_files import make_adapter

from chat.compare import CompareSlot
from chat.engine import DEMO_DIR, ChatEngine, Conversation, load_checkpoint
from webui import chat_handlers, compare_handlers, feedback_handlers

PERSONA = chat_handlers.CHAT_E_PERSONA
SETTINGS = ("fast", *chat_handlers.preset_values("fast")[:4], 24, 0)  # preset, beams, sample, temp, top-p, max, seed


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """A runs root: two adapter runs of the demo model (bob the newer) and a full run."""
    root = tmp_path_factory.mktemp("runs")
    make_adapter(DEMO_DIR, root / "ann", seed=1)
    make_adapter(DEMO_DIR, root / "bob", seed=2)
    now = time.time()
    for age, run in ((30, "ann"), (10, "bob")):
        os.utime(root / run / "final", (now - age, now - age))
    return root


@pytest.fixture
def engine():
    return ChatEngine(load_checkpoint(str(DEMO_DIR), optimize="none"), f"serving {DEMO_DIR}")


def say(engine, message, history, replies):
    """One exchange as ChatInterface runs it: the history it keeps, and the page's reply records."""
    out = list(feedback_handlers.chat_fn(engine)(message, history, "persona", PERSONA, *SETTINGS, replies))
    reply, _, banner, replies = out[-1]
    shown = reply if isinstance(reply, dict) else {"role": "assistant", "content": reply}
    return [*history, {"role": "user", "content": message}, shown], replies, banner


def test_the_picker_lists_adapter_runs_with_their_base(runs, engine):
    choices = chat_handlers.picker_choices(runs, current=engine.current.name)
    labels = {spec: label for label, spec in choices}
    bob, ann = str(runs / "bob" / "final"), str(runs / "ann" / "final")
    assert [spec for _, spec in choices][2:] == [bob, ann]  # newest first, after the base and demo models
    assert labels[bob].startswith("bob/final (LoRA on demo model) · ")
    assert str(runs) not in labels[bob] and str(DEMO_DIR) not in labels[bob]  # no server paths
    assert chat_handlers.model_label(bob) == "bob/final (LoRA on demo model)"


def test_loading_an_adapter_attaches_it_to_the_serving_base(runs, engine):
    base = engine.current
    steps = list(chat_handlers.load_model(engine, str(runs / "bob" / "final"), "", runs))
    assert steps[-1] == ("✅ Now serving bob/final (LoRA on demo model).", None)
    assert engine.base is base and engine.current.model is base.model and engine.current.id == "bob"
    assert chat_handlers.serving_markdown(engine).startswith("✅ **Serving bob/final (LoRA on demo model)** (")
    assert chat_handlers.current_choice(engine, chat_handlers.picker_choices(runs, current=engine.current.name)) == str(
        runs / "bob" / "final"
    )


def test_a_chat_keeps_its_adapter_across_a_swap(runs, engine):
    bob, ann = str(runs / "bob" / "final"), str(runs / "ann" / "final")
    list(chat_handlers.load_model(engine, bob, "", runs))
    history, replies, banner = say(engine, "hi! who are you?", [], {})
    assert replies[1]["id"] == "bob" and banner.startswith("✅ **Serving bob/final (LoRA on demo model)**")
    list(chat_handlers.load_model(engine, ann, "", runs))  # a trainer serves ann to everyone
    history, replies, banner = say(engine, "what do you like?", history, replies)
    assert replies[3]["id"] == "bob" and banner.startswith("✅ **Serving bob/final")  # this chat stays with bob
    turns = chat_handlers.history_to_turns(history)
    expected = engine.reply(Conversation("persona", PERSONA, turns[:2], model="bob"), "what do you like?")[0]
    assert turns[-1] == expected
    fresh, fresh_replies, banner = say(engine, "what do you like?", [], {})  # a new chat talks to ann
    assert fresh_replies[1]["id"] == "ann" and banner.startswith("✅ **Serving ann/final")


def test_the_api_returns_the_model_and_keeps_a_conversation_on_it(runs, engine):
    chat = chat_handlers.api_chat_fn(engine)
    engine.swap(str(runs / "bob"))
    *_, (reply, model) = chat("hi! who are you?", "persona", PERSONA)
    assert (
        model == "bob" and reply == engine.reply(Conversation("persona", PERSONA, model="bob"), "hi! who are you?")[0]
    )
    engine.swap(str(runs / "ann"))
    history = ["hi! who are you?", reply]
    *_, (kept, model) = chat("and what do you like?", "persona", PERSONA, history=history, model="bob")
    assert model == "bob"
    assert kept == engine.reply(Conversation("persona", PERSONA, history, model="bob"), "and what do you like?")[0]
    *_, (_, model) = chat("and what do you like?", "persona", PERSONA, history=history)
    assert model == "ann"  # no model named: the one serving now
    with pytest.raises(gr.Error, match="Unknown model 'carol'; models served now: demo-model, bob, ann"):
        list(chat("hi", "none", "", model="carol"))
    with pytest.raises(gr.Error, match="model must be a model id"):
        list(chat("hi", "none", "", model="x" * 201))


def test_compare_two_adapters_of_the_serving_base(runs, engine):
    slot = CompareSlot(engine, optimize="none")
    slot.choose(str(runs / "bob" / "final"), str(runs / "ann" / "final"))
    assert slot.extra is None and slot.is_serving(str(runs / "bob"))
    assert compare_handlers.pair_markdown(slot).startswith("**A**: bob/final · **B**: ann/final")
    *_, last = compare_handlers.send(slot, "hi there!", "persona", PERSONA, [], [])
    _, pane_a, pane_b, pending, *_ = last
    pair = pending.pop("pair")  # what a vote keeps for preference rows (issue 27)
    assert pending == {"a": str(runs / "bob" / "final"), "b": str(runs / "ann" / "final"), "message": "hi there!"}
    assert (pair["kind"], pair["context"], pair["turns"]) == ("persona", PERSONA, ["hi there!"])
    assert (pair["reply_a"], pair["reply_b"]) == (pane_a[-1]["content"], pane_b[-1]["content"])
    for pane, model in ((pane_a, "bob"), (pane_b, "ann")):
        expected = engine.reply(Conversation("persona", PERSONA, model=model), "hi there!", compare_handlers.SETTINGS)
        assert pane[-1]["content"] == expected[0]
    assert pane_a[-1]["content"] != pane_b[-1]["content"]
    assert engine.current.id == "demo-model"  # the chat serves what it served
