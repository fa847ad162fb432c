"""The feedback store's Compare votes: what a vote keeps and its schema migration
(``finetune.feedback.FeedbackStore`` stores, lists and reviews them).

A vote keeps the two models and the winner (a | b | tie) for the win rates, and, since issue 27,
the conversation both models answered (kind, context, the turns ending with the user's message)
and both replies, so an accepted vote becomes a preference pair (chosen = the winner's reply,
rejected = the loser's; a tie is kept as a tie and gives no pair). Votes of visitors wait for a
trainer's review like chat feedback (status pending); a trainer's own votes are accepted at once.

Stores written before the replies were kept gain the new columns in place (``migrate``: SQLite's
``ALTER TABLE ADD COLUMN`` with defaults): every earlier vote stays, counts in the win rates, and
is never offered for review (it has no replies).
"""

from __future__ import annotations

import json
import sqlite3
import time
from dataclasses import dataclass

# The columns added to the first schema's votes table, each with the value old rows get.
ADDED_COLUMNS = {
    "kind": "TEXT NOT NULL DEFAULT ''",
    "context": "TEXT NOT NULL DEFAULT ''",
    "turns": "TEXT NOT NULL DEFAULT '[]'",
    "reply_a": "TEXT NOT NULL DEFAULT ''",
    "reply_b": "TEXT NOT NULL DEFAULT ''",
    "status": "TEXT NOT NULL DEFAULT 'pending'",
}
COLUMNS = "id, model_a, model_b, winner, kind, context, turns, reply_a, reply_b, status, visitor, created"
# A vote a trainer can review: it kept both replies and has a winner (a tie gives no pair).
REVIEWABLE = "reply_a != '' AND reply_b != '' AND winner != 'tie'"


@dataclass(frozen=True)
class VoteRow:
    id: int
    model_a: str
    model_b: str
    winner: str  # a | b | tie
    kind: str
    context: str
    turns: list[str]  # the conversation both models answered, ending with the user's message
    reply_a: str  # model_a's reply ("" for a vote stored before replies were kept)
    reply_b: str
    status: str  # pending | accepted | rejected
    visitor: str
    created: float

    @property
    def chosen(self) -> str:
        return self.reply_a if self.winner == "a" else self.reply_b

    @property
    def rejected(self) -> str:
        return self.reply_b if self.winner == "a" else self.reply_a


def vote_row(record: tuple) -> VoteRow:
    values = list(record)
    values[6] = json.loads(values[6] or "[]")
    return VoteRow(*values)


def migrate(con: sqlite3.Connection) -> list[str]:
    """Add the columns a store of the first schema lacks (in the caller's transaction); returns their names."""
    have = {row[1] for row in con.execute("PRAGMA table_info(votes)")}
    added = [name for name in ADDED_COLUMNS if name not in have]
    for name in added:
        con.execute(f"ALTER TABLE votes ADD COLUMN {name} {ADDED_COLUMNS[name]}")
    con.execute("CREATE INDEX IF NOT EXISTS votes_status ON votes (status, id)")
    return added


def _wait(seconds: float) -> str:
    for unit, size in (("h", 3600), ("min", 60)):
        if seconds >= size:
            return f"{-(-seconds // size):.0f} {unit}"
    return f"{max(1, -(-seconds // 1)):.0f} s"


def visitor_problem(
    con: sqlite3.Connection, visitor: str, model_a: str, model_b: str, most: int, per_hour, per_pair_per_day
) -> str | None:
    """Why a visitor's vote is not counted, and when one will be (None: it is): over ``most`` votes
    in all, or ``per_hour`` / ``per_pair_per_day`` (votes, seconds; the pair in either order)."""
    (mine,) = con.execute("SELECT COUNT(*) FROM votes WHERE visitor = ?", (visitor,)).fetchone()
    if mine >= most:
        return f"you have voted {mine} times (the limit is {most}); this vote was not counted"
    now, pair = time.time(), "AND model_a = ? AND model_b = ?"
    for (limit, window), where, args, what in (
        (per_hour, "", (), "in the last hour"),
        (per_pair_per_day, pair, (model_a, model_b), "on these two models in the last day"),
    ):
        # the limit-th newest vote in the window: one more fits once it is out of the window
        found = con.execute(
            f"SELECT created FROM votes WHERE visitor = ? {where} AND created > ?"
            " ORDER BY created DESC LIMIT 1 OFFSET ?",
            (visitor, *args, now - window, limit - 1),
        ).fetchone()
        if found:
            return (
                f"you have voted {limit} times {what}, the most one visitor may (so that no one visitor decides "
                f"the win rates); this vote was not counted: try again in {_wait(found[0] + window - now)}"
            )
    return None
