"""The Train tab's review of chat feedback, as plain functions (``webui.review_tab`` wires them).

The Chat tab stores every like, dislike and correction as a pending row of
``finetune.feedback.FeedbackStore``; here a trainer reads them (with the exact encoder text each
becomes), accepts, rejects or edits them, and downloads the accepted ones as ``.jsonl`` in the
structured format ``--train_file`` reads (never through gradio's file routes: see ``export_file``).
Everything but the counts needs the login (``webui.auth.require``): rows hold what visitors typed,
so an anonymous page sees how many rows wait, never the rows. A refusal or a bad row is a ``gr.Error`` with the reason.
"""

from __future__ import annotations

import logging
import time

import gradio as gr
import pandas as pd

from finetune.feedback import MAX_LIST, STATUSES, FeedbackRow, encoder_text
from webui.auth import require, who
from webui.chat_handlers import model_label
from webui.train_handlers import TrainTab, explained, export_feedback

log = logging.getLogger(__name__)

FILTERS = [("Pending", "pending"), ("Accepted", "accepted"), ("Rejected", "rejected"), ("All", "all")]
COLUMNS = ["id", "rating", "kind", "context", "last user turn", "response", "model", "age"]
ROWS_SHOWN = 200  # newest first; a trainer works through them and the rest follow
CELL_CHARS = 80  # a table cell's text; the whole row is shown when it is selected
RATING_ICONS = {"like": "👍 like", "dislike": "👎 dislike", "correction": "✏️ correction"}


def counts_text(tab: TrainTab) -> tuple[str, str]:
    """(the panel's label, a line of counts): what everyone may see."""
    counts = tab.feedback_store().counts()
    label = f"Feedback from the chat ({counts['pending']} pending)"
    return label, " · ".join(f"{counts[s]} {s}" for s in STATUSES)


def panel_label(tab: TrainTab):
    """The review panel's label with the live pending count (for page load and the Train tab opening)."""
    return gr.update(label=counts_text(tab)[0])


def _short(text: str, limit: int = CELL_CHARS) -> str:
    text = " ".join(text.split())
    return text if len(text) <= limit else text[: limit - 1] + "…"


def age(seconds: float) -> str:
    seconds = max(0, int(seconds))
    for unit, size in (("d", 86400), ("h", 3600), ("min", 60)):
        if seconds >= size:
            return f"{seconds // size} {unit}"
    return f"{seconds} s"


def rows_frame(rows: list[FeedbackRow], now: float | None = None) -> pd.DataFrame:
    now = time.time() if now is None else now
    return pd.DataFrame(
        [
            [
                row.id,
                RATING_ICONS.get(row.rating, row.rating),
                row.kind,
                _short(row.context, 40),
                _short(row.turns[-1] if row.turns else ""),
                _short(row.response),
                _short(model_label(row.model), 40),
                age(now - row.created),
            ]
            for row in rows
        ],
        columns=COLUMNS,
    )


def _filter(status: str | None) -> str | None:
    if status in (None, "", "all"):
        return None
    if status not in STATUSES:
        raise ValueError(f"status must be one of {', '.join(STATUSES)} or all, got {status!r}")
    return status


def refresh(tab: TrainTab, token: str | None, profile, status: str | None) -> tuple:
    """The panel's redraw: (label update, counts line, rows). A visitor gets the counts, the login
    hint and no rows."""
    label, counts = counts_text(tab)
    if who(tab.auth, token, profile, touch=False) is None:
        hint = "🔒 **Log in** above to review the rows." if tab.auth.enabled else "🔒 Reviewing needs a login."
        return gr.update(label=label), f"{counts}\n\n{hint}", rows_frame([])
    with explained("show the feedback"):
        rows = tab.feedback_store().rows(_filter(status), limit=ROWS_SHOWN)
    more = f" (the newest {ROWS_SHOWN} shown)" if len(rows) == ROWS_SHOWN else ""
    return gr.update(label=label), counts + more, rows_frame(rows)


def details(tab: TrainTab, token: str | None, profile, row_id, source_prefix: str | None) -> tuple[int, str, str]:
    """A selected row: (its id, what the model reads and what the bot said, the response to edit).
    ``source_prefix`` is the form's: the encoder text is exactly what a run with it reads."""
    with explained("show the row"):
        require(tab.auth, token, profile, "review feedback")
        row = tab.feedback_store().get(_selected(row_id))
        text = encoder_text(row, source_prefix if source_prefix is not None else "chatbot: ")
        lines = [
            f"**Row {row.id}** · {RATING_ICONS.get(row.rating, row.rating)} · {row.status} · "
            f"model `{model_label(row.model) or '?'}`",
            "The encoder reads (with the form's source prefix):",
            f"```text\n{text}\n```",
            "The bot said:" if row.original else "The bot's reply was not recorded.",
        ]
        if row.original:
            lines.append(f"```text\n{row.original}\n```")
        return row.id, "\n\n".join(lines), row.response


def _selected(row_id) -> int:
    """The selected row's id; ValueError meant for the trainer without one (or with a forged one)."""
    if row_id in (None, ""):
        raise ValueError("select a row in the table first")
    try:
        return int(row_id)
    except (TypeError, ValueError):
        raise ValueError(f"{str(row_id)[:40]!r} is not a row of the table: select a row in the table") from None


def set_status(tab: TrainTab, token: str | None, profile, row_id, status: str) -> str:
    """Accept or reject the selected row."""
    with explained(f"mark the row {status}"):
        user = require(tab.auth, token, profile, "review feedback")
        row = tab.feedback_store().get(_selected(row_id))
        tab.feedback_store().set_status([row.id], status)
        log.info("feedback row %d %s (%s)", row.id, status, user)
        return f"Row {row.id}: {status}."


def save_edit(tab: TrainTab, token: str | None, profile, row_id, response: str | None) -> str:
    """The trainer's better reply becomes the row's response (its rating becomes "correction")."""
    with explained("save the edit"):
        user = require(tab.auth, token, profile, "edit feedback")
        row = tab.feedback_store().edit(_selected(row_id), response or "")
        log.info("feedback row %d edited (%s)", row.id, user)
        return f"Row {row.id}: response saved (now a correction, still {row.status})."


def newest_pending(tab: TrainTab) -> int:
    """The id of the newest pending row (0: none): Accept all stops there, so rows that arrive
    after the page was drawn wait for the next look."""
    newest = tab.feedback_store().rows("pending", limit=1)
    return newest[0].id if newest else 0


def accept_all(tab: TrainTab, token: str | None, profile, up_to) -> str:
    """Accept every pending row up to id ``up_to`` (the newest the trainer's page counted)."""
    with explained("accept the pending rows"):
        user = require(tab.auth, token, profile, "review feedback")
        store, up_to, done, offset = tab.feedback_store(), int(up_to or 0), 0, 0
        while page := store.rows("pending", limit=MAX_LIST, offset=offset):  # newest first
            ids = [row.id for row in page if row.id <= up_to]
            offset += len(page) - len(ids)  # the newer ones stay pending: step over them
            if not ids:
                continue
            done += store.set_status(ids, "accepted")
        log.info("%d pending feedback rows accepted (%s)", done, user)
        return f"{done} pending row{'s' if done != 1 else ''} accepted."


def export_file(tab: TrainTab, token: str | None, profile) -> tuple[dict, str]:
    """The accepted good replies as one ``.jsonl`` (no held-out part) for the trainer's browser to
    save: ({"name", "text"}, the note). The file is written under the data root
    (``train_handlers.export_feedback``), which gradio does not serve; its rows reach the page only
    in the answer to this logged-in event. (A file in gradio's upload or cache folder, where a
    ``gr.File`` output goes, is served to anyone who requests its path.)"""
    with explained("export the feedback"):
        user = require(tab.auth, token, profile, "export feedback")
        exported = export_feedback(tab, holdout_every=0)
        name = f"feedback-{time.strftime('%Y%m%d-%H%M%S')}.jsonl"
        log.info("feedback export of %d rows for %s (%s)", exported.rows, user, exported.train)
        rows, them = (f"{exported.rows} accepted rows", "them") if exported.rows != 1 else ("1 accepted row", "it")
        return {"name": name, "text": exported.train.read_text(encoding="utf-8")}, (
            f"Exported {rows}: your browser saves {them} as **{name}**."
        )
