"""The MuDoConv dialogue format: the one place that knows how a source text is built.

Training (``finetune.data``) and chat (``chat``) both build encoder input here, so a model is
always spoken to in the format it was trained on. A source is

    CONTEXT + "  <s> " + TURN_1 + " </s> <s> " + TURN_2 + ... + " </s> <s> " + TURN_n

with no context (kind ``none``) it is just ``TURN_1 + " </s> <s> " + ... + TURN_n``. Turns
alternate between the other speaker and the bot; the last turn is the other speaker's and the
label is the bot's reply to it. ``<s>``/``</s>`` are the tokenizer's own special tokens written
as text, so user text must never be able to add one (see ``neutralize``).

The source prefix (``"chatbot: "``) is a training argument applied at tokenization time and is
not part of ``build_source``.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Sequence

KINDS = ("persona", "emotion", "task", "topic", "none")

# How each kind announces its context (seed-facts.md, "CONTEXT by kind").
_CONTEXT_TEMPLATE = {
    "persona": "your persona: {} </s>",
    "emotion": "context: {}",
    "task": "domain: {}",
    "topic": "topic: {}",
}

CONTEXT_SEP = "  <s> "  # two spaces: context -> first turn
TURN_SEP = " </s> <s> "  # between turns

# The 32 EmpatheticDialogues emotion labels (the values MuDoConv uses after "context: ").
EMOTIONS = (
    "afraid",
    "angry",
    "annoyed",
    "anticipating",
    "anxious",
    "apprehensive",
    "ashamed",
    "caring",
    "confident",
    "content",
    "devastated",
    "disappointed",
    "disgusted",
    "embarrassed",
    "excited",
    "faithful",
    "furious",
    "grateful",
    "guilty",
    "hopeful",
    "impressed",
    "jealous",
    "joyful",
    "lonely",
    "nostalgic",
    "prepared",
    "proud",
    "sad",
    "sentimental",
    "surprised",
    "terrified",
    "trusting",
)

# Special-token strings of BlenderBot's tokenizer (and of the tiny preset, which copies them).
SPECIAL_TOKENS = ("<s>", "</s>", "<pad>", "<unk>", "<mask>")
# Anything shaped like a special token, with stray spaces or case changes, e.g. "< /S >".
_SPECIAL_RE = re.compile(r"<\s*/?\s*(?:s|pad|unk|mask)\s*>", re.IGNORECASE)
# What is never meaningful in a chat or a dialogue row, and is removed from every piece of user text
# that is stored or shown (``neutralize``; ``chat.engine.clean_text``): terminal escape sequences as
# a whole (colours, cursor moves, titles: dropping only their ESC kept "[31m" in stored rows), control
# characters (C0 but tab and newline, DEL, C1), the bidirectional embeddings, overrides and isolates
# (U+202A-U+202E, U+2066-U+2069: they make a reviewer read text in another order than the model
# does), and lone surrogates (not text at all: neither the tokenizer nor JSON can encode them).
CONTROL_RE = re.compile(
    r"\x1b\[[0-?]*[ -/]*[@-~]"  # CSI: ESC [, parameters, one final byte (e.g. ESC [ 3 1 m: red)
    r"|\x1b\][^\x07\x1b]{0,512}(?:\x07|\x1b\\)"  # OSC: ESC ] ... up to its terminator (BEL or ESC \\)
    r"|[\x00-\x08\x0b-\x1f\x7f-\x9f\u202a-\u202e\u2066-\u2069\ud800-\udfff]"
)
_SPACES_RE = re.compile(r"\s+")


def neutralize(text: str, extra_special: Sequence[str] = ()) -> str:
    """Clean one piece of user text so it cannot add structure to a source.

    Removes special-token strings (repeatedly, so "<<s>s>" cannot reassemble into "<s>"),
    what CONTROL_RE matches (escape sequences, control characters, bidirectional overrides, lone
    surrogates), and collapses whitespace (newlines in a persona become spaces).
    """
    if not isinstance(text, str):
        raise ValueError(f"expected a string, got {type(text).__name__}")
    text = CONTROL_RE.sub(" ", text)
    while True:
        cleaned = _SPECIAL_RE.sub(" ", text)
        for tok in extra_special:
            cleaned = cleaned.replace(tok, " ")
        if cleaned == text:
            break
        text = cleaned
    return _SPACES_RE.sub(" ", text).strip()


def format_context(kind: str, context: str | None) -> str:
    """The CONTEXT part of a source for ``kind`` ("" for kind ``none``)."""
    if kind not in KINDS:
        raise ValueError(f"unknown kind {kind!r}: expected one of {', '.join(KINDS)}")
    if kind == "none":
        return ""
    context = neutralize(context or "")
    if not context:
        raise ValueError(f"kind {kind!r} needs a non-empty context")
    return _CONTEXT_TEMPLATE[kind].format(context)


def join_source(context_text: str, turns: Sequence[str]) -> str:
    """Assemble an already formatted context and already clean turns."""
    body = TURN_SEP.join(turns)
    return context_text + CONTEXT_SEP + body if context_text else body


def build_source(kind: str, context: str | None, turns: Sequence[str]) -> str:
    """Return the MuDoConv ``texts`` value for a conversation.

    ``turns`` are the utterances so far, oldest first, the last one being the message the bot
    answers. Every piece of user text goes through ``neutralize``.
    """
    context_text = format_context(kind, context)
    if isinstance(turns, str) or not turns:
        raise ValueError("turns must be a non-empty list of strings")
    clean = [neutralize(t) for t in turns]
    for i, t in enumerate(clean):
        if not t:
            raise ValueError(f"turn {i + 1} is empty")
    return join_source(context_text, clean)


def split_source(source: str) -> tuple[str, list[str]]:
    """Inverse of ``join_source`` for a MuDoConv ``texts`` value: (context_text, turns)."""
    if CONTEXT_SEP in source:
        context_text, body = source.split(CONTEXT_SEP, 1)
    else:
        context_text, body = "", source
    return context_text, body.split(TURN_SEP)


def kind_of(source: str) -> str:
    """The kind whose ``format_context`` built the context of ``source`` (the inverse; "none"
    for a source without a context). Used to report evaluation scores per kind.

    ``split_source`` finds the context exactly: only a context is followed by CONTEXT_SEP's two
    spaces (neutralized turns never hold two spaces in a row), so a "none" source whose first
    turn merely starts with "topic: " stays "none". A context no template made (data not built
    by ``build_source``) is a ValueError."""
    context_text, _ = split_source(source)
    if not context_text:
        return "none"
    for kind, template in _CONTEXT_TEMPLATE.items():
        head, tail = template.split("{}")
        if context_text.startswith(head) and context_text.endswith(tail) and len(context_text) > len(head + tail):
            return kind
    raise ValueError(f"not a context of any kind ({', '.join(KINDS)}): {context_text[:80]!r}")


def fit_source(
    context_text: str, turns: Sequence[str], count_tokens: Callable[[str], int], max_tokens: int
) -> tuple[str, int]:
    """Fit a source into ``max_tokens`` by dropping the oldest turns first.

    ``count_tokens`` measures a full source (prefix and special tokens included). The context
    and the newest turn are always kept; if those two alone do not fit, the newest turn loses
    its oldest words (the only mid-turn cut, and only for a single over-long message). Returns
    the fitted source and the number of turns dropped.

    The work is bounded whatever the history's length: every turn takes at least one token, so
    only the newest ``max_tokens`` turns can fit, and fewer turns never take more tokens, so a
    binary search finds the oldest turn that fits in ~log2(max_tokens) counts (after one count of
    the whole history, which usually fits).
    """
    turns = list(turns)
    if len(turns) <= max_tokens:  # the common case, a history that fits whole: one count
        whole = join_source(context_text, turns)
        if count_tokens(whole) <= max_tokens:
            return whole, 0
    low, high = max(0, len(turns) - max_tokens), len(turns) - 1  # candidates for the first kept turn
    fitted = None
    while low <= high:
        start = (low + high) // 2
        source = join_source(context_text, turns[start:])
        if count_tokens(source) <= max_tokens:
            fitted, high = (source, start), start - 1
        else:
            low = start + 1
    if fitted is not None:
        return fitted
    dropped = len(turns) - 1
    words = turns[-1].split(" ")
    # Keep the longest tail of the message that fits: binary search on how many words to cut
    # (more words never take fewer tokens), so a very long message costs log(words) counts.
    best, low, high = None, 1, len(words) - 1
    while low <= high:
        cut = (low + high) // 2
        source = join_source(context_text, [" ".join(words[cut:])])
        if count_tokens(source) <= max_tokens:
            best, high = source, cut - 1
        else:
            low = cut + 1
    if best is not None:
        return best, dropped
    # Even context + one word is too long: the tokenizer's own truncation takes over.
    return join_source(context_text, [words[-1]]), dropped
