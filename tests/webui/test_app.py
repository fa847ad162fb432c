"""The web app: webui/chat_handlers.py's functions, the README's Space front matter, and the launched app
through gradio_client (the bundled demo model, offline, on 127.0.0.1), plus ``python app.py``
started as users start it.

Nothing is mocked: replies come from the real demo model. Where a test must see that no model
call happened, it wraps the real ``generate`` with a counting wrapper.
"""

from __future__ import annotations

import itertools
import json
import os
import shutil
import subprocess
import sys
import threading
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import gradio as gr
import pytest
from gradio_client import Client
from gradio_client.exceptions import AppError

from chat.engine import (
    DEMO_DIR,
    GENERATION_PRESETS,
    MAX_HISTORY_TURNS,
    Budget,
    ChatEngine,
    Conversation,
    GenerationSettings,
    InputError,
    load_checkpoint,
)
from chat.layout import ROOT
from chat.prompt import EMOTIONS, KINDS
from finetune.jobs.command import free_port
from webui import chat_handlers, saved_chats

HELLO = "hi! tell me about yourself."
CONTEXTS = {
    "persona": chat_handlers.CHAT_E_PERSONA,
    "emotion": "joyful",
    "task": "vacation ideas",
    "topic": "jazz",
    "none": "",
}


# --------------------------------------------------------------------------- fixtures


@pytest.fixture(scope="module")
def demo_model():
    # fp32 as trained, whatever CHAT_OPTIMIZE says: the tests compare batched replies with single
    # ones, which int8 dynamic quantization does not keep equal (see tests/test_chat.py).
    return load_checkpoint(str(DEMO_DIR), optimize="none")


@pytest.fixture(scope="module")
def engine(demo_model):
    return ChatEngine(demo_model, "offline: using the demo model (a tiny BlenderBot) instead of facebook/x")


@pytest.fixture
def fresh_engine(demo_model):
    """An engine of its own (for swaps and call counting)."""
    return ChatEngine(demo_model, f"serving {DEMO_DIR}")


@pytest.fixture(scope="module")
def server(engine, tmp_path_factory):
    """The app around the demo engine, launched in-process; yields its URL."""
    import app

    saved = os.environ.get("PERSONA_CHAT_RUNS")
    os.environ["PERSONA_CHAT_RUNS"] = str(tmp_path_factory.mktemp("no-runs"))
    demo = app.build_demo(engine)
    _, url, _ = demo.launch(server_name="127.0.0.1", server_port=free_port(), prevent_thread_lock=True, quiet=True)
    yield url
    demo.close()
    if saved is None:
        os.environ.pop("PERSONA_CHAT_RUNS", None)
    else:
        os.environ["PERSONA_CHAT_RUNS"] = saved


@pytest.fixture(scope="module")
def client(server):
    return Client(server, verbose=False)


def model_calls(engine, monkeypatch) -> list:
    """Count the replies the engine's model starts: its encoder runs once per reply, whichever
    scheduler decodes (generate() or chat.stepping's steps); the real encoder still runs."""
    encoder = engine.current.model.get_encoder()
    real, calls = encoder.forward, []

    def counting(*args, **kwargs):
        calls.append(1)
        return real(*args, **kwargs)

    monkeypatch.setattr(encoder, "forward", counting)
    return calls


# --------------------------------------------------------------------------- webui/chat_handlers.py


def test_kind_choices_send_kinds_values():
    assert [value for _, value in chat_handlers.KIND_CHOICES] == list(KINDS)
    assert [label for label, _ in chat_handlers.KIND_CHOICES] == ["Persona", "Emotion", "Task goal", "Topic", "None"]


def test_examples_cover_every_kind_with_chat_e_contexts():
    assert sorted({kind for _, kind, _ in chat_handlers.EXAMPLES}) == sorted(KINDS)
    contexts = {kind: context for _, kind, context in chat_handlers.EXAMPLES}
    assert contexts["persona"] == "My name is Chat-E. I'm helpful, creative, clever, sarcastic and very friendly."
    assert contexts["emotion"] in EMOTIONS and contexts["task"] == "vacation ideas"


def test_history_to_turns_plain_and_gradio_normalized():
    plain = [
        {"role": "user", "content": "hi"},
        {"role": "assistant", "content": "hello!"},
        {"role": "user", "content": "how are you?"},
        {"role": "assistant", "content": "fine."},
    ]
    assert chat_handlers.history_to_turns(plain) == ["hi", "hello!", "how are you?", "fine."]
    # What gr.Chatbot's preprocess hands over: content is a list of parts, metadata present.
    normalized = [
        {"role": m["role"], "metadata": None, "options": None, "content": [{"type": "text", "text": m["content"]}]}
        for m in plain
    ]
    assert chat_handlers.history_to_turns(normalized) == chat_handlers.history_to_turns(plain)
    assert chat_handlers.history_to_turns([]) == [] and chat_handlers.history_to_turns(None) == []


def test_oversized_history_is_refused_before_any_work(engine):
    history = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}] * (MAX_HISTORY_TURNS + 1)
    with pytest.raises(InputError, match="too long"):
        chat_handlers.history_to_turns(history)
    # The browser chat shows it as a notice; nothing reaches the model.
    replies = list(chat_handlers.chat_fn(engine)(HELLO, history, "none", ""))
    assert chat_handlers.is_notice(replies[-1][0]) and "too long" in replies[-1][0]["metadata"]["title"]
    with pytest.raises(gr.Error, match="too long"):
        list(chat_handlers.api_chat_fn(engine)(HELLO, "none", "", "fast", ["hi", "hello"] * MAX_HISTORY_TURNS))


def test_lone_surrogates_in_api_input_get_a_reply(engine):
    chat = chat_handlers.api_chat_fn(engine)
    replies = list(chat("hi \ud800 there", "persona", "i like \udc00 tea", "fast", ["a \ud83d", "b"]))
    assert replies and isinstance(replies[-1][0], str) and replies[-1][1] == engine.current.id


def test_history_to_turns_keeps_the_dialogue_alternating():
    history = [
        {"role": "system", "content": "ignored"},
        {"role": "assistant", "content": "Hello, I'm Chat-E!"},  # the bot spoke first
        {"role": "user", "content": ""},
        chat_handlers.notice("Type a message first."),  # refused: neither side is a turn
        {"role": "user", "content": "never answered (stopped)"},
        {"role": "user", "content": "  what  is\nup? "},
        {"role": "assistant", "content": "not much."},
        {"role": "assistant", "content": [{"type": "text", "text": "you?"}, {"type": "file", "file": {"path": "x"}}]},
        {"role": "user", "content": "too long " * 200},
        chat_handlers.notice("The message is too long."),
    ]
    assert chat_handlers.history_to_turns(history) == ["Hello, I'm Chat-E!", "what is up?", "not much. you?"]


def test_settings_from_inputs_presets_and_overrides():
    for name, preset in GENERATION_PRESETS.items():
        assert chat_handlers.settings_from_inputs(name, *chat_handlers.preset_values(name), 0) == preset
    s = chat_handlers.settings_from_inputs("faithful", 4, True, 0.5, 0.8, 10, 42)
    assert (s.num_beams, s.do_sample, s.temperature, s.top_p, s.max_new_tokens, s.seed) == (4, True, 0.5, 0.8, 10, 42)
    assert s.min_new_tokens == 10  # faithful's minimum of 20 gives way to a max of 10
    assert s.encoder_no_repeat_ngram_size == GENERATION_PRESETS["faithful"].encoder_no_repeat_ngram_size
    assert chat_handlers.settings_from_inputs("fast", 1, False, 0.7, 0.9, 40, None).seed is None
    assert chat_handlers.settings_from_inputs("fast", 1.0, False, 0.7, 0.9, 40.0, 3.0) == GenerationSettings(
        **{**GENERATION_PRESETS["fast"].__dict__, "seed": 3}
    )


@pytest.mark.parametrize(
    "args",
    [
        ("slow", 1, False, 0.7, 0.9, 40, 0),
        ("fast", 0, False, 0.7, 0.9, 40, 0),
        ("fast", 1, False, 0.7, 0.9, 500, 0),
        ("fast", 1, True, 9.0, 0.9, 40, 0),
        ("fast", 1, False, 0.7, 0.9, 40, -1),
        ("fast", "x", False, 0.7, 0.9, 40, 0),
    ],
)
def test_settings_from_inputs_refuses_bad_values(args):
    with pytest.raises(InputError):
        chat_handlers.settings_from_inputs(*args)


def test_settings_from_api():
    assert chat_handlers.settings_from_api() == GENERATION_PRESETS["fast"]
    s = chat_handlers.settings_from_api("faithful", {"num_beams": 2, "max_new_tokens": 8, "seed": 0})
    assert (s.num_beams, s.max_new_tokens, s.min_new_tokens, s.seed) == (2, 8, 8, None)
    assert chat_handlers.settings_from_api("fast", {"temperature": 1, "do_sample": True, "seed": 7.0}).seed == 7
    for preset, overrides in [
        ("fast", {"beams": 2}),
        ("nope", None),
        ("fast", {"num_beams": "many"}),
        ("fast", {"top_p": 3}),
        ("fast", {"num_beams": 2.5}),
        ("fast", {"do_sample": 1}),
        ("fast", {"seed": "abc"}),
        ("fast", {"seed": -3}),
        ("fast", {"seed": True}),
        ("fast", ["num_beams", 2]),
    ]:
        with pytest.raises(InputError):
            chat_handlers.settings_from_api(preset, overrides)


def test_meter_text():
    assert (
        chat_handlers.meter_text(Budget(12, 30, 42, 128, 0))
        == "context 12 + history 30 = 42 / 128 tokens; 0 old turns dropped"
    )
    assert chat_handlers.meter_text(Budget(20, 108, 128, 128, 1)).endswith("128 / 128 tokens; 1 old turn dropped")
    assert "after the first reply" in chat_handlers.meter_text(None)


def make_final(root: Path, name: str, mtime: float, bleu: float | None = None, complete: bool = True) -> Path:
    final = root / name / "final"
    final.mkdir(parents=True)
    (final / "config.json").write_text("{}")
    if complete:
        (final / "model.safetensors").write_bytes(b"")
    if bleu is not None:
        (final / "all_results.json").write_text(json.dumps({"eval_bleu": bleu}))
    for p in (final / "config.json", final):
        os.utime(p, (mtime, mtime))
    return final


def test_model_choices_lists_base_demo_and_finished_runs_newest_first(tmp_path):
    old = make_final(tmp_path, "old", 1_000_000, bleu=7.06)
    new = make_final(tmp_path, "new", 2_000_000)
    make_final(tmp_path, "crashed", 3_000_000, complete=False)
    (tmp_path / "running" / "checkpoints").mkdir(parents=True)
    choices = chat_handlers.picker_choices(tmp_path, base="facebook/blenderbot-400M-distill")
    assert [spec for _, spec in choices] == ["facebook/blenderbot-400M-distill", str(DEMO_DIR), str(new), str(old)]
    labels = [label for label, _ in choices]
    assert labels[0] == "facebook/blenderbot-400M-distill (base model)" and labels[1].startswith("demo model")
    assert labels[3].startswith("old/final · BLEU 7.1 · ")
    # A model being served that is none of those (a Hub id typed by a user) is listed first.
    served = chat_handlers.picker_choices(tmp_path, base="b/base", current="user/other")
    assert served[0] == ("user/other (serving)", "user/other") and len(served) == 5
    assert chat_handlers.picker_choices(tmp_path / "missing", base="b/base", current=str(DEMO_DIR)) == [
        ("b/base (base model)", "b/base"),
        (f"demo model (tiny, bundled) · BLEU {chat_handlers.model_bleu(str(DEMO_DIR)):.1f}", str(DEMO_DIR)),
    ]


def test_model_choices_default_base_and_runs_root_from_env(tmp_path, monkeypatch):
    new = make_final(tmp_path, "r1", 2_000_000)
    monkeypatch.setenv("PERSONA_CHAT_RUNS", str(tmp_path))
    monkeypatch.setenv("CHAT_MODEL", "me/chat")
    assert [spec for _, spec in chat_handlers.picker_choices()] == ["me/chat", str(DEMO_DIR), str(new)]
    monkeypatch.delenv("CHAT_MODEL")
    assert chat_handlers.picker_choices()[0][1] == "facebook/blenderbot-400M-distill"


def test_spec_to_load():
    choices = chat_handlers.picker_choices(base="b/base")
    assert chat_handlers.spec_to_load(str(DEMO_DIR), "  ", choices) == str(DEMO_DIR)
    assert chat_handlers.spec_to_load(str(DEMO_DIR), " user/my-model ", choices) == "user/my-model"
    for hub_id in ["/etc", "../x/y", "a/b/c", "user/../x", "no-slash"]:
        with pytest.raises(InputError, match="not a Hub model id"):
            chat_handlers.spec_to_load(None, hub_id, choices)
    with pytest.raises(InputError):
        chat_handlers.spec_to_load(None, "", choices)
    # A relative folder shaped like a Hub id, and a picker value the list never offered.
    with pytest.raises(InputError, match="is a folder on this server"):
        chat_handlers.spec_to_load(None, "chat/demo_model", choices)
    for forged in ["/etc", str(ROOT / "chat"), "tiny"]:
        with pytest.raises(InputError, match="not in the list"):
            chat_handlers.spec_to_load(forged, "", choices)


def test_status_markdown(engine, fresh_engine):
    offline = chat_handlers.serving_markdown(engine)
    assert offline.startswith("⚠️ **Offline: using the demo model (a tiny BlenderBot) instead of facebook/x.**")
    assert chat_handlers.serving_markdown(fresh_engine).startswith("✅ **Serving demo model (tiny, bundled)**")
    assert "up to 128 tokens" in offline and "`chatbot:`" in offline


def test_chat_fn_streams_reply_and_meter(engine):
    respond = chat_handlers.chat_fn(engine)
    history = [{"role": "user", "content": "hello"}, {"role": "assistant", "content": "hi! how are you?"}]
    out = list(
        respond(HELLO, history, "persona", "i love dogs.", "fast", *chat_handlers.preset_values("fast")[:4], 40, 0)
    )
    texts = [t for t, _ in out]
    assert texts[-1] and all(b.startswith(a) for a, b in itertools.pairwise(texts))  # it streams
    expected, budget = engine.reply(Conversation("persona", "i love dogs.", ["hello", "hi! how are you?"]), HELLO)
    assert texts[-1] == expected
    assert out[-1][1] == chat_handlers.meter_text(budget) and budget.history_tokens > 0


def test_chat_fn_refuses_bad_input_without_model_call(fresh_engine, monkeypatch):
    calls = model_calls(fresh_engine, monkeypatch)
    respond = chat_handlers.chat_fn(fresh_engine)
    titles = []
    for message, kind, context, seed in [
        ("", "none", "", 0),
        ("   ", "persona", "x", 0),
        ("hi", "persona", "", 0),
        ("x" * 1001, "none", "", 0),
        ("hi", "nope", "", 0),
        ("hi", "none", "", -5),
    ]:
        with pytest.warns(UserWarning):  # gr.Warning outside a request becomes a Python warning
            ((reply, meter),) = list(respond(message, [], kind, context, "fast", 1, False, 0.7, 0.9, 40, seed))
        assert chat_handlers.is_notice(reply) and reply["metadata"]["title"].startswith("⚠️ ")
        assert meter == gr.skip()
        titles.append(reply["metadata"]["title"])
    assert titles[:4] == [
        "⚠️ Type a message first.",
        "⚠️ Type a message first.",
        "⚠️ The persona needs a context (e.g. a persona sentence).",
        "⚠️ The message is too long (1001 characters; the limit is 1000).",
    ]
    assert calls == []
    list(respond("ok", [], "none", "", "fast", 1, False, 0.7, 0.9, 40, 0))
    assert calls == [1]


def test_load_model_keeps_serving_on_failure(fresh_engine, tiny_path, tmp_path):
    before = fresh_engine.current
    runs = tmp_path / "runs"
    broken = runs / "broken" / "final"  # listed (config and weights present), but the weights are garbage
    broken.mkdir(parents=True)
    (broken / "config.json").write_text("{}")
    (broken / "model.safetensors").write_bytes(b"not safetensors")
    good = runs / "good" / "final"
    shutil.copytree(tiny_path, good)
    for choice, hub in [(str(broken), ""), (None, "not a hub id"), (str(tmp_path / "nothing"), "")]:
        steps = list(chat_handlers.load_model(fresh_engine, choice, hub, runs))
        note, pending = steps[-1]
        assert note.startswith("⚠️ ") and pending is None
        assert any(why in note for why in ("Could not load", "not a Hub model id", "Pick a model", "not in the list"))
        assert fresh_engine.current is before
    steps = list(chat_handlers.load_model(fresh_engine, str(good), "", runs))  # no saved BLEU: no warning
    assert steps[0][0].startswith("⏳ Loading")
    assert fresh_engine.current is not before and fresh_engine.status == f"serving {good}"
    assert steps[-1] == ("✅ Now serving good/final.", None)  # the run's name, not the server's path


def test_a_worse_model_needs_a_second_load(fresh_engine, tiny_path, tmp_path):
    """A run that scored less than the serving demo model, measured the same way, is loaded only when
    asked twice; one measured another way is not compared (finetune.measure)."""
    runs = tmp_path / "runs"
    weak = runs / "weak" / "final"
    shutil.copytree(tiny_path, weak)
    demo = json.loads((DEMO_DIR / "all_results.json").read_text())
    (weak / "all_results.json").write_text(json.dumps({"eval_bleu": 1.7, "eval_measure": demo["eval_measure"]}))
    labels = dict((spec, label) for label, spec in chat_handlers.picker_choices(runs, base="b/base"))
    served = f"{demo['eval_bleu']:.1f}"
    assert "BLEU 1.7" in labels[str(weak)] and f"BLEU {served}" in labels[str(DEMO_DIR)]  # every local model's
    before = fresh_engine.current
    ((note, pending),) = list(chat_handlers.load_model(fresh_engine, str(weak), "", runs))
    assert "BLEU 1.7" in note and f"below the serving model's {served}" in note and pending == str(weak)
    assert "(both on all of the sample's validation split; beams 4, length 20-64" in note
    assert fresh_engine.current is before
    steps = list(chat_handlers.load_model(fresh_engine, str(weak), "", runs, confirmed=pending))
    assert steps[-1][0].startswith("✅ Now serving") and fresh_engine.current.name == str(weak)
    # Measured another way (a minimum length of 1): not compared, loaded at once, and said so.
    fresh_engine.swap(str(DEMO_DIR))
    other = {**demo["eval_measure"], "val_min_target_length": 1}
    (weak / "all_results.json").write_text(json.dumps({"eval_bleu": 1.7, "eval_measure": other}))
    labels = dict((spec, label) for label, spec in chat_handlers.picker_choices(runs, current=str(DEMO_DIR)))
    assert labels[str(weak)].startswith("weak/final · BLEU 1.7 (measured otherwise) · ")
    steps = list(chat_handlers.load_model(fresh_engine, str(weak), "", runs))
    assert steps[-1][0].startswith("✅ Now serving weak/final. (Its BLEU 1.7 and the previous model's")
    assert "measured differently" in steps[-1][0] and fresh_engine.current.name == str(weak)


# --------------------------------------------------------------------------- app.py and README


def test_importing_app_loads_no_model():
    import app

    assert app._demo is None  # app.demo is built (and the engine started) on first access only


def test_blocks_wiring(engine):
    import app

    demo = app.build_demo(engine)
    chat = demo.chat_interface
    assert isinstance(chat, gr.ChatInterface)
    labels = [c.label for c in chat.additional_inputs]
    assert labels[:3] == ["The bot has a…", "Persona", "Preset"]
    assert chat.additional_inputs[0].choices == [tuple(c) for c in chat_handlers.KIND_CHOICES]
    assert chat.cache_examples is False and chat.api_visibility == "private"
    # The examples are the chatbot's (a click sets the kind and context, then sends: chat_tab.SEND_JS),
    # not ChatInterface's, whose click sent the message with the kind and context the page had before.
    assert not chat.examples_messages and not chat._additional_inputs_in_examples
    assert [e["display_text"] for e in chat.chatbot.examples] == chat_handlers.EXAMPLE_LABELS
    assert [e["text"] for e in chat.chatbot.examples] == [m for m, _, _ in chat_handlers.EXAMPLES]
    assert chat.textbox.label == "Message" and chat.textbox.elem_id == "chat-input"
    public = [d for d in demo.fns.values() if d.api_visibility == "public"]
    assert [d.api_name for d in public] == ["chat"]
    assert demo._queue.max_size == app.QUEUE_MAX_SIZE == 64
    assert demo._queue.default_concurrency_limit == app.CONCURRENCY == 16
    tabs = [b.label for b in demo.blocks.values() if isinstance(b, gr.Tab)]
    assert tabs == ["Chat", "Compare", "Train"]


def test_the_launched_queue_runs_many_replies_at_once_and_keeps_no_dashboard(engine, tmp_path, monkeypatch):
    """gradio runs at most ``max_threads`` events at once (its queue's job slots, and the thread
    pool its sync generators step in), 40 unless launched with more: fewer than the 64 replies the
    app runs at once on a GPU. Launched with the app's options, it has room for CONCURRENCY
    replies and gradio's 40 for the rest; its monitoring dashboard is off (its summary is no one
    else's business), and the queue no longer recomputes that summary after every event."""
    import httpx

    import app

    monkeypatch.setenv("PERSONA_CHAT_RUNS", str(tmp_path))
    demo = app.build_demo(engine)
    options = app.launch_options(engine, behind_proxy=False)
    _, url, _ = demo.launch(
        server_name="127.0.0.1", server_port=free_port(), prevent_thread_lock=True, quiet=True, **options
    )
    try:
        slots = app.CONCURRENCY + 40
        assert demo.max_threads == slots and len(demo._queue.active_jobs) == slots
        assert demo.limiter.total_tokens == slots  # the pool each next() of a streamed reply waits in
        reply, _ = Client(url, verbose=False).predict("hello there", "none", "", "fast", [], {}, api_name="/chat")
        assert reply.strip()
        assert demo._queue.events_recorded >= 1  # the call went through the queue...
        assert demo._queue.cached_event_analytics_summary == {"functions": {}}  # ...and no summary was made
        for path in ("monitoring", "monitoring/summary"):
            assert httpx.get(url + path).status_code == 403
    finally:
        demo.close()


def test_chat_interface_round_trip_keeps_the_dialogue(engine):
    """Through ChatInterface's own streaming wrapper and the Chatbot's postprocess/preprocess (what
    the browser gets and sends back): replies and notices land in the history, and the next
    request sees only the real turns."""
    import asyncio

    import app

    chat = app.build_demo(engine).chat_interface
    inputs = ["persona", "i love dogs.", "fast", *chat_handlers.preset_values("fast")[:4], 40, 0]

    # the page's reply records (webui/feedback_handlers.py): the chat's last input, and the output
    # before the settings the reply was written with (webui/saved_chats.py)
    replies = {}

    async def send(message, history):
        nonlocal replies
        outputs = [out async for out in chat._stream_fn(message, history, *inputs, replies)]
        *out, replies, written = outputs[-1]
        assert saved_chats.ChatSettings(**written).values() == (*inputs, 0)[:9]  # what a saved chat restores
        return out

    def browser(history):
        return chat.chatbot.preprocess(chat.chatbot.postprocess(history))

    reply, history, meter, banner = asyncio.run(send("hi there", []))
    assert reply == engine.reply(Conversation("persona", "i love dogs."), "hi there")[0]
    assert banner == chat_handlers.serving_markdown(engine)  # the page's banner follows the model that answered
    assert meter.startswith("context ") and meter.endswith("0 old turns dropped")
    with pytest.warns(UserWarning, match="Type a message first"):
        refused, history, meter, _ = asyncio.run(send("  ", browser(history)))
    assert chat_handlers.is_notice(refused) and meter == gr.skip()
    reply2, history, *_ = asyncio.run(send("do you have pets?", browser(history)))
    assert chat_handlers.history_to_turns(browser(history)) == ["hi there", reply, "do you have pets?", reply2]
    # Each reply's record sits at its message's index in the history ChatInterface keeps.
    assert {i: chat_handlers.history_to_turns(history[: i + 1])[-1] for i in replies} == {1: reply, 5: reply2}
    assert reply2 == engine.reply(Conversation("persona", "i love dogs.", ["hi there", reply]), "do you have pets?")[0]


def test_readme_front_matter_describes_a_gradio_space():
    from huggingface_hub import RepoCard, metadata_load

    readme = ROOT / "README.md"
    assert readme.read_text().startswith("---\n")
    meta = metadata_load(readme)
    assert meta["sdk"] == "gradio" and meta["app_file"] == "app.py"
    assert meta["sdk_version"] == gr.__version__
    assert str(meta["python_version"]) == "3.11" and meta["pinned"] is False
    assert {"title", "emoji", "colorFrom", "colorTo"} <= set(meta)
    card = RepoCard.load(readme, repo_type="space")
    assert card.data.sdk == "gradio" and card.data.app_file == "app.py"
    assert "## Chat app" in card.text and "### API" in card.text and "# persona-chat" in card.text


# --------------------------------------------------------------------------- through gradio_client


def test_api_signature(client):
    info = client.view_api(return_format="dict", print_info=False)["named_endpoints"]
    assert list(info) == ["/chat"]
    params = [
        (p["parameter_name"], p["parameter_has_default"], p["parameter_default"]) for p in info["/chat"]["parameters"]
    ]
    assert params == [
        ("message", False, None),
        ("kind", True, "none"),
        ("context", True, ""),
        ("preset", True, "fast"),
        ("history", True, None),
        ("settings", True, None),
        ("model", True, ""),
    ]


def test_every_kind_replies_through_the_api(client, engine):
    answers = {kind: client.predict(HELLO, kind, CONTEXTS[kind], api_name="/chat") for kind in KINDS}
    assert {model for _, model in answers.values()} == {engine.current.id}  # the model that wrote each reply
    replies = {kind: reply for kind, (reply, _) in answers.items()}
    for kind, reply in replies.items():
        assert isinstance(reply, str) and reply.strip()
        assert reply == engine.reply(Conversation(kind, CONTEXTS[kind]), HELLO)[0]  # greedy, "fast" defaults
    assert replies["persona"] != replies["emotion"]
    # Chat-E's emotion was "happy", not one of the 32 labels: still accepted as a custom value.
    assert client.predict(HELLO, "emotion", "happy", api_name="/chat")[0].strip()


def test_api_streams_and_takes_settings(client, engine):
    job = client.submit(HELLO, "topic", "jazz", api_name="/chat")
    final = job.result()
    outputs = job.outputs()
    assert len(outputs) > 1 and tuple(outputs[-1]) == tuple(final)
    assert {model for _, model in outputs} == {engine.current.id}
    assert all(b.startswith(a) for (a, _), (b, _) in itertools.pairwise(outputs))
    beam, _ = client.predict(
        HELLO, "topic", "jazz", preset="faithful", settings={"num_beams": 3, "max_new_tokens": 12}, api_name="/chat"
    )
    expected = engine.reply(
        Conversation("topic", "jazz"),
        HELLO,
        chat_handlers.settings_from_api("faithful", {"num_beams": 3, "max_new_tokens": 12}),
    )[0]
    assert beam == expected


CONV_A = ("persona", "i love dogs.", ["hi!", "do you have pets?", "what is your favourite food?"])
CONV_B = ("emotion", "sad", ["hello.", "my cat ran away.", "what should i do?"])


def run_conversation(client, kind, context, messages, step=None):
    """Chat through the stateless API, carrying the history; ``step`` runs between turns."""
    history = []
    for message in messages:
        reply, _ = client.predict(message, kind, context, history=history, api_name="/chat")
        history = [*history, message, reply]
        if step:
            step()
    return history


def test_two_clients_conversations_stay_apart(server):
    """/chat is stateless by design: interleaving two clients' conversations, turn by turn or
    concurrently, gives exactly the replies each gets alone."""
    alone_a = run_conversation(Client(server, verbose=False), *CONV_A)
    alone_b = run_conversation(Client(server, verbose=False), *CONV_B)
    assert alone_a[1::2] != alone_b[1::2]

    client_a, client_b = Client(server, verbose=False), Client(server, verbose=False)
    b_history, b_messages = [], iter(CONV_B[2])

    def b_turn():  # one turn of B after each turn of A
        message = next(b_messages)
        reply, _ = client_b.predict(message, *CONV_B[:2], history=list(b_history), api_name="/chat")
        b_history.extend([message, reply])

    assert run_conversation(client_a, *CONV_A, step=b_turn) == alone_a
    assert b_history == alone_b

    with ThreadPoolExecutor(max_workers=2) as pool:
        together = list(pool.map(lambda conv: run_conversation(Client(server, verbose=False), *conv), [CONV_A, CONV_B]))
    assert together == [alone_a, alone_b]


@pytest.mark.parametrize("message", ["", "   ", "<s> </s>"])
def test_empty_message_gives_the_friendly_error(client, message):
    with pytest.raises(AppError, match="Type a message first."):
        client.predict(message, "persona", chat_handlers.CHAT_E_PERSONA, api_name="/chat")
    assert client.predict("still there?", "none", "", api_name="/chat")[0].strip()  # the app keeps serving


@pytest.mark.parametrize(
    "args, kwargs, error",
    [
        (("hi", "persona", ""), {}, "needs a context"),
        (("hi", "villain", "x"), {}, "Unknown kind"),
        (("x" * 1001, "none", ""), {}, "too long"),
        (("hi", "none", ""), {"preset": "slow"}, "Unknown preset"),
        (("hi", "none", ""), {"settings": {"beams": 3}}, "Unknown settings"),
        (("hi", "none", ""), {"history": "hi"}, "history must be a list"),
        (("hi", "none", ""), {"settings": {"seed": "abc"}}, "seed must be an integer"),
        # Refused by generate() (until GenerationSettings checks it): a readable error either way, no hang.
        (("hi", "none", ""), {"settings": {"repetition_penalty": -1.0}}, "(?i)penalty"),
    ],
)
def test_refused_input_is_explained(client, args, kwargs, error):
    with pytest.raises(AppError, match=error):
        client.predict(*args, **kwargs, api_name="/chat")


def test_page_and_config_show_the_offline_notice(server):
    html = urllib.request.urlopen(server, timeout=10).read().decode()
    assert "Chat-E" in html
    config = json.loads(urllib.request.urlopen(server.rstrip("/") + "/config", timeout=10).read())
    values = [c.get("props", {}).get("value") for c in config["components"]]
    assert any(isinstance(v, str) and v.startswith("⚠️ **Offline: using the demo model") for v in values)


# --------------------------------------------------------------------------- python app.py


def start_app_py(tmp_path, **env_changes) -> tuple[float, list[str]]:
    """``python app.py`` as the README says (CHAT_MODEL unset, an empty HF cache): seconds until
    it serves the demo model with its notice and answers /chat, and what it printed."""
    port = free_port()
    env = {k: v for k, v in os.environ.items() if k not in ("CHAT_MODEL", "PERSONA_CHAT_RUNS", "HF_HUB_OFFLINE")}
    env.update(
        HF_HOME=str(tmp_path / "hf"),
        PERSONA_CHAT_STATE=str(tmp_path / "state"),  # a first start: no key, no model chosen before
        GRADIO_SERVER_NAME="127.0.0.1",
        GRADIO_SERVER_PORT=str(port),
        GRADIO_ANALYTICS_ENABLED="False",
        PYTHONUNBUFFERED="1",
        **env_changes,
    )
    started = time.perf_counter()
    proc = subprocess.Popen(
        [sys.executable, "app.py"], cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
    )
    lines: list[str] = []
    threading.Thread(target=lambda: lines.extend(proc.stdout), daemon=True).start()
    url = f"http://127.0.0.1:{port}/"
    try:
        while True:
            assert proc.poll() is None, "app.py exited:\n" + "".join(lines)
            assert time.perf_counter() - started < 60, "not ready within 60 s:\n" + "".join(lines)
            try:
                config = json.loads(urllib.request.urlopen(url + "config", timeout=2).read())
                break
            except OSError:
                time.sleep(0.25)
        ready = time.perf_counter() - started
        values = [c.get("props", {}).get("value") for c in config["components"]]
        assert any(
            isinstance(v, str)
            and v.startswith("⚠️ **Offline: using the demo model")
            and "instead of facebook/blenderbot-400M-distill" in v
            for v in values
        )
        assert Client(url, verbose=False).predict("hi!", "none", "", api_name="/chat")[0].strip()
        return ready, list(lines)
    finally:
        proc.terminate()
        proc.wait(timeout=30)


def test_python_app_py_without_the_hub_serves_the_demo_model_at_once(tmp_path):
    """With no Hub (an endpoint that refuses connections) and HF_HUB_OFFLINE unset, as a newcomer
    starts it: no retry back-off (it cost ~30 s and ~20 warnings), one line saying why the demo
    model serves, and about as fast as with HF_HUB_OFFLINE=1."""
    offline, _ = start_app_py(tmp_path / "a", HF_HUB_OFFLINE="1")
    no_hub, lines = start_app_py(tmp_path / "b", HF_ENDPOINT=f"http://127.0.0.1:{free_port()}")
    text = "".join(lines)
    assert "retry" not in text.lower() and "Retrying" not in text, text
    (said,) = [line for line in lines if "demo model" in line]  # one line says why, and nothing else does
    assert "falling back to the demo model" in said and "cannot be reached" in said and "CHAT_MODEL" in said
    assert "--model_name_or_path" not in text  # a training flag is no advice for the app
    assert "Loading weights" not in text and "%|" not in text and "httpx" not in text, text  # no bars, no noise
    print(f"python app.py ready in {offline:.1f} s offline, {no_hub:.1f} s without a Hub")
    assert no_hub < offline + 10, (offline, no_hub)  # the back-off alone was 30 s


def test_the_train_tab_polls_only_while_it_is_shown(server):
    config = json.loads(urllib.request.urlopen(server.rstrip("/") + "/config", timeout=10).read())
    by_id = {c["id"]: c for c in config["components"]}
    timer = next(c for c in config["components"] if c["type"] == "timer")
    assert timer["props"]["active"] is False  # a page opens on the Chat tab: no polling
    tabs = {c["props"]["label"]: c["id"] for c in config["components"] if c["type"] == "tabitem"}
    toggles = {
        by_id[target]["props"]["label"]
        for dep in config["dependencies"]
        if timer["id"] in dep["outputs"]
        for target, event in dep["targets"]
        if event == "select" and target in tabs.values()
    }
    assert toggles == {"Chat", "Compare", "Train"}
