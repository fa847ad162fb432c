"""Rate and correct the bot in the chat: 👍 / 👎 on a reply, or ✏️ a reply into what the bot should
have said. Each becomes a training row in ``finetune.feedback.FeedbackStore`` (kind, context, the
turns before, the response, the reply as given, the rating, the model that answered).

Who wrote a reply is recorded when it is written, not guessed when it is rated: the chat function
(``chat_fn``) keeps, per bot message index, the model that answered and the kind and context it was
given (a ``gr.State`` of the page). A reply without such a record (a saved chat from an earlier
visit, or a message whose text no longer matches) cannot be rated.

Rows of a logged-in trainer (visitor ``trainer:<login>``) are accepted at once; anyone else's wait
as pending for a trainer's review, keyed by a salted hash of the client address. Plain functions,
testable without a server; ``webui.chat_tab`` wires them to the chatbot's like and edit events.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, replace

import gradio as gr

from chat.engine import MAX_MESSAGE_CHARS, ChatEngine, InputError
from chat.prompt import neutralize
from finetune.feedback import MAX_RESPONSE_CHARS, TRAINER_PREFIX, FeedbackError, FeedbackStore
from webui import auth, chat_handlers

log = logging.getLogger(__name__)

# Each emoji stands next to its word (the buttons are named Edit, Like and Dislike): "👍 / 👎" alone
# said nothing to a screen reader, nor where no emoji font draws them.
HINT = "✏️ Edit a reply to write what the bot should have said · 👍 Like or 👎 Dislike it (a trainer reviews both)."


@dataclass(frozen=True)
class Rater:
    """Who rates: a logged-in trainer (``auth.who``'s name), or an anonymous visitor's address."""

    trainer: str | None
    client: str

    @property
    def status(self) -> str:
        return "accepted" if self.trainer else "pending"

    def visitor(self, store: FeedbackStore) -> str:
        # Never the address itself: the store keeps a salted hash of it.
        return f"{TRAINER_PREFIX}{self.trainer}" if self.trainer else store.visitor_key(self.client)


def event_fields(event) -> dict:
    """The data a browser event carries (``gr.EventData``), or {} without any.

    Handlers take ``gr.EventData`` rather than ``gr.LikeData`` / ``gr.EditData`` / ``gr.SelectData``:
    those read their fields while gradio builds them, before the handler runs, so a request without
    event data (or without one field, e.g. an edit's ``previous_value``) showed the page Python's
    "'NoneType' object is not subscriptable". A missing field is then the handler's to explain."""
    data = getattr(event, "_data", None)
    return data if isinstance(data, dict) else {}


def rater(config: auth.AuthConfig, token: str | None, profile, request) -> Rater:
    """The rater of a request: the login (token / OAuth profile) if any, and the client address as
    the login throttle sees it (the proxy's X-Forwarded-For on a Space)."""
    return Rater(auth.who(config, token, profile), config.client(request))


# --------------------------------------------------------------------------- the chat function


class _Pinned:
    """The engine for one reply, pinned to the conversation's model (``model_id``: the id of the
    model that wrote its earlier replies; None for a new chat: the one serving now), noting the
    model that answers it."""

    def __init__(self, engine: ChatEngine, model_id: str | None = None):
        self.engine, self.wanted, self.model, self.loaded = engine, model_id, None, None

    def stream(self, conv, message, settings):
        # A conversation that has a model keeps it (ChatEngine.model_for: InputError with a note if
        # it is no longer served); a new one starts with the current model.
        self.loaded, stream = self.engine.open_stream(replace(conv, model=self.wanted), message, settings)
        self.model = self.loaded.name
        return stream


def conversation_model(records: dict) -> str | None:
    """The id of the model a conversation is with: the one that wrote its latest recorded reply."""
    ids = [r.get("id") for _, r in sorted(records.items()) if isinstance(r, dict)]
    return next((i for i in reversed(ids) if isinstance(i, str) and i), None)


def chat_fn(engine: ChatEngine):
    """``chat_handlers.chat_fn`` plus the page's reply records: the ChatInterface function with the
    records as its last input and output; yields (reply so far, token meter, serving banner, records).

    The banner names the model that wrote this reply, so a page that was open during a model swap
    (on another page) shows the new model from its next reply on, not only after a reload."""

    def respond(
        message,
        history,
        kind="none",
        context="",
        preset="fast",
        beams=None,
        sample=None,
        temperature=None,
        top_p=None,
        max_new_tokens=None,
        seed=0,
        replies=None,
    ):
        index = len(history or []) + 1  # ChatInterface appends the message, then this reply
        # Records of messages after this one belong to a conversation that was cut (undo, an edit).
        kept = {i: r for i, r in (replies or {}).items() if isinstance(i, int) and i < index}
        # An old chat keeps its model across swaps (an adapter still served on the base); one whose
        # model left with a swap goes on with the model serving now, and a note after the reply says so.
        wanted = conversation_model(kept)
        pinned = _Pinned(engine, wanted if wanted in engine.model_ids() else None)
        previous = kept[max(kept)]["model"] if kept else None  # the model of this chat's last reply
        inputs = (kind, context, preset, beams, sample, temperature, top_p, max_new_tokens, seed)
        banner, banner_of = None, None  # written once per model that answers, not once per streamed chunk
        for reply, meter in chat_handlers.chat_fn(pinned)(message, history, *inputs):
            if isinstance(reply, str) and pinned.model is not None:
                record = {
                    "model": pinned.model,
                    "id": pinned.loaded.id,
                    "kind": kind or "none",
                    "context": context or "",
                }
                kept[index] = {**record, "reply": reply, "original": reply}
            else:  # a notice: nothing to rate
                kept.pop(index, None)
            if banner is None or pinned.loaded is not banner_of:
                banner, banner_of = chat_handlers.serving_markdown(engine, pinned.loaded), pinned.loaded
            if isinstance(reply, str) and previous is not None and pinned.model not in (None, previous):
                # Another page swapped the model mid-chat: a note after the reply says so (after it, so
                # the reply keeps its place next to the message it answers).
                reply = [{"role": "assistant", "content": reply}, chat_handlers.model_note(previous, pinned.model)]
            yield reply, meter, banner, dict(kept)

    return respond


# --------------------------------------------------------------------------- rating


def _words(content) -> str:
    return " ".join(chat_handlers._text(content).split())


def _reply(history: list, replies: dict | None, index) -> tuple[list[str], dict]:
    """(the turns up to and including the bot reply at ``index``, its record); FeedbackError why not."""
    if not isinstance(index, int) or isinstance(index, bool) or not 0 <= index < len(history):
        raise FeedbackError("that reply is not in this chat (if it is still being written, wait until it is done)")
    message = history[index]
    if not isinstance(message, dict) or message.get("role") != "assistant":
        raise FeedbackError("only the bot's replies can be rated")
    if chat_handlers.is_notice(message):
        raise FeedbackError("that is a note from the app, not a reply of the bot: it cannot be rated")
    record = (replies or {}).get(index)
    if not record or _words(record["reply"]) != _words(message.get("content")):
        raise FeedbackError(
            "only replies written during this visit can be rated: a saved chat does not keep which model, "
            "kind and context wrote them"
        )
    previous = history[index - 1] if index else None
    if not isinstance(previous, dict) or previous.get("role") != "user" or not _words(previous.get("content")):
        raise FeedbackError("that reply answers no message")
    try:
        turns = chat_handlers.history_to_turns(history[: index + 1])
    except InputError as err:
        raise FeedbackError(str(err)) from None
    return turns, record


def _save(store: FeedbackStore, rater: Rater, turns: list[str], record: dict, response: str, rating: str) -> dict:
    """Store one row for a reply; returns its record with the row's id. One row per reply and
    visit: a new rating (or correction) of the same reply replaces this visit's earlier row while
    it is not yet reviewed (or is the trainer's own)."""
    row = store.add(
        kind=record["kind"],
        context=record["context"],
        turns=turns[:-1],  # ends with the user message the reply answered
        response=response,
        original=record["original"],
        rating=rating,
        model=record["model"],
        visitor=rater.visitor(store),
        status=rater.status,
    )
    old = record.get("row")
    if old is not None:
        try:
            earlier = store.get(old)
            if earlier.visitor == rater.visitor(store) and (earlier.status == "pending" or rater.trainer):
                store.delete([old])
        except FeedbackError:
            pass  # a trainer deleted it meanwhile
    return {**record, "row": row}


def _saved_note(store: FeedbackStore, rater: Rater, what: str) -> str:
    if rater.trainer:
        return f"{what} saved and accepted."
    return f"Thanks — {what.lower()} saved for review ({store.counts()['pending']} pending)."


def _refused(err: Exception) -> str:
    text = str(err)
    text = text[:1].upper() + text[1:]
    gr.Warning(text)  # the chat itself goes on as it was
    return f"⚠️ Not saved: {text}"


def like(rater: Rater, history, replies: dict | None, index, liked, store: FeedbackStore):
    """A 👍 (``liked`` True) or 👎 (False) on the bot message at ``index`` of ``history`` (the chat's
    server-side state); returns (the note under the chat, the reply records). Taking a rating back
    (``liked`` None or "") changes nothing: a trainer rejects rows in review."""
    if liked not in (True, False, "Like", "Dislike"):
        return gr.skip(), gr.skip()
    liked, index = liked in (True, "Like"), _index(index)
    history = list(history or [])
    try:
        turns, record = _reply(history, replies, index)
        if record["reply"] != record["original"]:
            raise FeedbackError("you corrected this reply: the correction is what was saved")
        record = _save(store, rater, turns, record, turns[-1], "like" if liked else "dislike")
    except FeedbackError as err:
        return _refused(err), gr.skip()
    note = _saved_note(store, rater, "👍 Like" if liked else "👎 Dislike")
    if not liked:
        note += " ✏️ the reply to say what it should have been."
    return note, {**(replies or {}), index: record}


def _index(index):
    """A message's index in the chat (gradio sends (message, part) for a multi-part message)."""
    return index[0] if isinstance(index, (list, tuple)) and index else index


def edit(rater: Rater, history, replies: dict | None, index, value, store: FeedbackStore):
    """A message edited in the chat; returns (chatbot, chat state, message box, note, records).

    A bot reply: the conversation goes on with the edited text in its place, stored as a
    correction of that reply. A user message: the conversation is cut before it and the edited
    text waits in the message box (Enter sends it again). ``history`` is the chat's server-side
    state (the chatbot shows the edit already)."""
    history = list(history or [])
    # What is shown back is what is stored and what the model reads: escape sequences, control
    # characters and bidirectional overrides removed (chat.prompt.neutralize), whitespace collapsed.
    text = neutralize(value if isinstance(value, str) else chat_handlers._text(value))
    index = _index(index)
    valid = isinstance(index, int) and not isinstance(index, bool) and 0 <= index < len(history)
    message = history[index] if valid else None
    undo = (history, gr.skip(), gr.skip())  # the chatbot back to what it was

    if isinstance(message, dict) and message.get("role") == "user":
        if len(text) > MAX_MESSAGE_CHARS:
            return (
                *undo,
                _refused(FeedbackError(f"the message is too long (the limit is {MAX_MESSAGE_CHARS})")),
                gr.skip(),
            )
        cut = history[:index]
        kept = {i: r for i, r in (replies or {}).items() if isinstance(i, int) and i < index}
        return cut, cut, text, "✏️ Press Enter to send the edited message (the chat goes on from there).", kept
    if not isinstance(message, dict) or message.get("role") != "assistant" or chat_handlers.is_notice(message):
        why = "only your messages and the bot's replies can be edited, not the app's notes"
        if not valid:
            why = "that message is not in this chat (if a reply is being written, wait until it is done)"
        return *undo, _refused(FeedbackError(why)), gr.skip()
    if not text or len(text) > MAX_RESPONSE_CHARS:
        why = "a reply cannot be empty" if not text else f"a reply can have at most {MAX_RESPONSE_CHARS} characters"
        return *undo, _refused(FeedbackError(why)), gr.skip()

    corrected = [*history[:index], {"role": "assistant", "content": text}, *history[index + 1 :]]
    try:
        turns, record = _reply(history, replies, index)
        record = _save(store, rater, turns, {**record, "reply": text}, text, "correction")
    except FeedbackError as err:  # the chat keeps the edit: it is the user's conversation
        return corrected, corrected, gr.skip(), _refused(err), gr.skip()
    return (
        corrected,
        corrected,
        gr.skip(),
        _saved_note(store, rater, "✏️ Correction"),
        {**(replies or {}), index: record},
    )
