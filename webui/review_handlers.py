"""The Train tab's review of chat feedback, as plain functions (``webui.review_tab`` wires them).

The Chat tab stores every like, dislike and correction as a pending row of
``finetune.feedback.FeedbackStore``, the Compare tab every vote on a reply pair (id ``v<N>`` in the
table); here a trainer reads them (with the exact encoder text each becomes), accepts, rejects or
edits them, and downloads the accepted ones as ``.jsonl``: SFT rows in the structured format
``--train_file`` reads, or preference rows (``finetune.feedback_preferences``: DPO pairs, KTO rows)
in the format ``--preference_file`` reads (never through gradio's file routes: see ``export_file``).
Everything but the counts needs the login (``webui.auth.require``): rows hold what visitors typed,
so an anonymous page sees how many rows wait, never the rows. A refusal or a bad row is a ``gr.Error`` with the reason.
"""

from __future__ import annotations

import logging
import secrets
import time

import gradio as gr
import pandas as pd

from finetune.feedback import MAX_LIST, STATUSES, FeedbackRow, encoder_text
from finetune.feedback_preferences import export_preferences
from finetune.feedback_votes import VoteRow
from webui.auth import require, who
from webui.chat_handlers import model_label
from webui.train_handlers import TrainTab, explained, export_feedback

log = logging.getLogger(__name__)

FILTERS = [("Pending", "pending"), ("Accepted", "accepted"), ("Rejected", "rejected"), ("All", "all")]
COLUMNS = ["id", "rating", "kind", "context", "last user turn", "response", "model", "age"]
ROWS_SHOWN = 200  # newest first; a trainer works through them and the rest follow
CELL_CHARS = 80  # a table cell's text; the whole row is shown when it is selected
RATING_ICONS = {"like": "👍 like", "dislike": "👎 dislike", "correction": "✏️ correction", "vote": "⚖️ vote"}
VOTE_PREFIX = "v"  # a vote's id in the table ("v3"): rows and votes are numbered apart


def counts_text(tab: TrainTab) -> tuple[str, str]:
    """(the panel's label, a line of counts): what everyone may see."""
    store = tab.feedback_store()
    counts, votes = store.counts(), store.vote_counts()
    label = f"Feedback from the chat ({counts['pending'] + votes['pending']} pending)"
    line = " · ".join(f"{counts[s]} {s}" for s in STATUSES)
    if any(votes.values()):  # Compare votes that kept their replies
        line += " · Compare votes: " + ", ".join(f"{votes[s]} {s}" for s in STATUSES)
    return label, line


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


def _vote_cells(vote: VoteRow, now: float) -> list:
    """A vote in the table: its replies as "✔ winner / ✘ loser", its models as "winner vs loser"."""
    models = " vs ".join(model_label(m) for m in _winner_first(vote))
    return [
        f"{VOTE_PREFIX}{vote.id}",
        RATING_ICONS["vote"],
        vote.kind,
        _short(vote.context, 40),
        _short(vote.turns[-1] if vote.turns else ""),
        _short(f"✔ {vote.chosen} / ✘ {vote.rejected}"),
        _short(models, 40),
        age(now - vote.created),
    ]


def rows_frame(rows: list[FeedbackRow], now: float | None = None, votes: list[VoteRow] = ()) -> pd.DataFrame:
    """The table: rows and votes together, newest first."""
    now = time.time() if now is None else now
    cells = [(row.created, _row_cells(row, now)) for row in rows] + [(v.created, _vote_cells(v, now)) for v in votes]
    return pd.DataFrame([c for _, c in sorted(cells, key=lambda item: -item[0])], columns=COLUMNS)


def _row_cells(row: FeedbackRow, now: float) -> list:
    return [
        row.id,
        RATING_ICONS.get(row.rating, row.rating),
        row.kind,
        _short(row.context, 40),
        _short(row.turns[-1] if row.turns else ""),
        _short(row.response),
        _short(model_label(row.model), 40),
        age(now - row.created),
    ]


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
        votes = tab.feedback_store().votes(_filter(status), limit=ROWS_SHOWN)
    frame = rows_frame(rows, votes=votes).head(ROWS_SHOWN)
    more = f" (the newest {ROWS_SHOWN} shown)" if len(rows) + len(votes) >= ROWS_SHOWN else ""
    return gr.update(label=label), counts + more, frame


def details(tab: TrainTab, token: str | None, profile, row_id, source_prefix: str | None) -> tuple[int, str, str]:
    """A selected row: (its id, what the model reads and what the bot said, the response to edit).
    ``source_prefix`` is the form's: the encoder text is exactly what a run with it reads."""
    with explained("show the row"):
        require(tab.auth, token, profile, "review feedback")
        which, number = _selected(row_id)
        if which == "vote":
            return _vote_details(tab.feedback_store().get_vote(number), source_prefix)
        row = tab.feedback_store().get(number)
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


def _winner_first(vote: VoteRow) -> tuple[str, str]:
    return (vote.model_a, vote.model_b) if vote.winner == "a" else (vote.model_b, vote.model_a)


def _vote_details(vote: VoteRow, source_prefix: str | None) -> tuple[str, str, str]:
    """A selected vote: (its id, its encoder text and both replies, the chosen reply)."""
    text = encoder_text(vote, source_prefix if source_prefix is not None else "chatbot: ")  # (duck-typed)
    winner, loser = _winner_first(vote)
    lines = [
        f"**Vote {VOTE_PREFIX}{vote.id}** · {RATING_ICONS['vote']} · {vote.status}",
        "The encoder reads (with the form's source prefix):",
        f"```text\n{text}\n```",
        f"Chosen: the winner's reply (`{model_label(winner)}`):",
        f"```text\n{vote.chosen}\n```",
        f"Rejected: the other reply (`{model_label(loser)}`):",
        f"```text\n{vote.rejected}\n```",
        "Accepted, it trains DPO as this pair (a vote's replies are what the models said: no edit).",
    ]
    return f"{VOTE_PREFIX}{vote.id}", "\n\n".join(lines), vote.chosen


def _selected(row_id) -> tuple[str, int]:
    """("row" | "vote", the id) of the selected row; ValueError meant for the trainer without one
    (or with a forged one)."""
    if row_id in (None, ""):
        raise ValueError("select a row in the table first")
    text = str(row_id).strip()
    which = "vote" if text.startswith(VOTE_PREFIX) else "row"
    try:
        return which, int(text[len(VOTE_PREFIX) :] if which == "vote" else row_id)
    except (TypeError, ValueError):
        raise ValueError(f"{text[:40]!r} is not a row of the table: select a row in the table") from None


def set_status(tab: TrainTab, token: str | None, profile, row_id, status: str) -> str:
    """Accept or reject the selected row."""
    with explained(f"mark the row {status}"):
        user = require(tab.auth, token, profile, "review feedback")
        store, (which, number) = tab.feedback_store(), _selected(row_id)
        if which == "vote":
            vote = store.get_vote(number)
            store.set_vote_status([vote.id], status)
            log.info("vote %d %s (%s)", vote.id, status, user)
            return f"Vote {VOTE_PREFIX}{vote.id}: {status}."
        row = store.get(number)
        store.set_status([row.id], status)
        log.info("feedback row %d %s (%s)", row.id, status, user)
        return f"Row {row.id}: {status}."


def save_edit(tab: TrainTab, token: str | None, profile, row_id, response: str | None) -> str:
    """The trainer's better reply becomes the row's response (its rating becomes "correction")."""
    with explained("save the edit"):
        user = require(tab.auth, token, profile, "edit feedback")
        which, number = _selected(row_id)
        if which == "vote":
            raise ValueError("a vote's replies are what the two models said: accept or reject the vote instead")
        row = tab.feedback_store().edit(number, response or "")
        log.info("feedback row %d edited (%s)", row.id, user)
        return f"Row {row.id}: response saved (now a correction, still {row.status})."


def newest_pending(tab: TrainTab) -> tuple[int, int]:
    """The ids of the newest pending row and vote (0: none): Accept all stops there, so rows and
    votes that arrive after the page was drawn wait for the next look."""
    rows, votes = tab.feedback_store().rows("pending", limit=1), tab.feedback_store().votes("pending", limit=1)
    return (rows[0].id if rows else 0), (votes[0].id if votes else 0)


def _accept_up_to(fetch, accept, up_to: int) -> int:
    """Accept every pending item (``fetch(offset)``: a page, newest first) with an id up to ``up_to``."""
    done, offset = 0, 0
    while page := fetch(offset):
        ids = [item.id for item in page if item.id <= up_to]
        offset += len(page) - len(ids)  # the newer ones stay pending: step over them
        if ids:
            done += accept(ids)
    return done


def accept_all(tab: TrainTab, token: str | None, profile, up_to) -> str:
    """Accept every pending row and vote up to ``up_to`` (``newest_pending`` of the trainer's page;
    a single id: rows only)."""
    with explained("accept the pending rows"):
        user = require(tab.auth, token, profile, "review feedback")
        rows_up_to, votes_up_to = up_to if isinstance(up_to, (list, tuple)) else (up_to, 0)
        store = tab.feedback_store()
        done = _accept_up_to(
            lambda offset: store.rows("pending", limit=MAX_LIST, offset=offset),
            lambda ids: store.set_status(ids, "accepted"),
            int(rows_up_to or 0),
        )
        votes = _accept_up_to(
            lambda offset: store.votes("pending", limit=MAX_LIST, offset=offset),
            lambda ids: store.set_vote_status(ids, "accepted"),
            int(votes_up_to or 0),
        )
        log.info("%d pending feedback rows and %d votes accepted (%s)", done, votes, user)
        also = f" and {votes} Compare vote{'s' if votes != 1 else ''}" if votes else ""
        return f"{done} pending row{'s' if done != 1 else ''}{also} accepted."


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


def export_preference_file(tab: TrainTab, token: str | None, profile, objective: str) -> tuple[dict, str]:
    """The accepted feedback as ``objective``'s preference rows ("dpo": pairs from corrections and
    votes, "kto": rows from likes and dislikes), one ``.jsonl`` for the trainer's browser to save,
    in the format ``--preference_file`` reads; written under the data root first, like ``export_file``."""
    with explained(f"export the {str(objective).upper()[:8]} rows"):
        user = require(tab.auth, token, profile, "export feedback")
        if objective not in ("dpo", "kto"):
            raise ValueError(f"preference rows are dpo or kto rows, not {str(objective)[:20]!r}")
        stamp = time.strftime("%Y%m%d-%H%M%S")
        path, rows = export_preferences(tab.feedback_store(), objective, export_folder(tab, f"{objective}-{stamp}"))
        name = f"feedback-{objective}-{stamp}.jsonl"
        log.info("%s export of %d rows for %s (%s)", objective, rows, user, path)
        what = "pairs" if objective == "dpo" else "rows"
        return {"name": name, "text": path.read_text(encoding="utf-8")}, (
            f"Exported {rows} {objective.upper()} {what if rows != 1 else what[:-1]}: your browser saves "
            f"{'them' if rows != 1 else 'it'} as **{name}** (for `--objective {objective} --preference_file`)."
        )


def export_folder(tab: TrainTab, name: str):
    """A new folder for an export under the store's exports (the data root: never served)."""
    return tab.feedback_store().path.parent / "exports" / f"{name}-{secrets.token_hex(3)}"
