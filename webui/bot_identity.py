"""Who the bot is: the kind radio, its context box and the emotion list, with their events.

The Chat tab and the Compare tab both ask it; both send the model one context string (for
emotions the box is hidden and set from the list), and each kind keeps its own context on the
page (``chat_handlers.switch_context``). Layout only: call it inside the Row or Column it goes in.
"""

from __future__ import annotations

from dataclasses import dataclass

import gradio as gr

from chat.engine import MAX_CONTEXT_CHARS
from chat.prompt import EMOTIONS
from webui import chat_handlers

PRIVATE = {"api_visibility": "private"}


@dataclass
class BotIdentity:
    kind: gr.Radio
    context: gr.Textbox  # the string sent with every message
    contexts: gr.State  # each kind's own context on this page
    emotion: gr.Dropdown


def build(label: str, kind_scale: int | None = None, emotion_id: str | None = None) -> BotIdentity:
    """The controls (persona first, Chat-E's) and their events; ``label`` heads the kind radio."""
    kind = gr.Radio(chat_handlers.KIND_CHOICES, value="persona", label=label, scale=kind_scale)
    context_label, info = chat_handlers.CONTEXT_LABELS["persona"]
    context = gr.Textbox(
        chat_handlers.CHAT_E_PERSONA, label=context_label, info=info, lines=2, max_lines=6, max_length=MAX_CONTEXT_CHARS
    )
    contexts = gr.State({"kind": "persona"})
    emotion = gr.Dropdown(
        list(EMOTIONS),
        value=chat_handlers.KIND_DEFAULTS["emotion"],
        allow_custom_value=True,
        label="Emotion",
        visible=False,
        elem_id=emotion_id,
        info="One of the 32 emotions the model was trained on (or type one).",
    )

    kind.change(chat_handlers.context_visibility, kind, [context, emotion], queue=False, **PRIVATE)
    kind.input(chat_handlers.switch_context, [contexts, kind, context], [context, contexts], queue=False, **PRIVATE)
    emotion.input(lambda value: value or "", emotion, context, queue=False, **PRIVATE)
    # The list follows the (hidden) box when something else sets it: an example, a kind switch.
    context.change(
        lambda k, c: gr.update(value=c) if k == "emotion" else gr.skip(),
        [kind, context],
        emotion,
        queue=False,
        **PRIVATE,
    )
    return BotIdentity(kind, context, contexts, emotion)
