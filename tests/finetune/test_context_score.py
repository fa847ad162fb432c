"""The context score (finetune/context_score.py): candidates, chance for context-blind replies,
clearly above chance for the demo model on the shipped sample."""

import json
from types import SimpleNamespace

import pytest

from chat.layout import DEMO_DIR, SAMPLE_DIR
from chat.model import load_model, load_tokenizer
from chat.prompt import build_source, kind_of, split_source
from finetune.context_score import candidates, context_score
from finetune.data import fitted_sources

CFG = SimpleNamespace(source_prefix="chatbot: ", max_source_length=128, val_max_target_length=64)


def test_candidates_swap_in_other_contexts_of_the_same_kind_and_keep_the_turns():
    personas = [build_source("persona", f"i am person {i}.", ["hi", "hello", "what do you do?"]) for i in range(6)]
    sources = [*personas, build_source("none", "", ["just chatting"]), build_source("topic", "jazz", ["hm"])]
    found = candidates(sources, k=4, seed=0)
    assert found[6] is None  # no context to swap
    assert found[7] is None  # the only topic: no other context of its kind
    for source, group in zip(personas, found):
        assert group[0] == source and len(group) == 5
        contexts = [split_source(s)[0] for s in group]
        assert len(set(contexts)) == 5  # k other, distinct contexts
        assert all(split_source(s)[1] == split_source(source)[1] and kind_of(s) == "persona" for s in group)
    assert candidates(sources, k=4, seed=0) == found  # seeded: every run and model sees the same
    assert candidates(sources, k=4, seed=1) != found
    assert all(g is None for g in candidates(sources, k=6))  # fewer than k other contexts


@pytest.fixture(scope="module")
def demo_and_sample():
    rows = [json.loads(line) for line in open(SAMPLE_DIR / "validation.jsonl")]
    model, tokenizer = load_model(str(DEMO_DIR)).eval(), load_tokenizer(str(DEMO_DIR))
    sources = [r["texts"] for r in rows]
    greedy = []
    for start in range(0, len(sources), 64):
        enc = tokenizer(
            fitted_sources(sources[start : start + 64], tokenizer, "chatbot: ", 128), return_tensors="pt", padding=True
        )
        out = model.generate(**enc, max_new_tokens=40, num_beams=1, do_sample=False)
        greedy += tokenizer.batch_decode(out, skip_special_tokens=True)
    return model, tokenizer, sources, greedy, [r["labels"] for r in rows]


def test_the_demo_model_is_clearly_above_chance_and_a_context_blind_reply_is_not(demo_and_sample):
    model, tokenizer, sources, greedy, references = demo_and_sample
    own = context_score(model, tokenizer, sources, greedy, references, CFG)
    assert own["eval_context_chance"] == pytest.approx(0.2)
    assert own["eval_context_rows"] == 151  # every row with a context (the sample's 36 "none" rows have none)
    assert own["eval_context_hits_persona"] > 0.5 and own["eval_context_hits"] > 0.6  # measured 0.74 and 0.83
    assert 0 < own["eval_context_hits_gold"] <= 1 and own["eval_context_rows_gold"] == 151
    # The same reply for every row ignores the context: about 1 in 5 (measured 0.14-0.18 over seeds)
    blind = context_score(
        model, tokenizer, sources, ["that sounds great, tell me more."] * len(sources), references, CFG
    )
    assert blind["eval_context_hits"] < 0.3
    assert blind["eval_context_hits_gold"] == own["eval_context_hits_gold"]  # the ceiling depends on the data only
