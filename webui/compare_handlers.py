"""What the Compare tab's controls do, as plain functions (``webui.compare_tab`` lays them out).

The same message, kind and context go to two models, A and B; each pane keeps its own history
(in the page, sent back with every message, like the Chat tab's). A visitor then votes for the
better reply, once per reply pair; votes go to the feedback store (``finetune.feedback``) and a
win rate per model pair is shown. Choosing the two models loads one (``chat.compare``), so it
needs the Train tab's login; chatting and voting are open to everyone.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from pathlib import Path

import gradio as gr
import pandas as pd

from chat.compare import CompareError, CompareSlot, same_model
from chat.engine import GENERATION_PRESETS, MAX_MESSAGE_CHARS, Conversation, InputError, clean_text
from chat.layout import DEMO_DIR, list_finals
from chat.prompt import KINDS
from finetune.feedback import WINNERS, FeedbackError, FeedbackStore
from webui import auth, chat_handlers
from webui.train_handlers import TrainTab

log = logging.getLogger(__name__)

SETTINGS = GENERATION_PRESETS["fast"]  # both models answer greedily: the comparison is of models, not luck
VOTE_LABELS = {"a": "A is better", "b": "B is better", "tie": "Tie"}
TABLE_COLUMNS = ["Model", "Against", "Wins", "Losses", "Ties", "Votes", "Win rate"]


# --------------------------------------------------------------------------- models


def short_name(spec: str) -> str:
    """A model as the page shows it: "RUN/final" for a run, never the server's folders."""
    if not spec:
        return "?"
    path = Path(spec)
    if path.is_absolute() or spec.startswith("."):
        if path.exists() and path.resolve() == DEMO_DIR:
            return chat_handlers.model_label(str(DEMO_DIR))
        return f"{path.parent.name}/{path.name}"
    return spec


def model_choices(slot: CompareSlot, runs: Path | str) -> list[tuple[str, str]]:
    """The two dropdowns' choices: the Chat tab's model picker's (base, demo, finished runs)."""
    return chat_handlers.picker_choices(runs, current=slot.serving.current.name)


def default_choices(slot: CompareSlot, choices: list[tuple[str, str]], runs: Path | str) -> tuple[str, str | None]:
    """(A, B) for the dropdowns: the chosen pair if any, else the serving model and the newest
    finished run (or another listed model when there is no run yet)."""
    if slot.pair is not None:
        return slot.pair
    specs = [spec for _, spec in choices]
    a = next((s for s in specs if slot.is_serving(s)), specs[0] if specs else None)
    finals = [str(p) for p in list_finals(runs)]
    b = next((s for s in finals if s in specs and not same_model(s, a)), None)
    b = b or next((s for s in specs if s == str(DEMO_DIR) and not same_model(s, a)), None)
    return a, b or next((s for s in specs if not same_model(s, a)), None)


def pair_markdown(slot: CompareSlot) -> str:
    pair = slot.pair
    if pair is None:
        return "No models chosen yet: a trainer picks **A** and **B** under **Models** (login needed)."
    return f"**A**: {short_name(pair[0])} · **B**: {short_name(pair[1])} — both answer with the *fast* preset."


def pane_labels(slot: CompareSlot) -> tuple[dict, dict]:
    """The two chat panes' labels: "A · <model>" and "B · <model>"."""
    pair = slot.pair or ("", "")
    return tuple(gr.update(label=f"{side} · {short_name(spec)}" if spec else side) for side, spec in zip("AB", pair))


def choose_models(
    slot: CompareSlot, tab: TrainTab, token: str | None, profile, choice_a, choice_b, hub_b=None
) -> Iterator[str]:
    """Load the pair to compare (login needed); yields the line under the Load button. ``B``
    may be a Hub id typed by the trainer; otherwise both must be listed choices."""
    try:
        auth.require(tab.auth, token, profile, "choose the models to compare")
        choices = model_choices(slot, tab.manager.root)
        a = chat_handlers.spec_to_load(choice_a, None, choices)
        b = chat_handlers.spec_to_load(choice_b, hub_b, choices)
    except auth.AuthError as err:
        yield f"🔒 {err}"
        return
    except InputError as err:
        yield f"⚠️ {err}"
        return
    yield f"⏳ Loading {short_name(b if slot.is_serving(a) else a)} … (the chat keeps serving meanwhile)"
    try:
        slot.choose(a, b)
    except CompareError as err:
        yield f"⚠️ {err}"
        return
    except Exception as err:  # noqa: BLE001 - any load failure: say why, keep the app serving
        log.warning("compare: cannot load %s / %s: %s", a, b, err)
        yield f"⚠️ Could not load the models: {err}"
        return
    yield f"✅ Comparing **A** {short_name(a)} with **B** {short_name(b)}."


# --------------------------------------------------------------------------- chatting


def votes_enabled(enabled: bool) -> tuple[dict, dict, dict]:
    """The three vote buttons' updates."""
    return tuple(gr.update(interactive=enabled) for _ in VOTE_LABELS)


def _reply_message(text: str) -> dict:
    if text:
        return {"role": "assistant", "content": text}
    return chat_handlers.notice("The model gave an empty reply.")


def _out(box: str, pane_a: list, pane_b: list, pending: dict | None, note: str) -> tuple:
    """send()'s outputs: the vote buttons are enabled exactly while there is a pair to vote on."""
    return (box, pane_a, pane_b, pending, note, *votes_enabled(pending is not None))


def send(slot: CompareSlot, message, kind, context, history_a, history_b) -> Iterator[tuple]:
    """Send ``message`` to both models, A first, then B (streamed). Yields (message box, pane A,
    pane B, the reply pair to vote on or None, note, and the three vote buttons' updates)."""
    history_a, history_b = list(history_a or []), list(history_b or [])
    replies = ["", ""]
    try:
        if kind not in KINDS:
            raise InputError(f"Unknown kind {kind!r}; choose one of {', '.join(KINDS)}.")
        if not isinstance(message, str) or not isinstance(context or "", str):
            raise InputError("The message and context must be text.")
        text = clean_text(message, MAX_MESSAGE_CHARS, "message")
        (spec_a, engine_a, id_a), (spec_b, engine_b, id_b) = slot.engines()
        # Both inputs are built (and checked) before either model runs; each side's conversation
        # names its model (two adapters may share one engine and its base).
        conversations = [
            Conversation(kind, context or "", chat_handlers.history_to_turns(history), model=model)
            for model, history in ((id_a, history_a), (id_b, history_b))
        ]
        streams = [engine.stream(c, text, SETTINGS) for engine, c in zip((engine_a, engine_b), conversations)]
    except (InputError, CompareError) as err:
        yield _out(gr.skip(), history_a, history_b, None, f"⚠️ {err}")
        return
    user = {"role": "user", "content": text}
    panes = [[*history_a, user], [*history_b, user]]
    yield _out("", *panes, None, "⏳ A is answering…")
    try:
        for side, stream in enumerate(streams):
            reply = ""
            for reply, _ in stream:
                shown = [*panes[side], {"role": "assistant", "content": reply}]
                yield _out("", *(shown if i == side else pane for i, pane in enumerate(panes)), None, "")
            panes[side], replies[side] = [*panes[side], _reply_message(reply)], reply
            slot.touch()  # a long reply counts as use: the extra model is not freed right after it
            if side == 0:
                yield _out("", *panes, None, "⏳ B is answering…")
    except Exception as err:  # noqa: BLE001 - a failed generation: say so, no vote on half a pair
        log.exception("compare: reply failed")
        yield _out("", *panes, None, f"⚠️ The model could not reply ({type(err).__name__}: {err}).")
        return
    pending = {"a": spec_a, "b": spec_b, "message": text, "pair": _pair(kind, context, conversations, text, replies)}
    yield _out("", *panes, pending, "Which reply is better? Vote below (once per message).")


# --------------------------------------------------------------------------- votes


def win_rate_frame(store: FeedbackStore, pair: tuple[str, str] | None = None) -> pd.DataFrame:
    """The votes so far, one row per model pair (most votes first), from the first model's side:
    its wins, losses, ties and win rate (a tie counts half). The store keeps each pair in its own
    order; the pair being compared (``pair``) is shown as A against B, like the panes."""
    rows = []
    for r in store.win_rates():
        first, second, wins, losses, rate = r["model_a"], r["model_b"], r["a_wins"], r["b_wins"], r["a_rate"]
        if pair and same_model(first, pair[1]) and same_model(second, pair[0]):
            first, second, wins, losses, rate = second, first, losses, wins, 1 - rate
        rows.append([short_name(first), short_name(second), wins, losses, r["ties"], r["total"], f"{100 * rate:.0f}%"])
    return pd.DataFrame(rows, columns=TABLE_COLUMNS)


def _pair(kind: str, context: str, conversations: list[Conversation], text: str, replies: list[str]) -> dict | None:
    """What a vote on this reply pair keeps for preference tuning: the conversation both models
    answered and their replies; None when the panes' conversations differ (each pane goes on from
    its own replies, so after the first message a pair can answer two different conversations, and a
    preference pair needs one) or a reply is empty."""
    turns_a, turns_b = (c.turns for c in conversations)
    if list(turns_a) != list(turns_b) or not all(r.strip() for r in replies):
        return None
    return {
        "kind": kind,
        "context": context or "",
        "turns": [*turns_a, text],
        "reply_a": replies[0],
        "reply_b": replies[1],
    }


def vote(store: FeedbackStore, tab: TrainTab, pending: dict | None, winner: str, request) -> tuple:
    """Store a vote on the last reply pair; returns (win-rate table, pending (None once used),
    note, the three vote buttons' updates: off). ``pending`` is the page's server-side state (a
    request cannot name other models), so each reply pair gets one vote."""
    off = votes_enabled(False)
    if winner not in WINNERS:
        return gr.skip(), pending, f"⚠️ Unknown vote {winner!r}.", *votes_enabled(pending is not None)
    if not pending:
        return gr.skip(), None, "⚠️ Nothing to vote on: send a message first (one vote per reply pair).", *off
    try:
        store.vote(
            model_a=pending["a"],
            model_b=pending["b"],
            winner=winner,
            visitor=store.visitor_key(tab.auth.client(request)),
            message=pending.get("message", ""),
            pair=pending.get("pair"),  # the replies too: an accepted vote becomes a preference pair
        )
    except FeedbackError as err:
        return gr.skip(), None, f"⚠️ The vote was not saved: {err}", *off
    table = win_rate_frame(store, (pending["a"], pending["b"]))
    return table, None, f"✅ Thanks, your vote is saved: {VOTE_LABELS[winner]}.", *off
