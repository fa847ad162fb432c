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
BLEU_DROP_LIMIT = 2.0  # a preference run whose BLEU falls more than this below its start is flagged


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


# --------------------------------------------------------------------------- batches and forwards

# The reply columns of a tokenized preference row, per objective (finetune.preference_data.tokenize):
# DPO rows have two replies; KTO rows one, plus the reply of another row for the KL estimate.
REPLIES = {"dpo": ("chosen_labels", "rejected_labels"), "kto": ("labels", "kl_labels")}
REFERENCE = {"dpo": ("ref_chosen", "ref_rejected"), "kto": ("ref_logps", "ref_kl")}


def _pad(rows: list[list[int]], value: int) -> torch.Tensor:
    width = max(len(r) for r in rows)
    return torch.tensor([list(r) + [value] * (width - len(r)) for r in rows], dtype=torch.long)


@dataclass
class PreferenceCollator:
    """Tokenized preference rows to one batch: the sources once (``input_ids``, ``attention_mask``)
    and each reply column padded with ``IGNORE``; KTO's ``label`` and any precomputed reference
    log-probabilities ride along as tensors."""

    pad_token_id: int

    def __call__(self, features: list[dict]) -> dict[str, torch.Tensor]:
        ids = _pad([f["input_ids"] for f in features], self.pad_token_id)
        batch = {"input_ids": ids, "attention_mask": (ids != self.pad_token_id).long()}
        for column in ("chosen_labels", "rejected_labels", "labels", "kl_labels"):
            if column in features[0]:
                batch[column] = _pad([f[column] for f in features], IGNORE)
        for column in ("label", "ref_chosen", "ref_rejected", "ref_logps", "ref_kl"):
            if column in features[0]:
                batch[column] = torch.tensor([f[column] for f in features])
        return batch


def reply_logps(model, batch: dict, objective: str) -> tuple[torch.Tensor, torch.Tensor]:
    """Summed log-probabilities of both reply columns in ONE forward (the sources repeated: one
    encoder-decoder call is what DeepSpeed's engine expects before its backward): chosen and
    rejected for DPO; for KTO the reply and another row's reply (the KL pairing)."""
    first, second = (batch[c] for c in REPLIES[objective])
    width = max(first.shape[1], second.shape[1])
    labels = torch.cat(
        [
            F.pad(first, (0, width - first.shape[1]), value=IGNORE),
            F.pad(second, (0, width - second.shape[1]), value=IGNORE),
        ]
    )
    inputs = {k: torch.cat([batch[k], batch[k]]) for k in ("input_ids", "attention_mask")}
    logps = sequence_logps(model(**inputs, labels=labels).logits, labels)
    return logps[: first.shape[0]], logps[first.shape[0] :]


def preference_loss(model, batch: dict, objective: str, beta: float, sft_weight: float = 0.0) -> PreferenceLoss:
    """The objective's loss on one batch whose reference log-probabilities were precomputed
    (``reference_logps``), plus ``sft_weight`` times the mean token loss of the good replies (DPO's
    chosen ones; KTO's desirable ones)."""
    first, second = reply_logps(model, batch, objective)
    ref_first, ref_second = (batch[c] for c in REFERENCE[objective])
    if objective == "dpo":
        out = dpo_loss(first, second, ref_first, ref_second, beta)
        good = torch.ones_like(first, dtype=torch.bool)
    else:  # KTO: `second` is every row's log-probability of another row's reply (none: a batch of one)
        kl_rows = batch["kl_labels"][:, 0] != IGNORE
        out = kto_loss(first, ref_first, batch["label"], kl_estimate(second[kl_rows], ref_second[kl_rows]), beta)
        good = batch["label"].bool()
    if sft_weight:
        tokens = (batch[REPLIES[objective][0]] != IGNORE).sum(-1)
        out.loss = out.loss - sft_weight * first[good].sum() / tokens[good].sum().clamp(min=1)
    return out


@torch.no_grad()
def reference_logps(model, loader, objective: str, device) -> tuple[list[float], list[float]]:
    """Both reply columns' log-probabilities under ``model`` as it is now, for every row of
    ``loader`` in order (eval mode: no dropout). Run once on the model a run starts from, before
    any step, they are the frozen reference, so the run needs no second copy of the model (with a
    LoRA adapter that is also the base with the adapter's update as it started)."""
    was_training = model.training
    model.eval()
    firsts, seconds = [], []
    for batch in loader:
        batch = {k: v.to(device) for k, v in batch.items()}
        first, second = reply_logps(model, batch, objective)
        firsts += first.float().cpu().tolist()
        seconds += second.float().cpu().tolist()
    model.train(was_training)
    return firsts, seconds
