"""Compare votes that keep their replies, the store's migration, and the preference rows the
accepted feedback becomes (finetune/feedback_votes.py, finetune/feedback_preferences.py): real
SQLite files, the exports read back by finetune.preference_data exactly as training reads them."""

import json
import sqlite3

import pytest

from finetune.data import DataError
from finetune.feedback import FeedbackError, FeedbackStore
from finetune.feedback_preferences import export_preferences, preference_counts, preference_rows
from finetune.preference_data import load_preferences

CONVERSATION = {"kind": "persona", "context": "i love cats.", "turns": ["hi there", "hello!", "do you have pets?"]}


def pair(a="two cats, both grey.", b="no."):
    return {**CONVERSATION, "reply_a": a, "reply_b": b}


@pytest.fixture
def store(tmp_path):
    return FeedbackStore(tmp_path / "fb" / "feedback.sqlite3")


def add(store, rating, response, original="", status="accepted", **changes):
    row = {**CONVERSATION, "response": response, "original": original, "rating": rating, "model": "tiny"}
    return store.add(**{**row, **changes}, visitor="v1", status=status)


def test_a_vote_keeps_the_conversation_and_both_replies_in_the_stored_order(store):
    # the pair is stored sorted (m1 < m2): a vote for "a" = m2 becomes a vote for "b", replies flipped too
    vid = store.vote(model_a="m2", model_b="m1", winner="a", visitor="v", message="hi", pair=pair("yes!", "no."))
    vote = store.get_vote(vid)
    assert (vote.model_a, vote.model_b, vote.winner) == ("m1", "m2", "b")
    assert (vote.reply_a, vote.reply_b, vote.chosen, vote.rejected) == ("no.", "yes!", "yes!", "no.")
    assert (vote.kind, vote.context, vote.turns, vote.status) == (
        "persona",
        "i love cats.",
        CONVERSATION["turns"],
        "pending",
    )
    assert store.vote_counts() == {"pending": 1, "accepted": 0, "rejected": 0}
    # ties are kept as ties (win rates) but are no pair to review; votes without replies neither
    store.vote(model_a="m1", model_b="m2", winner="tie", visitor="v", pair=pair())
    store.vote(model_a="m1", model_b="m2", winner="a", visitor="v")
    assert [v.id for v in store.votes()] == [vid]
    assert store.win_rates()[0]["total"] == 3
    assert store.set_vote_status([vid, 999], "accepted") == 1
    assert store.votes("accepted")[0].id == vid and store.votes("pending") == []


@pytest.mark.parametrize(
    "bad, message",
    [
        ({**pair(), "kind": "weird"}, "unknown kind"),
        ({**pair(), "turns": []}, "turns must be a non-empty list"),
        ({**pair(), "reply_b": "  "}, "reply b is empty"),
        ("not a dict", "must be a dict"),
    ],
)
def test_a_bad_vote_pair_is_refused_and_nothing_is_stored(store, bad, message):
    with pytest.raises(FeedbackError, match=message):
        store.vote(model_a="m1", model_b="m2", winner="a", visitor="v", pair=bad)
    assert store.win_rates() == []


def test_a_store_of_the_first_schema_is_migrated_in_place_keeping_every_row(tmp_path):
    path = tmp_path / "feedback" / "feedback.sqlite3"
    path.parent.mkdir()
    con = sqlite3.connect(path)
    con.executescript(  # the schema before votes kept their replies (main before issue 27)
        """
        CREATE TABLE feedback (
            id INTEGER PRIMARY KEY AUTOINCREMENT, kind TEXT NOT NULL, context TEXT NOT NULL, turns TEXT NOT NULL,
            response TEXT NOT NULL, original TEXT NOT NULL, rating TEXT NOT NULL, model TEXT NOT NULL,
            created REAL NOT NULL, status TEXT NOT NULL, visitor TEXT NOT NULL, size INTEGER NOT NULL);
        CREATE TABLE votes (
            id INTEGER PRIMARY KEY AUTOINCREMENT, model_a TEXT NOT NULL, model_b TEXT NOT NULL, winner TEXT NOT NULL,
            visitor TEXT NOT NULL, message TEXT NOT NULL, created REAL NOT NULL, size INTEGER NOT NULL);
        INSERT INTO feedback VALUES (1, 'none', '', '["hi"]', 'hello!', 'hm', 'correction', 'tiny', 1.0,
            'accepted', 'v', 10);
        INSERT INTO votes VALUES (1, 'm1', 'm2', 'a', 'v', 'hi', 1.0, 8);
        INSERT INTO votes VALUES (2, 'm1', 'm2', 'tie', 'w', 'hi', 2.0, 8);
        """
    )
    con.commit()
    con.close()
    store = FeedbackStore(path)
    assert store.get(1).response == "hello!"
    assert store.win_rates()[0] | {"a_rate": 0} == {
        "model_a": "m1", "model_b": "m2", "a_wins": 1, "b_wins": 0, "ties": 1, "total": 2, "a_rate": 0,
    }  # fmt: skip
    assert store.votes() == []  # old votes have no replies: nothing to review, nothing to train on
    new = store.vote(model_a="m1", model_b="m2", winner="a", visitor="x", pair=pair())
    assert store.get_vote(new).reply_a == "two cats, both grey."
    FeedbackStore(path)  # opening it again changes nothing
    assert len(store.win_rates()) == 1 and store.win_rates()[0]["total"] == 3


def test_accepted_feedback_becomes_dpo_pairs_and_kto_rows_training_reads(store, tmp_path):
    add(store, "correction", "two cats, both grey.", original="no.")  # -> pair
    add(store, "correction", "hello!", original="", kind="none", context="")  # no original reply: no pair
    add(store, "correction", "pending one.", original="x", status="pending")  # not reviewed: nothing
    add(store, "like", "i have a cat named tom.")  # -> KTO true
    add(store, "dislike", "whatever.", original="whatever.")  # -> KTO false
    add(store, "like", "rejected like.", status="rejected")
    won = store.vote(model_a="m1", model_b="m2", winner="b", visitor="v", pair=pair("no pets.", "a dog, rex."))
    store.vote(model_a="m1", model_b="m2", winner="a", visitor="v", pair=pair("later.", "not accepted."))
    store.set_vote_status([won], "accepted")

    counts = preference_counts(store)
    assert (counts.corrections, counts.votes, counts.likes, counts.dislikes) == (1, 1, 1, 1)
    assert (counts.pairs, counts.kto, counts.of("dpo"), counts.of("kto"), counts.of("sft")) == (2, 2, 2, 2, 0)
    dpo = preference_rows(store, "dpo")
    assert [(r["chosen"], r["rejected"], r["source"].split()[0]) for r in dpo] == [
        ("two cats, both grey.", "no.", "correction"),
        ("a dog, rex.", "no pets.", "vote"),  # the winner's reply is the chosen one
    ]
    assert all({k: r[k] for k in CONVERSATION} == CONVERSATION for r in dpo)
    kto = preference_rows(store, "kto")
    assert [(r["response"], r["label"]) for r in kto] == [("i have a cat named tom.", True), ("whatever.", False)]

    # the files are exactly what --preference_file reads (validated as training validates it)
    path, n = export_preferences(store, "dpo", tmp_path / "out")
    assert (path.name, n) == ("dpo.jsonl", 2)
    lines = [json.loads(line) for line in path.read_text().splitlines()]
    assert set(lines[0]) == {"kind", "context", "turns", "chosen", "rejected", "source"}
    train, held = load_preferences(str(path), "dpo")
    assert train["chosen"] == ["two cats, both grey.", "a dog, rex."] and len(held) == 0
    assert train["texts"][0].endswith("do you have pets?")
    path, n = export_preferences(store, "kto", tmp_path / "out")
    train, _ = load_preferences(str(path), "kto")
    assert train["label"] == [True, False]
    with pytest.raises(DataError, match="use --objective kto"):  # a KTO file given to DPO is refused
        load_preferences(str(path), "dpo")


def test_no_rows_is_a_clear_refusal_and_writes_nothing(store, tmp_path):
    add(store, "like", "a pending like.", status="pending")
    for objective, hint in (("dpo", "accept corrections or Compare votes"), ("kto", "accept liked or disliked")):
        with pytest.raises(FeedbackError, match=hint):
            export_preferences(store, objective, tmp_path / "out")
    assert not (tmp_path / "out").exists()
    with pytest.raises(FeedbackError, match="dpo or kto"):
        preference_rows(store, "sft")
