"""The feedback store: chat ratings and corrections that become training rows, and Compare votes.

What: one row per rated bot reply (kind, context, the turns before, the response the bot SHOULD give,
the reply it gave, the rating, the model, the time, a review status and an opaque visitor key), and
one row per Compare vote (two models, the winner; with the conversation and both replies, reviewed
like the rows: ``finetune.feedback_votes``). Texts are neutralized (``chat.prompt.neutralize``)
and clipped when stored, so a visitor's ``<s>`` can never become a special token in a training label.

Where: ``data_root()/feedback/feedback.sqlite3`` (PERSONA_CHAT_DATA, read at call time), with the
salt of ``visitor_key`` beside it; ``export`` writes ``exports/<stamp>/train.jsonl`` (+ ``heldout.jsonl``)
in the structured format ``--train_file`` reads.

Why SQLite (stdlib, WAL): every add is one transaction, so a row is written whole or not at all, also
under many concurrent clients (threads or processes), an app restart or a full disk; readers never
block writers. Each call opens its own short-lived connection, so the store is safe to share between
threads and processes. The bound checks and the insert run in one ``BEGIN IMMEDIATE`` transaction
(the write lock is taken first), so concurrent clients cannot overshoot a bound.

Bounds (anonymous visitors may rate on a public Space): MAX_PENDING_PER_VISITOR pending rows per
visitor (trainer rows, visitor ``trainer:<name>``, exempt), MAX_ROWS rows and MAX_BYTES of text in
total, MAX_VOTES votes (per visitor: MAX_VOTES_PER_VISITOR, VOTES_PER_HOUR, VOTES_PER_PAIR_PER_DAY);
``add``/``vote`` raise FeedbackError when one is hit, saying which.
"""

from __future__ import annotations

import contextlib
import hashlib
import hmac
import json
import logging
import secrets
import sqlite3
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

from chat.prompt import KINDS, build_source, format_context, neutralize
from finetune import feedback_votes
from finetune.feedback_votes import REVIEWABLE, VoteRow, vote_row
from finetune.jobs.paths import data_root
from finetune.visitor_salt import read_salt
from finetune.writes import diagnose, write_error, write_jsonl

log = logging.getLogger(__name__)

RATINGS = ("like", "dislike", "correction")
STATUSES = ("pending", "accepted", "rejected")
WINNERS = ("a", "b", "tie")
TRAINER_PREFIX = "trainer:"  # visitor of a row a logged-in trainer made

MAX_PENDING_PER_VISITOR = 200  # one visitor cannot bury the review queue
MAX_ROWS = 20_000  # far more than a trainer reviews; keeps review queries and exports instant
MAX_BYTES = 64 * 2**20  # text of all rows and votes together: the store's share of the data root
MAX_VOTES = 50_000  # votes are tiny, but anyone may cast them
MAX_VOTES_PER_VISITOR = 1_000  # in all
# Votes over time, per visitor (votes, seconds): an honest vote takes a message, two replies and a
# read, so a vote every two minutes for an hour, or 20 on one pair of models in a day, is far more
# than one person's opinion needs; a visitor cannot vote a small leaderboard into another order.
VOTES_PER_HOUR = (30, 3600)
VOTES_PER_PAIR_PER_DAY = (20, 24 * 3600)
MAX_TURNS = 16  # the newest turns kept: more never fit the encoder's 128 tokens anyway
MAX_TURN_CHARS = 1_000  # per turn (its newest characters, as chat.prompt.fit_source would keep)
MAX_RESPONSE_CHARS = 1_000  # response and original
MAX_CONTEXT_CHARS = 600
MAX_NAME_CHARS = 200  # model names and visitor keys
MAX_LIST = 1_000  # rows() returns at most this many at once
SALT_FILE = "visitor.salt"
LOCK_TIMEOUT_S = 30  # a write waits this long for another's lock (each holds it for milliseconds)

_SCHEMA = """
CREATE TABLE IF NOT EXISTS feedback (
    id INTEGER PRIMARY KEY AUTOINCREMENT, kind TEXT NOT NULL, context TEXT NOT NULL, turns TEXT NOT NULL,
    response TEXT NOT NULL, original TEXT NOT NULL, rating TEXT NOT NULL, model TEXT NOT NULL,
    created REAL NOT NULL, status TEXT NOT NULL, visitor TEXT NOT NULL, size INTEGER NOT NULL);
CREATE INDEX IF NOT EXISTS feedback_status ON feedback (status, id);
CREATE INDEX IF NOT EXISTS feedback_visitor ON feedback (visitor, status);
CREATE TABLE IF NOT EXISTS votes (
    id INTEGER PRIMARY KEY AUTOINCREMENT, model_a TEXT NOT NULL, model_b TEXT NOT NULL, winner TEXT NOT NULL,
    visitor TEXT NOT NULL, message TEXT NOT NULL, created REAL NOT NULL, size INTEGER NOT NULL);
CREATE INDEX IF NOT EXISTS votes_visitor ON votes (visitor);
"""
_COLUMNS = "id, kind, context, turns, response, original, rating, model, created, status, visitor"


class FeedbackError(ValueError):
    """A message meant for the user: a bad row, a bound hit, a full disk."""


@dataclass(frozen=True)
class FeedbackRow:
    id: int
    kind: str
    context: str
    turns: list[str]
    response: str  # what the bot SHOULD say
    original: str  # the bot's reply as it was given ("" if none)
    rating: str  # like | dislike | correction
    model: str  # the model that answered
    created: float  # unix time
    status: str  # pending | accepted | rejected
    visitor: str  # an opaque salted hash (never an IP) or "trainer:<name>"


@dataclass(frozen=True)
class FeedbackExport:
    train: Path
    heldout: Path | None
    rows: int
    heldout_rows: int


def feedback_path(root: str | Path | None = None) -> Path:
    """The store's database under the data root ``root`` (default: ``data_root()``, read now)."""
    return Path(root if root is not None else data_root()) / "feedback" / "feedback.sqlite3"


_WRITE_CODES = ("SQLITE_FULL", "SQLITE_IOERR", "SQLITE_READONLY", "SQLITE_CANTOPEN", "SQLITE_PERM")


def _write_failure(err: BaseException, where: Path) -> str | None:
    """Why a write into the folder ``where`` failed, naming the file (from ``where``'s parent on:
    visitors read it, not the server's folders) and the cause (``finetune.writes``); None when
    ``err`` is no failed write. SQLite's errors carry no errno ("database or disk is full" also for
    a file-size limit), so the cause is found afterwards."""
    if isinstance(err, sqlite3.Error):
        code = getattr(err, "sqlite_errorcode", 0) & 0xFF
        if code not in {getattr(sqlite3, name, -1) for name in _WRITE_CODES} and "readonly" not in str(err):
            return None
        failure = diagnose(where, str(err))
    else:
        failure = write_error(err, where)
        if failure is None:
            return None
    file = Path(failure.file)
    shown = file.relative_to(where.parent) if file.is_relative_to(where.parent) else file.name
    return f"cannot write {shown}: {failure.cause}"


def _text(value, field: str, limit: int, *, required: bool = True, keep_end: bool = False) -> str:
    """``value`` neutralized and clipped to ``limit`` characters (its start, or its end)."""
    if not isinstance(value, str):
        raise FeedbackError(f"{field} must be text, got {type(value).__name__}")
    text = neutralize(value)
    if len(text) > limit:
        text = (text[-limit:] if keep_end else text[:limit]).strip()
    if required and not text:
        raise FeedbackError(f"{field} is empty")
    return text


def _choice(value, field: str, allowed: Sequence[str]) -> str:
    if value not in allowed:
        raise FeedbackError(f"unknown {field} {value!r}: expected one of {', '.join(allowed)}")
    return value


def _visitor(value) -> str:
    if not isinstance(value, str) or not value.strip():
        raise FeedbackError("the visitor is missing")
    return value.strip()[:MAX_NAME_CHARS]


def _size(*texts: str) -> int:
    return sum(len(t.encode("utf-8")) for t in texts)


def _pair(pair) -> tuple[str, str, str, str, str]:
    """(kind, context, turns as JSON, reply a, reply b) of a vote's ``pair``, checked like a
    feedback row; all empty for None."""
    if pair is None:
        return "", "", "[]", "", ""
    if not isinstance(pair, dict):
        raise FeedbackError("a vote's pair must be a dict of kind, context, turns, reply_a and reply_b")
    kind = _choice(pair.get("kind"), "kind", KINDS)
    context = (
        "" if kind == "none" else _text(pair.get("context") or "", "the context", MAX_CONTEXT_CHARS, required=False)
    )
    turns = pair.get("turns")
    if isinstance(turns, str) or not isinstance(turns, (list, tuple)) or not turns:
        raise FeedbackError("turns must be a non-empty list of strings")
    clean = [_text(t, f"turn {i + 1}", MAX_TURN_CHARS, keep_end=True) for i, t in enumerate(list(turns)[-MAX_TURNS:])]
    replies = [_text(pair.get(f"reply_{side}"), f"reply {side}", MAX_RESPONSE_CHARS) for side in "ab"]
    return kind, context, json.dumps(clean, ensure_ascii=False), *replies


def _row(record: tuple) -> FeedbackRow:
    values = list(record)
    values[3] = json.loads(values[3])
    return FeedbackRow(*values)


class FeedbackStore:
    """The store at ``path`` (default ``feedback_path()``); folders and schema are created here."""

    def __init__(self, path: str | Path | None = None):
        self.path = Path(path) if path is not None else feedback_path()
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            with self._connect() as con:
                if con.execute("PRAGMA journal_mode").fetchone()[0].lower() != "wal":
                    con.execute("PRAGMA journal_mode=WAL")  # persistent: set once per database file
            with self._write() as con:
                for statement in filter(str.strip, _SCHEMA.split(";")):
                    con.execute(statement)
                added = feedback_votes.migrate(con)  # a store of the first schema: its votes all kept
            if added:
                log.info("feedback store %s: votes gained the columns %s", self.path, ", ".join(added))
        except (OSError, sqlite3.Error) as err:
            failure = _write_failure(err, self.path.parent)
            if failure:
                raise FeedbackError(f"{failure}: the feedback store cannot be created") from err
            raise

    # ------------------------------------------------------------------ connections
    @contextlib.contextmanager
    def _connect(self) -> Iterator[sqlite3.Connection]:
        # autocommit (isolation_level=None): transactions are explicit; timeout: wait for the write lock
        con = sqlite3.connect(str(self.path), timeout=LOCK_TIMEOUT_S, isolation_level=None)
        try:
            yield con
        finally:
            con.close()

    @contextlib.contextmanager
    def _write(self, what: str = "the change") -> Iterator[sqlite3.Connection]:
        """One BEGIN IMMEDIATE transaction: the write lock first, so checks and writes see one state."""
        try:
            with self._connect() as con:
                con.execute("BEGIN IMMEDIATE")
                try:
                    yield con
                    con.execute("COMMIT")
                except BaseException:
                    with contextlib.suppress(sqlite3.Error):  # SQLite may have rolled back already
                        con.execute("ROLLBACK")
                    raise
        except (OSError, sqlite3.Error) as err:
            if "locked" in str(err):  # another writer held the lock for the whole timeout
                raise FeedbackError(f"the feedback store is busy; {what} was not saved, try again") from err
            failure = _write_failure(err, self.path.parent)
            if failure is None:
                raise
            log.error("feedback store %s: write failed: %s (%s)", self.path, failure, err)
            raise FeedbackError(f"{failure}; {what} was not saved") from err

    # ------------------------------------------------------------------ feedback rows
    def add(self, *, kind, context, turns, response, original="", rating, model="", visitor, status="pending") -> int:
        """Store one rated reply; returns its id. FeedbackError for a bad row or a bound hit."""
        kind = _choice(kind, "kind", KINDS)
        rating = _choice(rating, "rating", RATINGS)
        status = _choice(status, "status", STATUSES)
        visitor = _visitor(visitor)
        context = "" if kind == "none" else _text(context or "", "the context", MAX_CONTEXT_CHARS, required=False)
        try:
            format_context(kind, context)
        except ValueError as err:
            raise FeedbackError(str(err)) from None
        if isinstance(turns, str) or not isinstance(turns, (list, tuple)) or not turns:
            raise FeedbackError("turns must be a non-empty list of strings")
        turns = list(turns)[-MAX_TURNS:]
        clean = [_text(t, f"turn {i + 1}", MAX_TURN_CHARS, keep_end=True) for i, t in enumerate(turns)]
        response = _text(response, "the response", MAX_RESPONSE_CHARS)
        original = _text(original or "", "the original reply", MAX_RESPONSE_CHARS, required=False)
        model = _text(model or "", "the model", MAX_NAME_CHARS, required=False)
        turns_json = json.dumps(clean, ensure_ascii=False)
        size = _size(kind, context, turns_json, response, original, model, visitor)
        with self._write("the row") as con:
            if status == "pending" and not visitor.startswith(TRAINER_PREFIX):
                (pending,) = con.execute(
                    "SELECT COUNT(*) FROM feedback WHERE visitor = ? AND status = 'pending'", (visitor,)
                ).fetchone()
                if pending >= MAX_PENDING_PER_VISITOR:
                    raise FeedbackError(
                        f"you have {pending} rated replies waiting for review (the limit is "
                        f"{MAX_PENDING_PER_VISITOR}); please wait until a trainer has reviewed them"
                    )
            rows, used = con.execute("SELECT COUNT(*), COALESCE(SUM(size), 0) FROM feedback").fetchone()
            used += con.execute("SELECT COALESCE(SUM(size), 0) FROM votes").fetchone()[0]
            if rows >= MAX_ROWS or used + size > MAX_BYTES:
                raise FeedbackError(
                    f"the feedback store is full ({rows:,} rows, {used / 2**20:.1f} MB; the limits are "
                    f"{MAX_ROWS:,} rows and {MAX_BYTES / 2**20:g} MB); a trainer must delete reviewed rows first"
                )
            cur = con.execute(
                "INSERT INTO feedback (kind, context, turns, response, original, rating, model, created, status,"
                " visitor, size) VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?)",
                (kind, context, turns_json, response, original, rating, model, time.time(), status, visitor, size),
            )
            return cur.lastrowid

    def get(self, row_id: int) -> FeedbackRow:
        with self._connect() as con:
            record = con.execute(f"SELECT {_COLUMNS} FROM feedback WHERE id = ?", (int(row_id),)).fetchone()
        if record is None:
            raise FeedbackError(f"there is no feedback row #{row_id}")
        return _row(record)

    def rows(self, status: str | None = None, limit: int = 200, offset: int = 0) -> list[FeedbackRow]:
        """Rows (of one status, or all), newest first; at most MAX_LIST at once."""
        limit, offset = max(0, min(int(limit), MAX_LIST)), max(0, int(offset))
        where, args = ("", ()) if status is None else ("WHERE status = ?", (_choice(status, "status", STATUSES),))
        with self._connect() as con:
            found = con.execute(
                f"SELECT {_COLUMNS} FROM feedback {where} ORDER BY id DESC LIMIT ? OFFSET ?", (*args, limit, offset)
            ).fetchall()
        return [_row(r) for r in found]

    def counts(self) -> dict[str, int]:
        with self._connect() as con:
            found = dict(con.execute("SELECT status, COUNT(*) FROM feedback GROUP BY status").fetchall())
        return {status: found.get(status, 0) for status in STATUSES}

    def set_status(self, row_ids: list[int], status: str) -> int:
        """Set the review status of rows; returns how many exist (and now have it)."""
        status = _choice(status, "status", STATUSES)
        ids = sorted({int(i) for i in row_ids})
        with self._write("the review") as con:
            return sum(con.execute("UPDATE feedback SET status = ? WHERE id = ?", (status, i)).rowcount for i in ids)

    def edit(self, row_id: int, response: str) -> FeedbackRow:
        """A trainer's better reply: becomes the row's response, the rating "correction"."""
        response = _text(response, "the response", MAX_RESPONSE_CHARS)
        with self._write("the edit") as con:
            record = con.execute("SELECT response, original, size FROM feedback WHERE id = ?", (int(row_id),))
            found = record.fetchone()
            if found is None:
                raise FeedbackError(f"there is no feedback row #{row_id}")
            old, old_original, size = found
            original = old_original or old  # keep what the bot said (a liked row may come without it)
            size += _size(response, original) - _size(old, old_original)
            con.execute(
                "UPDATE feedback SET response = ?, original = ?, rating = 'correction', size = ? WHERE id = ?",
                (response, original, size, int(row_id)),
            )
        return self.get(row_id)

    def delete(self, row_ids: list[int]) -> int:
        """Remove rows for good (frees room under the bounds); returns how many existed."""
        ids = sorted({int(i) for i in row_ids})
        with self._write("the deletion") as con:
            return sum(con.execute("DELETE FROM feedback WHERE id = ?", (i,)).rowcount for i in ids)

    def export(self, folder: str | Path | None = None, holdout_every: int = 10) -> FeedbackExport:
        """Write the accepted good replies (like / correction) as structured JSON lines.

        With at least 2 * holdout_every rows, every holdout_every-th (by id) goes to heldout.jsonl.
        ``folder`` defaults to a new ``exports/<UTC stamp>-<random>/`` beside the db (for the default
        store: ``data_root()/feedback/exports/...``)."""
        with self._connect() as con:
            found = con.execute(
                f"SELECT {_COLUMNS} FROM feedback WHERE status = 'accepted' AND rating IN ('like', 'correction')"
                " ORDER BY id"
            ).fetchall()
        rows = [_row(r) for r in found]
        if not rows:
            raise FeedbackError("there are no accepted rows to train on: accept liked or corrected replies first")
        every = int(holdout_every)
        split = every > 0 and len(rows) >= 2 * every
        heldout = [r for i, r in enumerate(rows, 1) if split and i % every == 0]
        train = [r for i, r in enumerate(rows, 1) if not (split and i % every == 0)]
        if folder is None:
            stamp = time.strftime("%Y%m%d-%H%M%S", time.gmtime())
            out = self.path.parent / "exports" / f"{stamp}-{secrets.token_hex(3)}"
        else:
            out = Path(folder)
        try:
            out.mkdir(parents=True, exist_ok=folder is not None)
            train_path = write_jsonl(out / "train.jsonl", map(_line, train))
            heldout_path = write_jsonl(out / "heldout.jsonl", map(_line, heldout)) if heldout else None
            if not heldout:  # a folder exported into before must not keep an older held-out file
                (out / "heldout.jsonl").unlink(missing_ok=True)
        except OSError as err:
            failure = _write_failure(err, out)
            if failure is None:
                raise
            raise FeedbackError(f"{failure}; the export was not written") from err
        log.info("exported %d feedback rows (+%d held out) to %s", len(train), len(heldout), out)
        return FeedbackExport(train_path, heldout_path, len(train), len(heldout))

    # ------------------------------------------------------------------ votes (Compare view)
    def vote(
        self, *, model_a: str, model_b: str, winner: str, visitor: str, message: str = "", pair=None, status="pending"
    ) -> int:
        """Store one vote (winner a | b | tie); returns its id. The pair is stored sorted, so
        (x, y) and (y, x) count together (the winner and the replies flipped with it). ``pair``:
        what both models answered and said, {"kind", "context", "turns", "reply_a", "reply_b"}
        (None: the vote counts in the win rates only); a vote with it waits for review (``status``)."""
        winner = _choice(winner, "winner", WINNERS)
        status = _choice(status, "status", STATUSES)
        visitor = _visitor(visitor)
        model_a = _text(model_a, "model a", MAX_NAME_CHARS)
        model_b = _text(model_b, "model b", MAX_NAME_CHARS)
        message = _text(message or "", "the message", MAX_RESPONSE_CHARS, required=False)
        kind, context, turns, reply_a, reply_b = _pair(pair)
        if model_a == model_b:
            raise FeedbackError("a vote needs two different models")
        if model_a > model_b:
            model_a, model_b, winner = model_b, model_a, {"a": "b", "b": "a"}.get(winner, winner)
            reply_a, reply_b = reply_b, reply_a
        size = _size(model_a, model_b, winner, visitor, message, kind, context, turns, reply_a, reply_b)
        with self._write("the vote") as con:
            if not visitor.startswith(TRAINER_PREFIX):
                limits = (MAX_VOTES_PER_VISITOR, VOTES_PER_HOUR, VOTES_PER_PAIR_PER_DAY)
                problem = feedback_votes.visitor_problem(con, visitor, model_a, model_b, *limits)
                if problem:
                    raise FeedbackError(problem)
            votes, used = con.execute("SELECT COUNT(*), COALESCE(SUM(size), 0) FROM votes").fetchone()
            used += con.execute("SELECT COALESCE(SUM(size), 0) FROM feedback").fetchone()[0]
            if votes >= MAX_VOTES or used + size > MAX_BYTES:
                raise FeedbackError(f"the vote store is full ({votes:,} votes); the vote was not saved")
            cur = con.execute(
                "INSERT INTO votes (model_a, model_b, winner, visitor, message, created, size, kind, context, turns,"
                " reply_a, reply_b, status) VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?)",
                (model_a, model_b, winner, visitor, message, time.time(), size, kind, context, turns, reply_a,
                 reply_b, status),
            )  # fmt: skip
            return cur.lastrowid

    def votes(self, status: str | None = None, limit: int = 200, offset: int = 0) -> list[VoteRow]:
        """The votes a trainer reviews (both replies kept, not a tie), of one status or all, newest first."""
        limit, offset = max(0, min(int(limit), MAX_LIST)), max(0, int(offset))
        where, args = ("", ()) if status is None else ("AND status = ?", (_choice(status, "status", STATUSES),))
        with self._connect() as con:
            found = con.execute(
                f"SELECT {feedback_votes.COLUMNS} FROM votes WHERE {REVIEWABLE} {where} ORDER BY id DESC"
                " LIMIT ? OFFSET ?",
                (*args, limit, offset),
            ).fetchall()
        return [vote_row(r) for r in found]

    def get_vote(self, vote_id: int) -> VoteRow:
        with self._connect() as con:
            record = con.execute(
                f"SELECT {feedback_votes.COLUMNS} FROM votes WHERE id = ? AND {REVIEWABLE}", (int(vote_id),)
            ).fetchone()
        if record is None:
            raise FeedbackError(f"there is no vote #{vote_id} to review")
        return vote_row(record)

    def vote_counts(self) -> dict[str, int]:
        """How many reviewable votes (see ``votes``) have each status."""
        with self._connect() as con:
            found = dict(con.execute(f"SELECT status, COUNT(*) FROM votes WHERE {REVIEWABLE} GROUP BY status"))
        return {status: found.get(status, 0) for status in STATUSES}

    def set_vote_status(self, vote_ids: list[int], status: str) -> int:
        """Set the review status of reviewable votes; returns how many exist (and now have it)."""
        status = _choice(status, "status", STATUSES)
        ids = sorted({int(i) for i in vote_ids})
        with self._write("the review") as con:
            update = f"UPDATE votes SET status = ? WHERE id = ? AND {REVIEWABLE}"
            return sum(con.execute(update, (status, i)).rowcount for i in ids)

    def win_rates(self) -> list[dict]:
        """One dict per unordered model pair (most votes first): model_a, model_b, a_wins, b_wins,
        ties, total, a_rate = (a_wins + ties / 2) / total."""
        with self._connect() as con:
            found = con.execute(
                "SELECT model_a, model_b, SUM(winner = 'a'), SUM(winner = 'b'), SUM(winner = 'tie'), COUNT(*)"
                " FROM votes GROUP BY model_a, model_b ORDER BY COUNT(*) DESC, model_a, model_b"
            ).fetchall()
        keys = ("model_a", "model_b", "a_wins", "b_wins", "ties", "total")
        return [{**dict(zip(keys, r)), "a_rate": (r[2] + r[4] / 2) / r[5]} for r in found]

    # ------------------------------------------------------------------ visitors
    def visitor_key(self, client_address: str | None) -> str:
        """``visitor_key`` with this store's salt (beside its db)."""
        return visitor_key(client_address, self.path.parent / SALT_FILE)


def _line(r: FeedbackRow) -> dict:
    """An exported row: the structured format ``--train_file`` reads, and where it came from."""
    return {"kind": r.kind, "context": r.context, "turns": r.turns, "response": r.response, "id": r.id,
            "rating": r.rating, "model": r.model}  # fmt: skip


def visitor_key(client_address: str | None, salt_file: str | Path | None = None) -> str:
    """A short salted hash (HMAC-SHA256) of a client address; the salt (default: beside feedback_path())
    never leaves the server, so the key cannot be reversed into the address."""
    try:
        salt = read_salt(Path(salt_file) if salt_file is not None else feedback_path().parent / SALT_FILE)
    except ValueError as err:
        raise FeedbackError(str(err)) from None
    return hmac.new(salt, str(client_address or "").encode("utf-8", "replace"), hashlib.sha256).hexdigest()[:16]


def encoder_text(row: FeedbackRow, source_prefix: str = "chatbot: ") -> str:
    """Exactly what the encoder reads for ``row`` (the training format's one source of truth)."""
    return source_prefix + build_source(row.kind, row.context, row.turns)
