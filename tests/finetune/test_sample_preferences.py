"""The shipped sample preference set is what finetune.sample_preferences builds from the sample and
the demo model (checked on the first validation rows: rebuilding all of it takes a minute and a half)."""

from chat.layout import DEMO_DIR, SAMPLE_DIR
from chat.model import load_model, load_tokenizer
from finetune.preference_data import load_preferences
from finetune.sample_preferences import build_pairs, greedy_replies, kto_rows, read_rows


def test_the_shipped_pairs_are_the_demo_models_own_greedy_replies_where_they_differ():
    rows = read_rows(SAMPLE_DIR / "validation.jsonl")[:24]
    replies = greedy_replies(
        load_model(str(DEMO_DIR)).eval(), load_tokenizer(str(DEMO_DIR)), [r["texts"] for r in rows]
    )
    pairs = build_pairs(rows, replies)
    shipped = read_rows(SAMPLE_DIR / "preferences-validation.jsonl")
    assert 0 < len(pairs) < len(rows) and pairs == shipped[: len(pairs)]
    assert all(p["chosen"] != p["rejected"] for p in shipped)
    assert len(shipped) == 118 and len(read_rows(SAMPLE_DIR / "preferences-train.jsonl")) == 558
    # both files are valid DPO files, and their pairs make valid KTO rows
    train, held = load_preferences(str(SAMPLE_DIR / "preferences-train.jsonl"), "dpo")
    assert len(train) + len(held) == 558
    rated = kto_rows(shipped[:2])
    assert [r["label"] for r in rated] == [True, False, True, False]
    assert rated[1]["response"] == shipped[0]["rejected"]
