"""Does the bot stay who it was told to be? A context score without a judge model.

BLEU against one reference says little about the product's promise: that a reply depends on the
persona, emotion, task goal or topic it was given. This measures that dependence directly. For
each held-out row with a context, the reply (the one the model generated, as for BLEU, or the
dataset's own reply for the ceiling) is scored under its true context and under ``k`` other
contexts of the same kind taken from other rows (chosen by a seeded generator, so every run and
every model sees the same candidates). A row is a hit when the true context gives the reply the
strictly highest log-probability. The share of hits is ``eval_context_hits``; a model whose replies
ignore the context scores chance, 1 / (k + 1); the dataset's replies (``eval_context_hits_gold``)
show how far the data itself lets the context be recovered.

The scorer is the evaluated model unless a fixed one is given (``--context_scorer``), which puts
several runs on one scale.
"""

from __future__ import annotations

import random
from collections import defaultdict

import torch

from chat.prompt import join_source, kind_of, split_source
from finetune.data import fitted_sources
from finetune.preference import IGNORE, sequence_logps

DEFAULT_K = 4


def candidates(sources: list[str], k: int = DEFAULT_K, seed: int = 0) -> list[list[str] | None]:
    """For each source, [the source, then k sources with another context of its kind], or None
    (no context, or fewer than k other contexts of that kind among ``sources``)."""
    by_kind: dict[str, list[str]] = defaultdict(list)
    parts = []
    for source in sources:
        kind = kind_of(source)
        context, turns = split_source(source)
        parts.append((kind, context, turns))
        if kind != "none" and context not in by_kind[kind]:
            by_kind[kind].append(context)  # first-seen order: independent of hashing
    rng = random.Random(seed)
    out: list[list[str] | None] = []
    for kind, context, turns in parts:
        others = [c for c in by_kind.get(kind, []) if c != context]
        if kind == "none" or len(others) < k:
            out.append(None)
            continue
        out.append([join_source(context, turns)] + [join_source(c, turns) for c in rng.sample(others, k)])
    return out


@torch.no_grad()
def reply_scores(model, tokenizer, sources: list[str], replies: list[str], cfg, batch_size: int = 64) -> list[float]:
    """log p(reply | prefix + source) for each pair, summed over the reply's tokens (eval mode)."""
    device = next(model.parameters()).device
    was_training = model.training
    model.eval()
    scores: list[float] = []
    for start in range(0, len(sources), batch_size):
        texts = fitted_sources(sources[start : start + batch_size], tokenizer, cfg.source_prefix, cfg.max_source_length)
        enc = tokenizer(texts, max_length=cfg.max_source_length, truncation=True, padding=True, return_tensors="pt")
        labels = tokenizer(
            text_target=replies[start : start + batch_size],
            max_length=cfg.val_max_target_length,
            truncation=True,
            padding=True,
            return_tensors="pt",
        ).input_ids
        labels[labels == tokenizer.pad_token_id] = IGNORE
        enc = {name: value.to(device) for name, value in enc.items()}
        logits = model(**enc, labels=labels.to(device)).logits
        scores += sequence_logps(logits, labels.to(device)).float().cpu().tolist()
    model.train(was_training)
    return scores


def hits(
    model, tokenizer, sources: list[str], replies: list[str], cfg, k: int = DEFAULT_K, seed: int = 0, score=None
) -> list[tuple[str, float]]:
    """(kind, hit) for every row that has candidates: 1 when its true context scores ``replies[i]``
    highest of the k + 1, 1/n when n candidates tie for the highest with it, else 0. ``score``
    (sources, replies) -> log-probabilities replaces ``reply_scores`` on ``model`` (evaluation
    spreads the rows over its processes)."""
    groups = candidates(sources, k, seed)
    rows = [i for i, group in enumerate(groups) if group is not None]
    flat_sources = [s for i in rows for s in groups[i]]
    flat_replies = [replies[i] for i in rows for _ in range(k + 1)]
    if score is None:
        scores = reply_scores(model, tokenizer, flat_sources, flat_replies, cfg)
    else:
        scores = score(flat_sources, flat_replies)
    out = []
    for n, i in enumerate(rows):
        true, *others = scores[n * (k + 1) : (n + 1) * (k + 1)]
        # A tie at the top shares the hit: a scorer blind to the context scores chance, not zero.
        top = max(true, *others)
        out.append((kind_of(sources[i]), (true == top) / (1 + sum(o == top for o in others))))
    return out


def summarize(found: list[tuple[str, float]], suffix: str = "") -> dict:
    """``eval_context_hits{suffix}`` overall and per kind (``_<kind>``), with the rows counted."""
    if not found:
        return {}
    out = {
        f"eval_context_hits{suffix}": sum(h for _, h in found) / len(found),
        f"eval_context_rows{suffix}": len(found),
    }
    for kind in sorted({kind for kind, _ in found}):
        mine = [h for kind_, h in found if kind_ == kind]
        out[f"eval_context_hits{suffix}_{kind}"] = sum(mine) / len(mine)
    return out


def context_score(
    model, tokenizer, sources, predictions, references, cfg, k: int = DEFAULT_K, seed: int = 0, score=None
) -> dict:
    """The figures evaluation reports: hits for the generated replies and, as the ceiling, for
    the dataset's own (``_gold``), and the chance level 1 / (k + 1). ``score``: as for ``hits``."""
    figures = summarize(hits(model, tokenizer, sources, predictions, cfg, k, seed, score))
    if not figures:
        return {}
    figures.update(summarize(hits(model, tokenizer, sources, references, cfg, k, seed, score), "_gold"))
    figures["eval_context_chance"] = 1 / (k + 1)
    return figures
