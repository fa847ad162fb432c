"""Greedy rows' logits processing for all rows at once: ``plain_settings`` reads a row's transformers
processors and stopping criteria as numbers (or says they are something else), ``choose_greedy``
applies those numbers to every row's logits in one pass of tensor operations (the step loop's CUDA
graphs record it: ``chat.stepgraphs``). tests/chat/test_stepgraphs.py checks it picks what each row's
own processors pick."""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from transformers import (
    ForcedEOSTokenLogitsProcessor,
    MinLengthLogitsProcessor,
    MinNewTokensLengthLogitsProcessor,
    RepetitionPenaltyLogitsProcessor,
)
from transformers.generation.stopping_criteria import EosTokenCriteria, MaxLengthCriteria

from chat.fastgen import NoRepeatNGram, _ban

# choose_greedy's per-row settings that change nothing (what a row it does not process gets).
UNPROCESSED = {"penalty": 1.0, "eos_until": 0, "forced_at": -1, "ngram": 0}


def plain_settings(row, eos: set[int]) -> dict | None:
    """A greedy row's processors and stopping criteria as numbers ``choose_greedy`` applies, or None
    when any of them is something else (then the row takes its own processors)."""
    if row.sample:
        return None
    out = dict(UNPROCESSED)
    for p in row.processors:
        if isinstance(p, RepetitionPenaltyLogitsProcessor) and p.prompt_ignore_length is None:
            out["penalty"] = float(p.penalty)
        elif isinstance(p, MinLengthLogitsProcessor | MinNewTokensLengthLogitsProcessor):
            if set(p.eos_token_id.tolist()) != eos:
                return None
            if isinstance(p, MinLengthLogitsProcessor):
                until = p.min_length
            else:  # new tokens counted after the decoder's start token
                until = p.prompt_length_to_skip + p.min_new_tokens
            out["eos_until"] = max(out["eos_until"], int(until))
        elif isinstance(p, ForcedEOSTokenLogitsProcessor) and set(torch.as_tensor(p.eos_token_id).tolist()) == eos:
            out["forced_at"] = int(p.max_length) - 1
        elif type(p) is NoRepeatNGram and not out["ngram"]:
            out["ngram"] = int(p.n)
        else:
            return None
    out["max_length"] = None
    for s in row.stop:
        if isinstance(s, MaxLengthCriteria):
            out["max_length"] = int(s.max_length)
        elif not (isinstance(s, EosTokenCriteria) and set(s.eos_token_id.tolist()) == eos):
            return None
    return out if out["max_length"] is not None else None


def choose_greedy(logits, ids, length, penalty, eos_until, forced_at, ngram, sizes, eos_mask):
    """Greedy next tokens for rows with plain settings, all at once.

    ``logits`` (rows, vocab) float32; ``ids`` (rows, columns) each row's ids so far from column 0,
    the rest the vocabulary size (a spare column: it never matches a real token); ``length`` each
    row's number of ids; per row: repetition ``penalty`` (1: none), EOS banned while ``length <
    eos_until``, only EOS allowed when ``length == forced_at``, n-gram size ``ngram`` (0: none) with
    ``sizes`` the distinct sizes present; ``eos_mask`` (vocab,) the EOS ids. The order and arithmetic
    are those of transformers' RepetitionPenalty, MinLength / MinNewTokensLength and ForcedEOS
    processors and chat.fastgen.NoRepeatNGram on one row."""
    rows, vocab = logits.shape
    scores = F.pad(logits, (0, 1))  # the spare column the padding ids point at
    picked = scores.gather(1, ids)
    p = penalty[:, None]
    scores = scores.scatter(1, ids, torch.where(picked < 0, picked * p, picked / p))[:, :vocab]
    scores = scores.masked_fill((length < eos_until)[:, None] & eos_mask[None], -math.inf)
    for n in sizes:
        windows = ids.unfold(1, n, 1)  # (rows, columns - n + 1, n)
        back = torch.arange(n - 1, device=ids.device) - (n - 1)
        tail = ids.gather(1, (length[:, None] + back[None]).clamp(min=0))  # each row's last n-1 ids
        starts = torch.arange(windows.shape[1], device=ids.device)
        whole = starts[None] + n <= length[:, None]  # windows inside the row's ids
        on = (ngram == n)[:, None] & (length >= n)[:, None]
        matches = (windows[..., :-1] == tail[:, None]).all(-1) & whole & on
        scores = _ban(scores, matches, windows[..., -1])
    forced = torch.full_like(scores[:1], -math.inf).masked_fill(eos_mask[None], 0.0)
    scores = torch.where((length == forced_at)[:, None], forced, scores)
    return scores.argmax(-1)
