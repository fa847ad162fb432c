"""Who the bot is: the kind radio, its context box and the emotion list, with their events.

The Chat tab and the Compare tab both ask it; both send the model one context string (for
emotions the box is hidden and set from the list), and each kind keeps its own context on the
page (``switch_context``). ``build`` is layout and wiring (call it inside the Row or Column it goes
in); the functions above it are what the controls do, testable without a browser.
"""

from __future__ import annotations

from dataclasses import dataclass

import gradio as gr

from chat.engine import MAX_CONTEXT_CHARS
from chat.prompt import EMOTIONS
from webui import chat_handlers

PRIVATE = {"api_visibility": "private"}


def switch_context(contexts: dict | None, kind: str, context: str | None) -> tuple[str, dict]:
    """The context box's value when the user picks ``kind``, and the page's saved contexts.

    ``contexts`` holds each kind's last text and under ``"kind"`` the kind the box showed: the
    box's text is kept for that kind, and the new kind gets back its own text (its default the
    first time), so a persona is never copied into the Topic box nor lost on the way back.
    """
    saved = dict(contexts or {})
    previous = saved.get("kind", "persona")
    if previous in chat_handlers.KIND_DEFAULTS and previous != "none":
        saved[previous] = context or ""
    if kind not in chat_handlers.KIND_DEFAULTS:
        kind = "none"
    saved["kind"] = kind
    value = saved.get(kind)
    if kind == "none" or value is None or not value.strip():
        value = chat_handlers.KIND_DEFAULTS[kind]
    return value, saved


def pick_example(contexts: dict | None, index: int, context: str | None) -> tuple[str, str, dict]:
    """(kind, context, saved contexts) when the user clicks example ``index``: its kind, with the
    user's own text for that kind if they wrote one, else the example's context."""
    _, kind, example_context = chat_handlers.EXAMPLES[index]
    value, saved = switch_context(contexts, kind, context)
    if value == chat_handlers.KIND_DEFAULTS[kind]:
        value = example_context
    return kind, value, saved


def context_visibility(kind: str) -> tuple[dict, dict]:
    """(context textbox update, emotion dropdown update) for ``kind``: the dropdown replaces the
    textbox for emotions, and kind ``none`` shows neither."""
    label, info = chat_handlers.CONTEXT_LABELS.get(kind, chat_handlers.CONTEXT_LABELS["none"])
    return (
        gr.update(visible=kind not in ("emotion", "none"), label=label, info=info),
        gr.update(visible=kind == "emotion"),
    )


@dataclass
class BotIdentity:
    kind: gr.Radio
    context: gr.Textbox  # the string sent with every message
    contexts: gr.State  # each kind's own context on this page
    emotion: gr.Dropdown


def build(
    label: str, kind_scale: int | None = None, emotion_id: str | None = None, elem_prefix: str | None = None
) -> BotIdentity:
    """The controls (persona first, Chat-E's) and their events; ``label`` heads the kind radio;
    ``elem_prefix`` names the kind radio and the context box (``<prefix>-kind``, ``<prefix>-context``)
    for the page's style sheet (a phone lays them out apart from the other settings)."""
    kind = gr.Radio(
        chat_handlers.KIND_CHOICES,
        value="persona",
        label=label,
        scale=kind_scale,
        elem_id=f"{elem_prefix}-kind" if elem_prefix else None,
    )
    context_label, info = chat_handlers.CONTEXT_LABELS["persona"]
    context = gr.Textbox(
        chat_handlers.CHAT_E_PERSONA,
        label=context_label,
        info=info,
        lines=2,
        max_lines=6,
        max_length=MAX_CONTEXT_CHARS,
        elem_id=f"{elem_prefix}-context" if elem_prefix else None,
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

    kind.change(context_visibility, kind, [context, emotion], queue=False, **PRIVATE)
    kind.input(switch_context, [contexts, kind, context], [context, contexts], queue=False, **PRIVATE)
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
