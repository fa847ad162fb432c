"""Preference rows from the accepted feedback: what DPO and KTO (``--objective dpo|kto``) train on.

- a correction -> a DPO pair: chosen = the correction, rejected = the reply the bot gave;
- a Compare vote -> a DPO pair: chosen = the winner's reply, rejected = the loser's (ties give none);
- a 👍 like / 👎 dislike -> a KTO row: the reply, label true / false.

Only accepted rows and votes count (a trainer reviewed them). The rows are written in the format
``finetune.preference_data`` validates (structured ``kind``, ``context``, ``turns``; then
``chosen``/``rejected`` or ``response``/``label``), with a ``source`` field saying where each came
from ("correction 12", "vote 3", "like 7"), which training ignores.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from finetune.feedback import MAX_LIST, FeedbackError, FeedbackStore, _write_failure
from finetune.writes import write_jsonl

log = logging.getLogger(__name__)

OBJECTIVES = ("dpo", "kto")
FILE_NAMES = {"dpo": "dpo.jsonl", "kto": "kto.jsonl"}


@dataclass(frozen=True)
class PreferenceCounts:
    """How many preference rows the accepted feedback gives, by where they come from."""

    corrections: int = 0  # DPO pairs from corrections
    votes: int = 0  # DPO pairs from Compare votes
    likes: int = 0  # KTO rows, label true
    dislikes: int = 0  # KTO rows, label false

    @property
    def pairs(self) -> int:
        return self.corrections + self.votes

    @property
    def kto(self) -> int:
        return self.likes + self.dislikes

    def of(self, objective: str) -> int:
        return self.pairs if objective == "dpo" else self.kto if objective == "kto" else 0


def _every(fetch: Callable[[int], list]) -> list:
    """Every row a paged query (``fetch(offset)``, at most MAX_LIST per page) gives."""
    found, offset = [], 0
    while page := fetch(offset):
        found += page
        offset += len(page)
        if len(page) < MAX_LIST:
            break
    return found


def _conversation(row) -> dict:
    return {"kind": row.kind, "context": row.context, "turns": list(row.turns)}


def preference_rows(store: FeedbackStore, objective: str) -> list[dict]:
    """The ``objective``'s rows ("dpo": pairs, "kto": single replies) of the accepted feedback,
    oldest first (so a file's every 10th held-out row is the same each time)."""
    if objective not in OBJECTIVES:
        raise FeedbackError(f"preference rows are for dpo or kto, not {objective!r}")
    rows = _every(lambda offset: store.rows("accepted", limit=MAX_LIST, offset=offset))
    found = []  # (created, row)
    if objective == "dpo":
        for r in rows:
            if r.rating == "correction" and r.original and r.original != r.response:
                pair = {"chosen": r.response, "rejected": r.original, "source": f"correction {r.id}"}
                found.append((r.created, {**_conversation(r), **pair}))
        for v in _every(lambda offset: store.votes("accepted", limit=MAX_LIST, offset=offset)):
            if v.turns and v.chosen != v.rejected:
                pair = {"chosen": v.chosen, "rejected": v.rejected, "source": f"vote {v.id}"}
                found.append((v.created, {**_conversation(v), **pair}))
    else:
        for r in rows:
            if r.rating in ("like", "dislike"):
                reply = r.response if r.rating == "like" else (r.original or r.response)
                single = {"response": reply, "label": r.rating == "like", "source": f"{r.rating} {r.id}"}
                found.append((r.created, {**_conversation(r), **single}))
    return [row for _, row in sorted(found, key=lambda item: item[0])]


def preference_counts(store: FeedbackStore) -> PreferenceCounts:
    """How many rows of each kind ``preference_rows`` gives now."""
    pairs = [row["source"].split()[0] for row in preference_rows(store, "dpo")]
    labels = [row["label"] for row in preference_rows(store, "kto")]
    return PreferenceCounts(pairs.count("correction"), pairs.count("vote"), labels.count(True), labels.count(False))


def export_preferences(store: FeedbackStore, objective: str, folder: str | Path) -> tuple[Path, int]:
    """Write the ``objective``'s rows to ``folder``/dpo.jsonl or kto.jsonl (in one rename);
    returns (the file, its rows). FeedbackError when there are none, or the write fails."""
    rows = preference_rows(store, objective)
    if not rows:
        what = "corrections or Compare votes" if objective == "dpo" else "liked or disliked replies"
        raise FeedbackError(f"there are no {objective.upper()} rows to train on: accept {what} first")
    out = Path(folder)
    try:
        out.mkdir(parents=True, exist_ok=True)
        path = write_jsonl(out / FILE_NAMES[objective], rows)
    except OSError as err:
        failure = _write_failure(err, out)
        if failure is None:
            raise
        raise FeedbackError(f"{failure}; the preference rows were not written") from err
    log.info("exported %d %s rows to %s", len(rows), objective, path)
    return path, len(rows)
