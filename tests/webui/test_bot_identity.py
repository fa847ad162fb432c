"""webui.bot_identity: the Chat and Compare tabs get the same "who the bot is" controls and events."""

from __future__ import annotations

import gradio as gr

from webui import bot_identity


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
