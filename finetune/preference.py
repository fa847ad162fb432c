"""Preference objectives for a seq2seq model: DPO on pairs, KTO on single rated replies.

TRL, the library that serves these objectives for decoder-only models, dropped encoder-decoder
support from its DPO and KTO trainers, and no other maintained library covers BlenderBot, so the
losses are written here, on the quantities both papers define:

- a reply's log-probability is the SUM of its target tokens' log-probabilities given the source
  (``sequence_logps``), under the model being trained (the policy) and under a frozen reference
  (the model the run started from);
- its implicit reward is ``beta * (policy - reference)``.

DPO (Rafailov et al. 2023), sigmoid form: ``-log sigmoid(r_chosen - r_rejected)`` per pair.
KTO (Ethayarajh et al. 2024): ``w_d * (1 - sigmoid(r - z))`` for a desirable reply and
``w_u * (1 - sigmoid(z - r))`` for an undesirable one, where ``z`` is the policy's KL from the
reference, estimated on the batch's mismatched (source, reply) pairs, clamped at 0 and not
differentiated (as the paper and TRL do).

Every function takes plain tensors, so ``tests/finetune/test_preference.py`` checks them against
values computed by hand.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

OBJECTIVES = ("sft", "dpo", "kto")
IGNORE = -100  # label padding (finetune.data tokenizes labels so)


def sequence_logps(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Sum of each row's target-token log-probabilities (padding, ``IGNORE``, left out).

    ``logits``: (rows, target length, vocab) from a seq2seq forward with these ``labels``;
    returns (rows,) in fp32 (bf16 sums over 64 tokens would lose the differences DPO learns from)."""
    mask = labels != IGNORE
    safe = labels.masked_fill(~mask, 0)
    token = torch.gather(F.log_softmax(logits.float(), dim=-1), 2, safe.unsqueeze(-1)).squeeze(-1)
    return (token * mask).sum(-1)


@dataclass
class PreferenceLoss:
    """One batch's loss and what evaluation reports of it (per row, before averaging)."""

    loss: torch.Tensor  # scalar, what backward() takes
    correct: torch.Tensor  # (rows,) 1.0 where the model ranks the row right
    margin: torch.Tensor  # (rows,) the log-probability difference the accuracy looks at


def dpo_loss(
    chosen: torch.Tensor, rejected: torch.Tensor, ref_chosen: torch.Tensor, ref_rejected: torch.Tensor, beta: float
) -> PreferenceLoss:
    """Sigmoid DPO over pairs. Accuracy/margin: does the policy give the chosen reply the higher
    log-probability, and by how much (what ``eval_pref_accuracy``/``eval_pref_margin`` report)."""
    logits = beta * ((chosen - ref_chosen) - (rejected - ref_rejected))
    margin = (chosen - rejected).detach()
    return PreferenceLoss(-F.logsigmoid(logits).mean(), (margin > 0).float(), margin)


def kl_estimate(mismatched: torch.Tensor, ref_mismatched: torch.Tensor) -> torch.Tensor:
    """KTO's reference point ``z``: the policy's mean log-ratio on replies that answer other rows'
    sources, clamped at 0, with no gradient."""
    if mismatched.numel() == 0:
        return torch.zeros((), device=ref_mismatched.device)
    return (mismatched - ref_mismatched).mean().clamp(min=0).detach()


def kto_loss(
    logps: torch.Tensor,
    ref_logps: torch.Tensor,
    desirable: torch.Tensor,
    z: torch.Tensor,
    beta: float,
    desirable_weight: float = 1.0,
    undesirable_weight: float = 1.0,
) -> PreferenceLoss:
    """KTO over single replies marked desirable (True) or not. A row is ranked right when its
    implicit reward has the label's sign (policy above the reference for a good reply, below for
    a bad one); the margin is that log-ratio, signed by the label."""
    desirable = desirable.bool()
    ratio = logps - ref_logps
    reward = beta * ratio
    good = desirable_weight * (1 - torch.sigmoid(reward - beta * z))
    bad = undesirable_weight * (1 - torch.sigmoid(beta * z - reward))
    losses = torch.where(desirable, good, bad)
    signed = torch.where(desirable, ratio, -ratio).detach()
    return PreferenceLoss(losses.mean(), (signed > 0).float(), signed)


def mismatched_order(rows: int) -> list[int]:
    """For KTO's KL estimate: row i's source is paired with row i+1's reply (a rotation, so no
    row keeps its own reply when there are two or more; none with one)."""
    return [(i + 1) % rows for i in range(rows)] if rows > 1 else []
