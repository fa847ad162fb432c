"""Who the bot was in each saved chat: its kind, context and generation settings.

``gr.ChatInterface(save_history=True)`` keeps the chats' messages in the browser's local storage
(a list, newest first) and nothing else, so a reopened chat went on under whatever kind and context
happened to be selected. The Chat tab keeps a second browser-stored value beside it: the settings
of each saved chat, restored when the user clicks the chat in the saved-chats list.

Keyed by a fingerprint of the chat's messages as saved, not by ChatInterface's conversation id: that
id is an index into the list, and every new chat (inserted first) or deleted one shifts the others.
After each save (ChatInterface's own, after a reply, retry, undo or edit) the current chat's
fingerprint gets the settings its latest reply was written with (``recording`` notes them as the
chat function is called: the controls may change while the bot writes), and records of chats no
longer saved are dropped; the store is bounded to the newest ``MAX_SAVED`` chats.

Local storage is the client's: a record read back is checked field by field (type and the
control's range), and anything else falls back to the default, never into a control as is.
Plain functions, testable without a browser; ``webui.chat_tab`` wires them.
"""

from __future__ import annotations

import functools
import hashlib
import json
import math
from dataclasses import asdict, dataclass, fields, replace

import gradio as gr

from chat.engine import GENERATION_PRESETS, MAX_CONTEXT_CHARS
from chat.prompt import KINDS
from webui import bot_identity, chat_handlers

MAX_SAVED = 100  # settings are kept for the newest 100 saved chats
STORAGE_KEY = "persona-chat-saved-chat-settings"
CHATS_STORAGE_KEY = "persona-chat-saved-chats"  # ChatInterface's saved chats (its messages)

# The generation-settings sliders' (minimum, maximum, step): the Chat tab builds them from these,
# and a stored value outside them is not restored.
RANGES = {
    "beams": (1, 16, 1),
    "temperature": (0.05, 2.0, 0.05),
    "top_p": (0.05, 1.0, 0.05),
    "max_new_tokens": (1, 128, 1),
}
INTEGERS = {"beams", "max_new_tokens", "seed"}


def _preset_fields(preset: str) -> dict:
    beams, sample, temperature, top_p, max_new_tokens = chat_handlers.preset_values(preset)
    return {
        "beams": beams,
        "sample": sample,
        "temperature": temperature,
        "top_p": top_p,
        "max_new_tokens": max_new_tokens,
    }


_FAST = _preset_fields("fast")


@dataclass(frozen=True)
class ChatSettings:
    """Who the bot is and how it writes, in the order of the Chat tab's controls (the chat
    function's inputs after the history)."""

    kind: str = "persona"
    context: str = chat_handlers.CHAT_E_PERSONA
    preset: str = "fast"
    beams: int = _FAST["beams"]
    sample: bool = _FAST["sample"]
    temperature: float = _FAST["temperature"]
    top_p: float = _FAST["top_p"]
    max_new_tokens: int = _FAST["max_new_tokens"]
    seed: int = 0

    def values(self) -> tuple:
        return tuple(getattr(self, f.name) for f in fields(self))

    @classmethod
    def from_inputs(cls, *values) -> ChatSettings:
        """The controls' values (in field order), checked like a stored record."""
        return checked(dict(zip((f.name for f in fields(cls)), values, strict=True)))


def _number(value, low: float, high: float, integer: bool):
    """``value`` as an int / float within [low, high], or None (bools, strings, NaN are not numbers)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        return None
    if integer and value != int(value):
        return None
    if not low <= value <= high:
        return None
    return int(value) if integer else float(value)


def checked(record) -> ChatSettings:
    """A record read back from the browser as settings the controls accept: each field of its type
    and in its control's range, else its default (the record's preset's value for the generation
    settings; Chat-E's persona for an unknown kind)."""
    if not isinstance(record, dict):
        return ChatSettings()
    values: dict = {}
    kind, context = record.get("kind"), record.get("context")
    if isinstance(kind, str) and kind in KINDS:
        values["kind"] = kind
        fits = isinstance(context, str) and len(context) <= MAX_CONTEXT_CHARS
        values["context"] = "" if kind == "none" else context if fits else chat_handlers.KIND_DEFAULTS[kind]
    preset = record.get("preset")
    preset = preset if isinstance(preset, str) and preset in GENERATION_PRESETS else "fast"
    values |= {"preset": preset, **_preset_fields(preset)}
    for name, (low, high, _) in RANGES.items():
        number = _number(record.get(name), low, high, name in INTEGERS)
        if number is not None:
            values[name] = number
    if isinstance(record.get("sample"), bool):
        values["sample"] = record["sample"]
    seed = _number(record.get("seed"), 0, chat_handlers.SEED_MAX, integer=True)
    values["seed"] = seed or 0
    return replace(ChatSettings(), **values)


def fingerprint(conversation) -> str | None:
    """A saved chat's key: a hash of its messages as the browser stores them (None if not a chat)."""
    if not isinstance(conversation, list) or not conversation:
        return None
    text = json.dumps(conversation, sort_keys=True, ensure_ascii=False, separators=(",", ":"), default=str)
    return hashlib.sha256(text.encode("utf-8", "surrogatepass")).hexdigest()[:32]


def _saved_keys(saved_conversations) -> list[str | None]:
    chats = saved_conversations if isinstance(saved_conversations, list) else []
    return [fingerprint(chat) for chat in chats[:MAX_SAVED]]


def remember(store, conversation_id, saved_conversations, settings: ChatSettings) -> dict:
    """The store after ChatInterface saved the chat at ``conversation_id`` (an index into
    ``saved_conversations``, None after New chat or a deletion): that chat's settings, and those
    of the other saved chats (newest first, at most ``MAX_SAVED``); records of chats no longer
    saved (deleted, or saved since under new messages) are dropped."""
    store = store if isinstance(store, dict) else {}
    keys = _saved_keys(saved_conversations)
    current = None
    if isinstance(conversation_id, int) and not isinstance(conversation_id, bool) and 0 <= conversation_id < len(keys):
        current = keys[conversation_id]
    kept: dict[str, dict] = {}
    for key in keys:
        if key is None or key in kept:
            continue
        if key == current:
            kept[key] = asdict(settings)
        elif key in store:
            kept[key] = asdict(checked(store[key]))
    return kept


def recall(store, index, saved_conversations) -> ChatSettings | None:
    """The settings of the saved chat at ``index`` (as the saved-chats list numbers them), checked;
    None when none were stored (a chat saved before there was a store, or elsewhere)."""
    keys = _saved_keys(saved_conversations)
    if not isinstance(store, dict) or isinstance(index, bool) or not isinstance(index, int):
        return None
    if not 0 <= index < len(keys) or keys[index] not in store:
        return None
    return checked(store[keys[index]])


def restore(store, index, saved_conversations, contexts: dict | None, box: str | None) -> tuple:
    """What the Chat tab shows when the user opens saved chat ``index``: (kind, context, the page's
    per-kind contexts, preset, beams, sample, temperature, top_p, max new tokens, seed, the chat's
    settings as ``recording`` notes them), or ``gr.skip()`` for the controls (they stay as they
    are) and None when the chat has no stored settings. The text in the context box is kept for the
    kind it was typed for (as a kind switch does)."""
    settings = recall(store, index, saved_conversations)
    if settings is None:
        return *(gr.skip(),) * 10, None
    _, contexts = bot_identity.switch_context(contexts, settings.kind, box)
    if settings.kind != "none":
        contexts[settings.kind] = settings.context
    kind, context, *generation = settings.values()
    return kind, context, contexts, *generation, asdict(settings)


def recording(respond):
    """The chat function ``respond`` (message, history, the nine settings, reply records), yielding
    after each of its outputs the settings it was called with (a record for ``remember``)."""

    @functools.wraps(respond)  # gradio reads the signature
    def chat(message, history, *inputs):
        written = asdict(ChatSettings.from_inputs(*inputs[: len(fields(ChatSettings))]))
        for output in respond(message, history, *inputs):
            yield *output, written

    return chat
