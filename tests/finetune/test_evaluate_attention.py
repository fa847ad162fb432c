"""finetune.evaluate.decoding_attention: generation runs on --eval_attention, and the model is back
on its training attention afterwards, errors included."""

import pytest

from chat.fastgen import GROUPED
from chat.model import load_model
from finetune.config import TrainConfig
from finetune.evaluate import decoding_attention


@pytest.mark.parametrize(
    ("choice", "beams", "during"), [("grouped", 10, GROUPED), ("grouped", 1, "eager"), ("eager", 10, "eager")]
)
def test_decoding_attention_switches_and_restores(tiny_path, choice, beams, during):
    model = load_model(tiny_path)
    model.set_attn_implementation("sdpa")
    cfg = TrainConfig(train_file="t.jsonl", validation_file="v.jsonl", eval_attention=choice, num_beams=beams)
    with pytest.raises(RuntimeError, match="boom"), decoding_attention(model, cfg):
        assert model.config._attn_implementation == during
        raise RuntimeError("boom")
    assert model.config._attn_implementation == "sdpa"


def test_unknown_eval_attention_is_refused():
    with pytest.raises(ValueError, match="--eval_attention must be one of eager, grouped, sdpa"):
        TrainConfig(train_file="t.jsonl", validation_file="v.jsonl", eval_attention="flash")
