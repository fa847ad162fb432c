"""webui.bot_identity: the Chat and Compare tabs get the same "who the bot is" controls and events, and
what those do (which box shows, each kind's own context, an example's kind and context)."""

from __future__ import annotations

import gradio as gr

from webui import bot_identity, chat_handlers


def _wiring(blocks: gr.Blocks, bot: bot_identity.BotIdentity) -> set[tuple[str, str, str]]:
    """(trigger component, event, first output component) of every event, by component role."""
    names = {bot.kind._id: "kind", bot.context._id: "context", bot.contexts._id: "contexts", bot.emotion._id: "emotion"}
    config = blocks.get_config_file()
    return {
        (names[target], event, names[dep["outputs"][0]])
        for dep in config["dependencies"]
        for target, event in dep["targets"]
        if target in names and dep["outputs"]
    }


def test_both_tabs_wire_kind_context_and_emotion_the_same_way():
    expected = {
        ("kind", "change", "context"),  # which box shows
        ("kind", "input", "context"),  # each kind's own context
        ("emotion", "input", "context"),  # the list sets the string sent
        ("context", "change", "emotion"),  # and follows it when something else sets it
    }
    for args in (("The bot has a…", None, "context-emotion"), ("The bots have a…", 2, None)):
        with gr.Blocks() as blocks:
            bot = bot_identity.build(*args)
        assert _wiring(blocks, bot) == expected
        assert bot.emotion.elem_id == args[2] and bot.kind.scale == args[1]


def test_context_visibility_follows_the_kind():
    textbox, dropdown = bot_identity.context_visibility("emotion")
    assert (textbox["visible"], dropdown["visible"]) == (False, True)
    textbox, dropdown = bot_identity.context_visibility("task")
    assert (textbox["visible"], textbox["label"], dropdown["visible"]) == (True, "Task goal", False)
    assert bot_identity.context_visibility("none")[0]["visible"] is False


def test_each_kind_keeps_its_own_context():
    chef = "i am a chef."
    topic, saved = bot_identity.switch_context(None, "topic", chef)
    assert topic == "jazz"  # the topic default, not the persona sentence
    persona, saved = bot_identity.switch_context(saved, "persona", "the blues")
    assert persona == chef  # the user's persona is back
    assert bot_identity.switch_context(saved, "topic", persona)[0] == "the blues"  # and the topic they typed
    assert bot_identity.switch_context(saved, "none", persona)[0] == ""
    emotion, saved = bot_identity.switch_context(saved, "emotion", chef)
    assert emotion == "joyful" and bot_identity.switch_context(saved, "task", "")[0] == "vacation ideas"
    # a cleared box gets the kind's default back next time
    assert bot_identity.switch_context({"kind": "task"}, "persona", "  ")[0] == chat_handlers.CHAT_E_PERSONA


def test_examples_are_labelled_and_set_their_kind():
    assert chat_handlers.EXAMPLE_LABELS[0] == "Persona: Hi! Who are you?"
    assert [label.split(":")[0] for label in chat_handlers.EXAMPLE_LABELS] == [
        "Persona",
        "Emotion",
        "Task goal",
        "Topic",
        "No context",
    ]
    kind, context, saved = bot_identity.pick_example({"kind": "persona"}, 3, "i am a chef.")
    assert (kind, context, saved["persona"]) == ("topic", "jazz", "i am a chef.")
    assert bot_identity.pick_example(saved, 0, "jazz")[:2] == ("persona", "i am a chef.")  # the user's own persona
