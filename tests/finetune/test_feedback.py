"""The feedback store (finetune/feedback.py): real SQLite files, concurrent threads and processes, a real
full-disk failure, exports read back by finetune.data."""

import json
import multiprocessing
import os
import stat
import subprocess
import sys
import threading

import pytest
from write_faults import read_only

from chat.layout import ROOT
from chat.prompt import build_source
from finetune import feedback
from finetune.feedback import FeedbackError, FeedbackStore, encoder_text

ROW = {
    "kind": "persona",
    "context": "i love cats.",
    "turns": ["hi there", "hello!", "do you have pets?"],
    "response": "yes, two cats.",
    "original": "no.",
    "rating": "correction",
    "model": "tiny",
    "visitor": "abc123",
}


@pytest.fixture
def store(tmp_path):
    return FeedbackStore(tmp_path / "fb" / "feedback.sqlite3")


def test_round_trip_newest_first_and_counts(store):
    first = store.add(**ROW)
    second = store.add(**{**ROW, "kind": "none", "context": "ignored", "rating": "like", "original": ""})
    row = store.get(first)
    assert (row.kind, row.context, row.turns, row.response, row.original) == (
        "persona",
        "i love cats.",
        ["hi there", "hello!", "do you have pets?"],
        "yes, two cats.",
        "no.",
    )
    assert (row.rating, row.model, row.status, row.visitor) == ("correction", "tiny", "pending", "abc123")
    assert store.get(second).context == ""  # kind none has no context
    assert [r.id for r in store.rows()] == [second, first]
    assert [r.id for r in store.rows(limit=1, offset=1)] == [first]
    assert store.counts() == {"pending": 2, "accepted": 0, "rejected": 0}
    assert store.rows("accepted") == []
    # a fresh store object on the same file (an app restart) sees the same rows; the db is in WAL mode
    again = FeedbackStore(store.path)
    assert again.get(first) == row
    import sqlite3

    con = sqlite3.connect(store.path)
    assert con.execute("PRAGMA journal_mode").fetchone()[0] == "wal"
    con.close()


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"kind": "poem"}, "unknown kind 'poem'"),
        ({"context": "  "}, "kind 'persona' needs a non-empty context"),
        ({"context": "<s>"}, "needs a non-empty context"),
        ({"turns": "hello"}, "turns must be a non-empty list"),
        ({"turns": []}, "turns must be a non-empty list"),
        ({"turns": ["hi", 3]}, "turn 2 must be text"),
        ({"turns": ["hi", "</s>"]}, "turn 2 is empty"),
        ({"response": " "}, "the response is empty"),
        ({"response": "<s> </s>"}, "the response is empty"),
        ({"rating": "meh"}, "unknown rating 'meh'"),
        ({"status": "done"}, "unknown status 'done'"),
        ({"visitor": ""}, "the visitor is missing"),
    ],
)
def test_bad_rows_are_refused_with_a_clear_message(store, change, message):
    with pytest.raises(FeedbackError, match=message):
        store.add(**{**ROW, **change})
    assert store.counts()["pending"] == 0


def test_special_tokens_typed_by_a_visitor_are_neutralized_and_long_texts_clipped(store):
    row_id = store.add(
        **{
            **ROW,
            "context": "i am <s> a </S > cat\x00",
            "turns": [f"turn {i}" for i in range(20)] + ["what <pad> is </s><s> this <<s>s>?" + "x" * 2000],
            "response": "a <mask> reply </s>" + "y" * 2000,
        }
    )
    row = store.get(row_id)
    assert row.context == "i am a cat"
    assert len(row.turns) == feedback.MAX_TURNS and row.turns[0] == "turn 5"
    assert len(row.turns[-1]) == feedback.MAX_TURN_CHARS and row.turns[-1].endswith("x")  # the newest end kept
    assert len(row.response) == feedback.MAX_RESPONSE_CHARS and row.response.startswith("a reply y")
    source = encoder_text(row)
    assert source == "chatbot: " + build_source(row.kind, row.context, row.turns)
    # only the format's own separators: one </s> after the persona, one <s> before each turn
    assert source.count("<s>") == len(row.turns) and source.count("</s>") == len(row.turns)
    assert "<" not in row.response + "".join(row.turns[:-1])


def test_per_visitor_pending_bound_trainers_exempt_and_total_bounds(store, monkeypatch):
    monkeypatch.setattr(feedback, "MAX_PENDING_PER_VISITOR", 3)
    ids = [store.add(**ROW) for _ in range(3)]
    with pytest.raises(FeedbackError, match="you have 3 rated replies waiting for review"):
        store.add(**ROW)
    store.add(**{**ROW, "visitor": "someone-else"})
    for _ in range(5):  # a trainer's rows are not bounded per visitor
        store.add(**{**ROW, "visitor": "trainer:ann"})
    store.set_status(ids[:1], "accepted")  # reviewed: room for one more
    store.add(**ROW)
    with pytest.raises(FeedbackError, match="waiting for review"):
        store.add(**ROW)
    store.add(**{**ROW, "status": "accepted"})  # only pending rows count

    total = sum(store.counts().values())
    monkeypatch.setattr(feedback, "MAX_ROWS", total + 1)
    store.add(**{**ROW, "visitor": "trainer:ann"})
    with pytest.raises(FeedbackError, match="the feedback store is full"):
        store.add(**{**ROW, "visitor": "trainer:ann"})  # the totals bind trainers too
    assert sum(store.counts().values()) == total + 1

    monkeypatch.setattr(feedback, "MAX_ROWS", 10**6)
    monkeypatch.setattr(feedback, "MAX_BYTES", 1_000)  # 16 rows of ~100 bytes are in
    with pytest.raises(FeedbackError, match="the feedback store is full"):
        store.add(**{**ROW, "visitor": "trainer:ann"})


def _add_rows(path, worker, count, go):
    go.wait(60)
    store = FeedbackStore(path)
    for i in range(count):
        store.add(**{**ROW, "response": f"reply {worker}-{i}", "visitor": f"v{worker}"})


def _check_all_once(store, expected):
    rows = store.rows(limit=feedback.MAX_LIST)
    assert sorted(r.response for r in rows) == sorted(expected)
    assert len({r.id for r in rows}) == len(rows)


def test_32_threads_adding_at_once_store_every_row_exactly_once(store):
    go = threading.Event()
    threads = [threading.Thread(target=_add_rows, args=(store.path, w, 5, go)) for w in range(32)]
    for t in threads:
        t.start()
    go.set()
    for t in threads:
        t.join(120)
    _check_all_once(store, [f"reply {w}-{i}" for w in range(32) for i in range(5)])


def test_concurrent_clients_cannot_overshoot_a_bound(store, monkeypatch):
    monkeypatch.setattr(feedback, "MAX_PENDING_PER_VISITOR", 20)
    go, errors = threading.Event(), []

    def add_two():
        go.wait(60)
        for _ in range(2):
            try:
                store.add(**ROW)
            except FeedbackError as err:
                errors.append(str(err))

    threads = [threading.Thread(target=add_two) for _ in range(32)]
    for t in threads:
        t.start()
    go.set()
    for t in threads:
        t.join(120)
    assert store.counts()["pending"] == 20
    assert len(errors) == 44 and all("waiting for review" in e for e in errors)


def test_4_processes_adding_at_once_store_every_row_exactly_once(store):
    ctx = multiprocessing.get_context("spawn")
    go = ctx.Event()
    procs = [ctx.Process(target=_add_rows, args=(store.path, w, 25, go)) for w in range(4)]
    for p in procs:
        p.start()
    go.set()
    for p in procs:
        p.join(120)
    assert [p.exitcode for p in procs] == [0] * 4
    _check_all_once(store, [f"reply {w}-{i}" for w in range(4) for i in range(25)])


def test_a_writer_that_waits_too_long_gets_a_clear_message(store, monkeypatch):
    import sqlite3

    monkeypatch.setattr(feedback, "LOCK_TIMEOUT_S", 0.2)
    other = sqlite3.connect(store.path, isolation_level=None)
    other.execute("BEGIN IMMEDIATE")  # another client holds the write lock
    try:
        with pytest.raises(FeedbackError, match="the feedback store is busy; the row was not saved"):
            store.add(**ROW)
        assert store.counts()["pending"] == 0  # readers are not blocked (WAL)
    finally:
        other.execute("ROLLBACK")
        other.close()
    store.add(**ROW)


def test_status_changes_edit_and_delete(store):
    a, b, c = (store.add(**{**ROW, "rating": r, "original": ""}) for r in ("like", "dislike", "correction"))
    assert store.set_status([a, b, 999], "accepted") == 2
    assert store.counts() == {"pending": 1, "accepted": 2, "rejected": 0}
    with pytest.raises(FeedbackError, match="unknown status"):
        store.set_status([c], "gone")
    edited = store.edit(b, "a better <s> reply")
    assert (edited.response, edited.rating, edited.original, edited.status) == (
        "a better reply",
        "correction",
        "yes, two cats.",  # what the bot said is kept
        "accepted",
    )
    with pytest.raises(FeedbackError, match="no feedback row #999"):
        store.edit(999, "x")
    with pytest.raises(FeedbackError, match="the response is empty"):
        store.edit(a, "<s>")
    with pytest.raises(FeedbackError, match="no feedback row #999"):
        store.get(999)
    assert store.delete([c, 999]) == 1
    assert [r.id for r in store.rows()] == [b, a]


def test_export_loads_with_finetune_data_and_holds_out_every_tenth(store, tmp_path, monkeypatch):
    from finetune.data import _read_file, validate

    with pytest.raises(FeedbackError, match="no accepted rows"):
        store.export(tmp_path / "none")
    ids = [store.add(**{**ROW, "response": f"reply {i}", "rating": "like"}) for i in range(20)]
    skipped = [
        store.add(**{**ROW, "rating": "dislike"}),  # accepted, but no good reply
        store.add(**{**ROW, "kind": "none", "context": "", "rating": "like"}),  # still pending
    ]
    store.set_status([*ids, skipped[0]], "accepted")
    store.edit(ids[3], "a corrected reply")
    monkeypatch.setenv("PERSONA_CHAT_DATA", str(tmp_path / "data"))
    out = store.export()
    assert out.train.parent.parent == store.path.parent / "exports"
    assert (out.rows, out.heldout_rows) == (18, 2)
    lines = [json.loads(line) for line in out.train.read_text().splitlines()]
    held = [json.loads(line) for line in out.heldout.read_text().splitlines()]
    assert [r["id"] for r in held] == [ids[9], ids[19]]
    assert [r["id"] for r in lines] == [i for i in ids if i not in (ids[9], ids[19])]
    assert set(lines[3]) == {"kind", "context", "turns", "response", "id", "rating", "model"}
    assert (lines[3]["response"], lines[3]["rating"]) == ("a corrected reply", "correction")
    ds = validate(_read_file(str(out.train)), "x")
    assert ds["texts"][0] == encoder_text(store.get(ids[0]), "") and ds["labels"][0] == "reply 0"
    assert len(validate(_read_file(str(out.heldout)), "y")) == 2
    assert not [p for p in out.train.parent.iterdir() if p.name.startswith(".")]  # no temporary files left

    again = store.export(tmp_path / "again")
    assert (again.rows, again.heldout_rows) == (18, 2)
    store.set_status([ids[19]], "rejected")  # 19 rows: under 2 * holdout_every, nothing held out
    small = store.export(tmp_path / "again")  # into the same folder: the old held-out file goes
    assert (small.rows, small.heldout, small.heldout_rows) == (19, None, 0)
    assert not (tmp_path / "again" / "heldout.jsonl").exists()


def test_export_trains_through_a_train_config(store, tmp_path):
    from finetune.config import TrainConfig
    from finetune.data import load_raw

    ids = [store.add(**{**ROW, "response": f"reply {i}", "rating": "like"}) for i in range(4)]
    store.set_status(ids, "accepted")
    out = store.export(tmp_path / "exp", holdout_every=2)
    raw = load_raw(TrainConfig(train_file=str(out.train), validation_file=str(out.heldout)))
    assert (len(raw["train"]), len(raw["validation"])) == (2, 2)


DISK_FULL_CHILD = """
import json, resource, signal, sys
from finetune.feedback import FeedbackError, FeedbackStore
path, limit = sys.argv[1], int(sys.argv[2])
store = FeedbackStore(path)
signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # a write past the limit fails with EFBIG instead of killing us
resource.setrlimit(resource.RLIMIT_FSIZE, (limit, limit))
saved = 0
for i in range(1000):
    try:
        store.add(kind="none", context="", turns=[f"{i} " + "t" * 990] * 16, response="r" * 999, rating="like",
                  visitor="trainer:big")
    except FeedbackError as err:
        print(json.dumps({"saved": saved, "error": str(err)}))
        break
    saved += 1
"""


def test_escape_sequences_bidi_overrides_and_lone_surrogates_never_reach_a_stored_row(store, tmp_path):
    """What a visitor types is stored as the model will read it (issue 28): no terminal colours (nor
    their "[31m" remnants), no right-to-left override that shows a reviewer another text."""
    dirty = "\x1b[31mred\x1b[0m \u202egnp.exe\u202c \ud800 \u2066x\u2069"
    row_id = store.add(
        **{**ROW, "context": "i am " + dirty, "turns": ["hi " + dirty], "response": "ok " + dirty, "original": dirty},
        status="accepted",
    )
    store.vote(model_a="a " + dirty, model_b="b", winner="a", visitor="v", message=dirty)
    row = store.get(row_id)
    texts = [row.context, *row.turns, row.response, row.original]
    assert texts == ["i am red gnp.exe x", "hi red gnp.exe x", "ok red gnp.exe x", "red gnp.exe x"]
    exported = store.export(tmp_path / "out", holdout_every=0).train.read_text(encoding="utf-8")
    assert not any(c in exported for c in "\x1b\u202e\u202c\u2066\u2069") and "[31m" not in exported
    assert store.win_rates()[0]["model_a"] == "a red gnp.exe x"


def test_a_file_size_limit_refuses_the_row_names_the_file_and_keeps_the_store_readable(store):
    before = [store.add(**{**ROW, "response": f"kept {i}"}) for i in range(3)]
    sizes = [p.stat().st_size for p in store.path.parent.glob("feedback.sqlite3*")]
    limit = max(sizes) + 200_000  # room for a few ~17 KB rows, then every file is "full"
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    done = subprocess.run(
        [sys.executable, "-c", DISK_FULL_CHILD, str(store.path), str(limit)],
        capture_output=True,
        text=True,
        env=env,
        cwd=ROOT,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr
    result = json.loads(done.stdout.strip().splitlines()[-1])
    # the file and the cause (SQLite itself said "database or disk is full", for a file-size limit)
    assert result["error"].startswith("cannot write fb/feedback.sqlite3")  # the database or its -wal file
    assert "File too large (EFBIG): this process may write files of at most" in result["error"]
    assert result["error"].endswith("(its RLIMIT_FSIZE, ulimit -f); the row was not saved")
    assert 1 <= result["saved"] < 1000
    reopened = FeedbackStore(store.path)
    assert [reopened.get(i).response for i in before] == ["kept 0", "kept 1", "kept 2"]
    assert len(reopened.rows(limit=feedback.MAX_LIST)) == 3 + result["saved"]  # no half-written row
    import sqlite3

    con = sqlite3.connect(store.path)
    assert con.execute("PRAGMA integrity_check").fetchone()[0] == "ok"
    con.close()
    reopened.add(**ROW)  # and it takes rows again once there is room


def test_a_read_only_store_or_export_folder_names_the_folder_and_the_cause(store, tmp_path):
    row = store.add(**{**ROW, "rating": "like"}, status="accepted")
    with read_only(store.path.parent) as name:
        # named from the store's folder on (visitors read it, not the server's folders)
        with pytest.raises(FeedbackError, match=rf"^cannot write fb: .*\({name}\); the row was not saved"):
            store.add(**ROW)
        with pytest.raises(FeedbackError, match=rf"\({name}\); the review was not saved"):
            store.set_status([row], "rejected")
    assert store.get(row).status == "accepted"
    with read_only(tmp_path / "exports") as name:
        with pytest.raises(FeedbackError, match=rf"^cannot write out: .*\({name}\); the export was not written"):
            store.export(tmp_path / "exports" / "out")


def test_votes_and_win_rates_count_both_orders_of_a_pair(store, monkeypatch):
    store.vote(model_a="new", model_b="old", winner="a", visitor="v1")
    store.vote(model_a="old", model_b="new", winner="b", visitor="v1")  # "new" wins again, from the other side
    store.vote(model_a="old", model_b="new", winner="a", visitor="v2", message="hi <s>")
    store.vote(model_a="new", model_b="old", winner="tie", visitor="v2")
    store.vote(model_a="x", model_b="y", winner="b", visitor="v2")
    rates = store.win_rates()
    assert rates[0] == {"model_a": "new", "model_b": "old", "a_wins": 2, "b_wins": 1, "ties": 1, "total": 4,
                        "a_rate": 0.625}  # fmt: skip
    assert rates[1] == {"model_a": "x", "model_b": "y", "a_wins": 0, "b_wins": 1, "ties": 0, "total": 1, "a_rate": 0.0}
    with pytest.raises(FeedbackError, match="two different models"):
        store.vote(model_a="x", model_b="x", winner="a", visitor="v1")
    with pytest.raises(FeedbackError, match="unknown winner"):
        store.vote(model_a="x", model_b="y", winner="c", visitor="v1")
    monkeypatch.setattr(feedback, "MAX_VOTES_PER_VISITOR", 2)
    with pytest.raises(FeedbackError, match="you have voted 2 times"):
        store.vote(model_a="x", model_b="y", winner="a", visitor="v1")
    store.vote(model_a="x", model_b="y", winner="a", visitor="trainer:ann")
    monkeypatch.setattr(feedback, "MAX_VOTES", 6)
    with pytest.raises(FeedbackError, match="the vote store is full"):
        store.vote(model_a="x", model_b="y", winner="a", visitor="trainer:ann")


def _age_votes(store, seconds: float) -> None:
    """Every vote so far cast ``seconds`` earlier (what waiting does, without the wait)."""
    import sqlite3

    con = sqlite3.connect(store.path)
    with con:
        con.execute("UPDATE votes SET created = created - ?", (seconds,))
    con.close()


def test_a_visitor_votes_at_an_honest_pace_but_cannot_flood_a_pair_or_the_hour(store):
    """Issue 28: 1,000 votes per address in one go decided a small leaderboard. Votes are also
    bounded per hour and per pair of models per day; the refusal says which and when to come back."""
    limit, _ = feedback.VOTES_PER_HOUR
    per_pair, _ = feedback.VOTES_PER_PAIR_PER_DAY
    # an honest visitor: a few votes on each of two pairs, an hour apart, all counted
    for _hour in range(3):
        for i in range(4):
            store.vote(model_a="new", model_b="old", winner="ab"[i % 2], visitor="honest")
            store.vote(model_a="x", model_b="new", winner="tie", visitor="honest")
        _age_votes(store, 3601)
    assert sum(r["total"] for r in store.win_rates()) == 24
    # a flood on one pair: 20 a day counted (either order of the pair), then refused with the reason
    for i in range(per_pair):
        store.vote(model_a="new", model_b="old", winner="b", visitor="flood", message=f"m{i}")
        if i % 10 == 9:
            _age_votes(store, 3601)  # (under the hourly bound: this is the pair's)
    with pytest.raises(
        FeedbackError, match=r"voted 20 times on these two models in the last day.*not counted.*in \d+ h"
    ):
        store.vote(model_a="old", model_b="new", winner="a", visitor="flood")
    store.vote(model_a="new", model_b="x", winner="a", visitor="flood")  # another pair still counts
    store.vote(model_a="new", model_b="old", winner="a", visitor="honest")  # and another visitor
    _age_votes(store, 24 * 3600)
    store.vote(model_a="new", model_b="old", winner="b", visitor="flood")  # a day later: counted again
    # a flood over many pairs: 30 an hour, then refused until the oldest of them is an hour old
    pairs = [(f"m{i}", f"n{i}") for i in range(limit)]
    for a, b in pairs:
        store.vote(model_a=a, model_b=b, winner="a", visitor="spread")
    with pytest.raises(FeedbackError, match=r"voted 30 times in the last hour.*try again in (59|60) min"):
        store.vote(model_a="p", model_b="q", winner="a", visitor="spread")
    _age_votes(store, 3601)
    store.vote(model_a="p", model_b="q", winner="a", visitor="spread")
    for _ in range(per_pair + 1):  # trainers are not bounded
        store.vote(model_a="new", model_b="old", winner="a", visitor="trainer:ann")


def test_visitor_key_is_a_salted_hash_with_a_private_salt(store, tmp_path, monkeypatch):
    key = store.visitor_key("203.0.113.7")
    salt = store.path.parent / feedback.SALT_FILE
    assert stat.S_IMODE(salt.stat().st_mode) == 0o600 and len(salt.read_bytes()) == 32
    assert len(key) == 16 and int(key, 16) >= 0 and "203" not in key
    assert key == store.visitor_key("203.0.113.7") != store.visitor_key("203.0.113.8")
    other = FeedbackStore(tmp_path / "other" / "feedback.sqlite3")  # another salt: another key
    assert other.visitor_key("203.0.113.7") != key
    monkeypatch.setattr(feedback, "feedback_path", lambda: store.path)
    assert feedback.visitor_key("203.0.113.7") == key
    assert not [p for p in salt.parent.iterdir() if p.name.endswith(".tmp")]


def test_the_default_store_lives_under_the_data_root(tmp_path, monkeypatch):
    monkeypatch.setenv("PERSONA_CHAT_DATA", str(tmp_path / "data"))
    store = FeedbackStore()
    assert store.path == (tmp_path / "data" / "feedback" / "feedback.sqlite3").resolve()
    assert store.path.is_file()
    assert len(feedback.visitor_key("198.51.100.1")) == 16
    assert (store.path.parent / feedback.SALT_FILE).is_file()
