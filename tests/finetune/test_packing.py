"""Packed training batches (finetune/packing.py): the same loss and gradients as padded batches."""

import json
import random

import pytest
import torch
from transformers import BlenderbotConfig, DataCollatorForSeq2Seq

from chat.layout import SAMPLE_DIR
from chat.model import load_model, load_tokenizer
from finetune.config import TrainConfig
from finetune.packing import PackingCollator, install, pack_rows, packed, samples_in, token_costs


def test_pack_rows_places_every_dialogue_once_within_the_capacities():
    rng = random.Random(0)
    sources = [rng.randint(1, 128) for _ in range(500)]
    targets = [rng.randint(1, 40) for _ in range(500)]
    rows = pack_rows(sources, targets, 128, 48)
    assert sorted(i for row in rows for i in row) == list(range(500))
    assert all(sum(sources[i] for i in row) <= 128 and sum(targets[i] for i in row) <= 48 for row in rows)
    # Best fit on mostly short sources: far fewer rows than dialogues (the point of packing).
    assert len(rows) < 0.7 * len(sources)
    with pytest.raises(ValueError, match="exceeds rows of 128/48"):
        pack_rows([129], [1], 128, 48)


def test_collator_lays_out_each_dialogue_with_its_own_start_token_and_labels():
    features = [
        {"input_ids": [5, 6, 2], "labels": [7, 8, 2]},
        {"input_ids": [9, 2], "labels": [10, 2, -100]},  # the tokenizer's label padding is dropped
    ]
    collator = PackingCollator(pad_token_id=0, decoder_start_token_id=1, max_source=8, max_target=8, multiple=8)
    batch = collator(features)
    assert batch["samples"] == 2 and samples_in(batch) == 2
    assert batch["input_ids"].shape == (1, 8) and batch["labels"].shape == (1, 8)  # 5 tokens each, rounded up
    assert batch["input_ids"][0].tolist() == [5, 6, 2, 9, 2, 0, 0, 0]
    assert batch["attention_mask"][0].tolist() == [1, 1, 1, 1, 1, 0, 0, 0]
    assert batch["source_segments"][0].tolist() == [1, 1, 1, 2, 2, 0, 0, 0]
    assert batch["decoder_input_ids"][0].tolist() == [1, 7, 8, 1, 10, 0, 0, 0]
    assert batch["labels"][0].tolist() == [7, 8, 2, 10, 2, -100, -100, -100]
    assert batch["target_segments"][0].tolist() == [1, 1, 1, 2, 2, 0, 0, 0]
    plain = PackingCollator(pad_token_id=0, decoder_start_token_id=1, max_source=8, max_target=8)(features)
    assert plain["input_ids"].shape == (1, 5) and torch.equal(plain["labels"], batch["labels"][:, :5])


def test_collator_picks_the_target_width_that_costs_least():
    # One long reply and eight short ones (sources of 10). Target rows of 56 fit everything in 2
    # rows (56 decoder tokens wide); rows of 32 need 3 rows but only 32 decoder tokens each.
    features = [{"input_ids": [3] * 10, "labels": [4] * 32}] + [{"input_ids": [3] * 10, "labels": [4] * 8}] * 8
    cheap_targets = PackingCollator(0, 1, 128, 64, costs=(10.0, 1.0))(features)  # 2x(500+56) < 3x(400+32)
    dear_targets = PackingCollator(0, 1, 128, 64, costs=(1.0, 10.0))(features)  # 3x(40+320) < 2x(50+560)
    assert cheap_targets["labels"].shape == (2, 56)
    assert dear_targets["labels"].shape == (3, 32)
    for batch in (cheap_targets, dear_targets):
        assert (batch["labels"] == 4).sum() == 32 + 8 * 8 and batch["samples"] == 9


def test_token_costs_of_the_400m_architecture():
    config = BlenderbotConfig(  # blenderbot-400M-distill's shape
        d_model=1280, encoder_layers=2, decoder_layers=12, encoder_ffn_dim=5120, decoder_ffn_dim=5120, vocab_size=8008
    )
    source, target = token_costs(config)
    assert source == pytest.approx(78.6e6, rel=0.01) and target == pytest.approx(285.4e6, rel=0.01)


def _features(tokenizer, n=40):
    rows = [json.loads(line) for line in (SAMPLE_DIR / "train.jsonl").read_text().splitlines()[:n]]
    out = []
    for row in rows:
        source = tokenizer("chatbot: " + row["texts"], max_length=128, truncation=True)
        target = tokenizer(text_target=row["labels"], max_length=64, truncation=True)
        out.append({"input_ids": source.input_ids, "attention_mask": source.attention_mask, "labels": target.input_ids})
    return out


def _no_dropout(model):
    for module in model.modules():
        for name in ("dropout", "activation_dropout", "attention_dropout"):
            if isinstance(getattr(module, name, None), float):
                setattr(module, name, 0.0)
    return model.train()


@pytest.mark.parametrize("attention", ["sdpa", "eager"])
def test_a_packed_batch_gives_the_padded_batch_s_loss_and_gradients(attention):
    tokenizer = load_tokenizer("tiny")
    model = _no_dropout(load_model("tiny", attn_implementation=attention))
    features = _features(tokenizer)
    padded = DataCollatorForSeq2Seq(tokenizer, label_pad_token_id=-100)(features)
    loss = model(**padded).loss
    loss.backward()
    expected = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}

    install(model)
    batch = PackingCollator(tokenizer.pad_token_id, model.config.decoder_start_token_id, 128, 64, multiple=8)(features)
    assert batch["input_ids"].shape[0] < len(features) // 2  # it did pack (and left padding in rows)
    assert (batch["source_segments"] == 0).any() and (batch["target_segments"] == 0).any()
    model.zero_grad()
    with packed(batch) as inputs:
        packed_loss = model(**inputs).loss
        packed_loss.backward()
    assert packed_loss.item() == pytest.approx(loss.item(), rel=1e-5)
    for name, grad in expected.items():
        got = dict(model.named_parameters())[name].grad
        assert torch.isfinite(got).all(), name
        # k_proj biases have (analytically) zero gradient: compare against a floor, not their noise.
        assert (got - grad).abs().max() <= 1e-5 * max(grad.abs().max().item(), 1.0), name

    # Outside a packed block the hooks change nothing: evaluation and chat see plain batches.
    model.zero_grad()
    assert model(**padded).loss.item() == pytest.approx(loss.item(), rel=1e-6)


def test_without_the_hooks_a_packed_batch_would_see_across_dialogues():
    # The masks matter: the same packed rows through a model without the hooks give another loss.
    tokenizer = load_tokenizer("tiny")
    model = _no_dropout(load_model("tiny"))
    features = _features(tokenizer, 20)
    padded_loss = model(**DataCollatorForSeq2Seq(tokenizer, label_pad_token_id=-100)(features)).loss.item()
    batch = PackingCollator(tokenizer.pad_token_id, model.config.decoder_start_token_id, 128, 64)(features)
    with packed(batch) as inputs:
        unhooked = model(**inputs).loss.item()
    assert abs(unhooked - padded_loss) > 1e-3


def test_packing_refuses_an_attention_without_masks():
    tokenizer = load_tokenizer("tiny")
    model = load_model("tiny")
    install(model)
    model.config._attn_implementation = "flash_attention_2"  # as if loaded with it (not installed here)
    batch = PackingCollator(tokenizer.pad_token_id, 1, 128, 64)(_features(tokenizer, 4))
    with pytest.raises(ValueError, match="packed batches need attention sdpa or eager"), packed(batch) as inputs:
        model(**inputs)


def test_config_packing_default_and_conflicts():
    assert TrainConfig().packs
    assert not TrainConfig(pad_to_max_length=True).packs  # the seed's padding
    assert not TrainConfig(attention="sdpa-flash").packs
    assert not TrainConfig(packing=False).packs
    with pytest.raises(ValueError, match="--packing and --pad_to_max_length"):
        TrainConfig(packing=True, pad_to_max_length=True)
    with pytest.raises(ValueError, match="sdpa-flash"):
        TrainConfig(packing=True, attention="sdpa-flash")
