"""The preference losses (finetune/preference.py) against values computed by hand."""

import math
from types import SimpleNamespace

import pytest
import torch

from chat.model import load_model
from finetune.preference import dpo_loss, kl_estimate, kto_loss, mismatched_order, sequence_logps


def sigmoid(x: float) -> float:
    return 1 / (1 + math.exp(-x))


def test_sequence_logps_sums_target_tokens_and_skips_padding():
    logits = torch.zeros(2, 2, 3)
    logits[1, 0] = torch.tensor([0.0, math.log(2), 0.0])
    labels = torch.tensor([[0, -100], [1, 2]])
    # row 0: one token at uniform odds; row 1: p = 2/4, then 1/3
    expected = [math.log(1 / 3), math.log(2 / 4) + math.log(1 / 3)]
    assert sequence_logps(logits, labels).tolist() == pytest.approx(expected, abs=1e-6)


def test_sequence_logps_matches_the_models_own_loss(tiny_path, tiny_tokenizer):
    model = load_model(str(tiny_path)).eval()
    enc = tiny_tokenizer(["chatbot: hello there", "chatbot: how are you?"], return_tensors="pt", padding=True)
    labels = tiny_tokenizer(text_target=["hi!", "fine, thanks, and you?"], return_tensors="pt", padding=True).input_ids
    labels[labels == tiny_tokenizer.pad_token_id] = -100
    with torch.no_grad():
        out = model(**enc, labels=labels)
    # transformers' loss is the mean token cross-entropy over every non-padding label token
    assert -sequence_logps(out.logits, labels).sum().item() / (labels != -100).sum().item() == pytest.approx(
        out.loss.item(), rel=1e-5
    )


def test_dpo_loss_by_hand():
    # policy moved +1 on the chosen reply and -1 on the rejected one, against the reference
    chosen, rejected = torch.tensor([-3.0], requires_grad=True), torch.tensor([-5.0], requires_grad=True)
    out = dpo_loss(chosen, rejected, torch.tensor([-4.0]), torch.tensor([-4.0]), beta=0.1)
    assert out.loss.item() == pytest.approx(math.log(1 + math.exp(-0.2)), abs=1e-6)  # -log sigmoid(0.1 * 2)
    assert out.correct.tolist() == [1.0] and out.margin.tolist() == [2.0]
    out.loss.backward()
    # d/d chosen of -log sigmoid(beta * (c - r ...)) = -beta * (1 - sigmoid(0.2)); rejected: the opposite
    assert chosen.grad.item() == pytest.approx(-0.1 * (1 - sigmoid(0.2)), abs=1e-6)
    assert rejected.grad.item() == pytest.approx(0.1 * (1 - sigmoid(0.2)), abs=1e-6)


def test_dpo_at_the_start_is_log_2_and_counts_a_tie_as_wrong():
    same = torch.tensor([-2.0, -7.0])
    out = dpo_loss(same, same, same, same, beta=0.5)
    assert out.loss.item() == pytest.approx(math.log(2), abs=1e-6)
    assert out.correct.tolist() == [0.0, 0.0]


def test_kto_loss_by_hand():
    logps, ref = torch.tensor([-2.0, -6.0]), torch.tensor([-3.0, -5.0])
    out = kto_loss(logps, ref, torch.tensor([True, False]), z=torch.tensor(0.5), beta=0.1)
    good = 1 - sigmoid(0.1 * (1 - 0.5))  # desirable, log-ratio +1
    bad = 1 - sigmoid(0.1 * (0.5 - (-1)))  # undesirable, log-ratio -1
    assert out.loss.item() == pytest.approx((good + bad) / 2, abs=1e-6)
    assert out.correct.tolist() == [1.0, 1.0]  # both moved the way their labels ask
    assert out.margin.tolist() == [1.0, 1.0]
    weighted = kto_loss(logps, ref, torch.tensor([True, False]), z=torch.tensor(0.5), beta=0.1, undesirable_weight=2)
    assert weighted.loss.item() == pytest.approx((good + 2 * bad) / 2, abs=1e-6)


def test_kl_estimate_is_clamped_and_detached():
    pol = torch.tensor([-1.0, -2.0], requires_grad=True)
    assert kl_estimate(pol, torch.tensor([-2.0, -2.0])).item() == pytest.approx(0.5)
    assert not kl_estimate(pol, torch.tensor([-2.0, -2.0])).requires_grad
    assert kl_estimate(pol, torch.tensor([0.0, 0.0])).item() == 0.0  # negative: clamped
    assert kl_estimate(torch.tensor([]), torch.tensor([])).item() == 0.0


def test_mismatched_order_never_pairs_a_row_with_its_own_reply():
    assert mismatched_order(1) == []
    for rows in (2, 3, 8):
        order = mismatched_order(rows)
        assert sorted(order) == list(range(rows)) and all(i != j for i, j in enumerate(order))


def _batches(objective, tiny_tokenizer, rows):
    from datasets import Dataset
    from torch.utils.data import DataLoader

    from finetune.preference import PreferenceCollator
    from finetune.preference_data import tokenize, validate

    cfg = SimpleNamespace(source_prefix="chatbot: ", max_source_length=64, max_target_length=16)
    data = tokenize(validate(Dataset.from_list(rows), "rows", objective), tiny_tokenizer, cfg, objective)
    return data, lambda d: DataLoader(d, batch_size=4, collate_fn=PreferenceCollator(tiny_tokenizer.pad_token_id))


PAIRS = [
    {"texts": f"hello number {i}", "chosen": "i like dogs very much", "rejected": "no idea what you mean"}
    for i in range(8)
]


@pytest.mark.parametrize("objective", ["dpo", "kto"])
def test_preference_loss_starts_at_its_neutral_value_and_learns(objective, tiny_tokenizer):
    from finetune.preference import preference_loss, reference_logps

    torch.manual_seed(0)
    model = load_model("chat/demo_model")
    rows = PAIRS
    if objective == "kto":  # the same signal as single rated replies
        rows = [
            {"texts": r["texts"], "response": r[k], "label": k == "chosen"}
            for r in PAIRS
            for k in ("chosen", "rejected")
        ]
    data, loader = _batches(objective, tiny_tokenizer, rows)
    first, second = reference_logps(model, loader(data), objective, "cpu")
    names = ("ref_chosen", "ref_rejected") if objective == "dpo" else ("ref_logps", "ref_kl")
    data = data.add_column(names[0], first).add_column(names[1], second)
    model.eval()  # no dropout: the policy equals the reference exactly at the start
    batch = next(iter(loader(data)))
    start = preference_loss(model, batch, objective, beta=0.1)
    neutral = math.log(2) if objective == "dpo" else 0.5  # -log sigmoid(0); 1 - sigmoid(0 - 0)
    assert start.loss.item() == pytest.approx(neutral, abs=1e-5)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model.train()
    for _ in range(6):
        for batch in loader(data):
            out = preference_loss(model, batch, objective, beta=0.1, sft_weight=0.1)
            opt.zero_grad()
            out.loss.backward()
            opt.step()
    model.eval()
    with torch.no_grad():
        after = [preference_loss(model, b, objective, beta=0.1) for b in loader(data)]
    assert sum(o.loss.item() for o in after) / len(after) < neutral - 0.01
    assert torch.cat([o.correct for o in after]).mean().item() == 1.0  # every row now ranked right


def test_the_sft_term_is_the_good_replies_token_loss(tiny_tokenizer):
    from finetune.preference import preference_loss

    model = load_model("chat/demo_model").eval()
    rows = [
        {"texts": "hi", "response": "hello there friend", "label": True},
        {"texts": "yo", "response": "no", "label": False},
    ]
    data, loader = _batches("kto", tiny_tokenizer, rows)
    data = data.add_column("ref_logps", [0.0, 0.0]).add_column("ref_kl", [0.0, 0.0])
    batch = next(iter(loader(data)))
    with torch.no_grad():
        plain = preference_loss(model, batch, "kto", beta=0.1).loss
        with_sft = preference_loss(model, batch, "kto", beta=0.1, sft_weight=2.0).loss
        good = model(
            input_ids=batch["input_ids"][:1], attention_mask=batch["attention_mask"][:1], labels=batch["labels"][:1]
        )
    assert (with_sft - plain).item() == pytest.approx(2.0 * good.loss.item(), rel=1e-5)  # the desirable row only
