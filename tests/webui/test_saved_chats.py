"""webui/saved_chats.py: each saved chat keeps who the bot was (kind, context, generation settings),
keyed by the chat's messages, through ChatInterface's own saves, shifts and deletions; whatever the
browser sends back is checked before it reaches a control. The real ChatInterface save and delete
functions move the saved list here (the browser test, tests/webui/test_browser_chat_state.py, clicks)."""

from __future__ import annotations

import json
import math
from dataclasses import asdict

import gradio as gr
import pytest
from hypothesis import given
from hypothesis import strategies as st

from chat.engine import MAX_CONTEXT_CHARS
from webui import chat_handlers, saved_chats
from webui.saved_chats import ChatSettings

JAZZ = ChatSettings("topic", "jazz", "fast", 1, False, 1.0, 1.0, 40, 0)
CHEF = ChatSettings("persona", "I am a chef.", "faithful", 6, True, 0.7, 0.9, 64, 1234)


def chat(*texts: str) -> list[dict]:
    """A saved chat as the browser keeps it (ChatInterface's normalized messages)."""
    roles = ("user", "assistant")
    return [
        {"role": roles[i % 2], "content": [{"type": "text", "text": t}], "metadata": None, "options": None}
        for i, t in enumerate(texts)
    ]


def browser(value):
    """What comes back from the browser: the value after a trip through JSON."""
    return json.loads(json.dumps(value))


@pytest.fixture(scope="module")
def interface():
    """A real ChatInterface: its own save and delete functions move the saved list."""
    with gr.Blocks():
        return gr.ChatInterface(lambda message, history: message, save_history=True)


def test_settings_follow_their_chat_through_new_chats_and_deletions(interface):
    saved, store = [], {}
    # A first chat, saved after its first reply (ChatInterface inserts a new chat at index 0).
    conversation_id, saved = interface._save_conversation(None, chat("hi", "hello"), saved)
    store = saved_chats.remember(store, conversation_id, browser(saved), CHEF)
    # A second chat under other settings: the first chat moves to index 1, its settings follow it.
    conversation_id, saved = interface._save_conversation(None, chat("music?", "jazz!"), saved)
    store = saved_chats.remember(browser(store), conversation_id, browser(saved), JAZZ)
    assert saved_chats.recall(store, 0, browser(saved)) == JAZZ
    assert saved_chats.recall(store, 1, browser(saved)) == CHEF
    # The jazz chat goes on: its old record is replaced, not kept beside the new one.
    conversation_id, saved = interface._save_conversation(0, chat("music?", "jazz!", "who?", "miles"), saved)
    store = saved_chats.remember(store, conversation_id, browser(saved), JAZZ)
    assert len(store) == 2 and saved_chats.recall(store, 0, saved) == JAZZ
    # Deleting the jazz chat (the chat's trash button) drops its record; the chef chat moves up.
    conversation_id, saved = interface._delete_conversation(0, saved)
    store = saved_chats.remember(store, conversation_id, browser(saved), JAZZ)
    assert conversation_id is None and len(store) == 1
    assert saved_chats.recall(store, 0, browser(saved)) == CHEF
    assert saved_chats.recall(store, 1, saved) is None


def test_a_chat_without_stored_settings_leaves_the_controls_alone():
    saved = [chat("hi", "hello")]  # saved before the store existed, or on another server
    assert saved_chats.recall({}, 0, saved) is None
    assert saved_chats.restore({}, 0, saved, {"kind": "topic"}, "jazz") == (*(gr.skip(),) * 10, None)
    for index in (None, -1, 1, True, "0", 0.0):
        assert saved_chats.recall({saved_chats.fingerprint(saved[0]): {}}, index, saved) is None


def test_restore_gives_the_controls_their_values_and_keeps_the_typed_context():
    saved = [chat("hi", "hello")]
    store = saved_chats.remember({}, 0, saved, CHEF)
    # The page shows a topic the user typed: it stays that topic's, the persona comes back.
    kind, context, contexts, *generation, written = saved_chats.restore(store, 0, saved, {"kind": "topic"}, "the blues")
    assert (kind, context) == ("persona", "I am a chef.")
    assert contexts == {"kind": "persona", "topic": "the blues", "persona": "I am a chef."}
    assert tuple(generation) == ("faithful", 6, True, 0.7, 0.9, 64, 1234)
    assert ChatSettings(**written) == CHEF  # what the chat's next save stores, unless a reply changes it


def test_recording_notes_the_settings_a_reply_was_written_with():
    calls = []

    def respond(message, history, *inputs):
        calls.append(inputs)
        yield "hel", "meter", "banner", {}
        yield "hello", "meter", "banner", {1: "record"}

    chat = saved_chats.recording(respond)
    inputs = (*JAZZ.values(), {})
    outputs = list(chat("hi", [], *inputs))
    assert calls == [inputs]
    assert [o[:-1] for o in outputs] == [("hel", "meter", "banner", {}), ("hello", "meter", "banner", {1: "record"})]
    assert all(ChatSettings(**o[-1]) == JAZZ for o in outputs)
    # A control's odd value is noted as the default (the chat function refuses it itself).
    (output,) = list(saved_chats.recording(lambda *a: iter([("x",)]))("hi", [], "villain", *JAZZ.values()[1:], {}))
    assert ChatSettings(**output[-1]).kind == "persona"


def test_the_store_is_bounded_and_drops_what_is_not_saved():
    saved = [chat(f"message {i}", "reply") for i in range(saved_chats.MAX_SAVED + 20)]
    store = {saved_chats.fingerprint(c): {"kind": "none"} for c in saved}
    store |= {f"stale-{i}": {"kind": "none"} for i in range(50)} | {"x" * 10_000: {}}
    kept = saved_chats.remember(store, None, saved, JAZZ)
    assert list(kept) == [saved_chats.fingerprint(c) for c in saved[: saved_chats.MAX_SAVED]]
    # Only the newest are kept, and a conversation id past them stores nothing.
    assert saved_chats.remember({}, saved_chats.MAX_SAVED + 5, saved, JAZZ) == {}
    for junk_store, junk_saved, junk_id in (("x", None, 0), ({}, "not a list", 0), ({}, saved, True), ({}, saved, "0")):
        assert saved_chats.remember(junk_store, junk_id, junk_saved, JAZZ) == {}
    assert saved_chats.remember([], 0, saved, JAZZ) == {saved_chats.fingerprint(saved[0]): asdict(JAZZ)}


def test_fingerprints_ignore_key_order_and_tell_chats_apart():
    a = chat("hi", "hello")
    assert saved_chats.fingerprint(a) == saved_chats.fingerprint(browser(a))
    reordered = [dict(reversed(list(m.items()))) for m in a]
    assert saved_chats.fingerprint(reordered) == saved_chats.fingerprint(a)
    assert saved_chats.fingerprint(chat("hi", "hello!")) != saved_chats.fingerprint(a)
    assert saved_chats.fingerprint(chat("\ud800 lone surrogate")) is not None
    assert [saved_chats.fingerprint(x) for x in ([], None, "hi", {"role": "user"})] == [None] * 4


@pytest.mark.parametrize(
    ("record", "expected"),
    [
        ({"kind": "villain", "context": "<script>alert(1)</script>"}, ChatSettings()),  # unknown kind: defaults
        ({"kind": ["topic"], "preset": ["fast"], "sample": "yes"}, ChatSettings()),  # wrong types
        ({"kind": "topic", "context": "x" * (MAX_CONTEXT_CHARS + 1)}, ChatSettings("topic", "jazz")),
        ({"kind": "topic", "context": 42}, ChatSettings("topic", "jazz")),
        ({"kind": "none", "context": "ignored"}, ChatSettings("none", "")),
        ({"kind": "emotion", "context": "hopeful"}, ChatSettings("emotion", "hopeful")),
        # out of a slider's range, NaN, a bool or a string for a number: the preset's value
        (
            {"preset": "faithful", "beams": 99, "temperature": math.nan, "top_p": True, "max_new_tokens": "64"},
            ChatSettings("persona", chat_handlers.CHAT_E_PERSONA, "faithful", *chat_handlers.preset_values("faithful")),
        ),
        ({"beams": 2.5, "seed": -1, "top_p": 0.0}, ChatSettings()),
        ({"seed": chat_handlers.SEED_MAX + 1}, ChatSettings()),
        ({"beams": 4.0, "seed": chat_handlers.SEED_MAX, "sample": True, "top_p": 0.5}, None),
        ("not a record", ChatSettings()),
    ],
)
def test_stored_records_are_checked_field_by_field(record, expected):
    settings = saved_chats.checked(record)
    if expected is None:  # all valid: kept as given
        assert (settings.beams, settings.seed, settings.sample, settings.top_p) == (
            4,
            chat_handlers.SEED_MAX,
            True,
            0.5,
        )
        assert isinstance(settings.beams, int)
    else:
        assert settings == expected


JSON = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=20),
    lambda children: st.lists(children, max_size=4) | st.dictionaries(st.text(max_size=8), children, max_size=4),
    max_leaves=12,
)
FIELD = st.sampled_from(
    ["kind", "context", "preset", "beams", "sample", "temperature", "top_p", "max_new_tokens", "seed"]
)


@given(st.dictionaries(FIELD, JSON | st.sampled_from(["topic", "faithful", "none", 3, 0.5]), max_size=9))
def test_any_stored_record_gives_values_every_control_accepts(record):
    settings = saved_chats.checked(record)
    assert settings.kind in dict(chat_handlers.KIND_CHOICES).values()
    assert isinstance(settings.context, str) and len(settings.context) <= MAX_CONTEXT_CHARS
    for name, (low, high, _) in saved_chats.RANGES.items():
        assert low <= getattr(settings, name) <= high
    assert isinstance(settings.sample, bool) and 0 <= settings.seed <= chat_handlers.SEED_MAX
    # and the chat function takes them as they are
    chat_handlers.settings_from_inputs(*settings.values()[2:])


def test_the_chat_tab_stores_on_every_save_and_restores_on_opening_a_saved_chat(demo_app):
    demo, chat = demo_app
    config = demo.get_config_file()
    by_id = {c["id"]: c for c in config["components"]}
    labels = {c["id"]: c["props"].get("label") for c in config["components"]}

    def events(target, event):
        return [d for d in config["dependencies"] if [target, event] in [list(t) for t in d["targets"]]]

    # Beside ChatInterface's own refresh of the list (and the page's mark of the open chat), one event
    # stores the settings in the browser.
    changes = events(chat.saved_conversations._id, "change")
    (store_event,) = [d for d in changes if any(by_id[o]["type"] == "browserstate" for o in d["outputs"])]
    (store,) = store_event["outputs"]
    assert by_id[store]["props"]["storage_key"] == saved_chats.STORAGE_KEY
    restore = [d for d in events(chat.chat_history_dataset._id, "click") if store in d["inputs"]]
    assert len(restore) == 1
    restored = [labels[o] for o in restore[0]["outputs"]]
    for label in ("The bot has a…", "Persona", "Preset", "Beams", "Sampling", "Temperature (with sampling)"):
        assert label in restored
    # New chat resets the meter and keeps the settings as they are.
    new_chat = {o for d in events(chat.new_chat_button._id, "click") for o in d["outputs"]}
    assert "token-meter" in {by_id[o]["props"].get("elem_id") for o in new_chat}
    *controls, written = restore[0]["outputs"][3:]
    assert not new_chat & set(controls) and written in new_chat  # (what the next reply was written with)
    # A restored preset must not reset the restored beams: the preset fills the sliders on input only.
    preset = next(o for o in restore[0]["outputs"] if labels[o] == "Preset")
    assert events(preset, "input") and not events(preset, "change")


@pytest.fixture(scope="module")
def demo_app():
    import app
    from chat.engine import DEMO_DIR, ChatEngine, load_checkpoint

    demo = app.build_demo(ChatEngine(load_checkpoint(str(DEMO_DIR), optimize="none"), "serving demo"))
    return demo, demo.chat_interface
