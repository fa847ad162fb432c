"""What the context score adds to an evaluation: ``finetune.context_score.context_score`` on N
held-out rows, timed beside the evaluation's loss forward of the same rows (the baseline, in the
same process).

    python -m bench.eval_context --model random-400M --rows 1000 --batch 1000      # one H200
    python -m bench.eval_context --model chat/demo_model --rows 187 --batch 64 --dtype float32  # CPU

Rows are the sample generator's (``bench.train``'s "realistic" rows: persona, emotion, task, topic
and none in equal shares); the replies scored are the references, standing in for the generated
ones (the score needs no generation: evaluation hands it the replies it generated for BLEU). The
score runs what evaluation runs: the rows with a context, each under its true context and K = 4
others, for the generated replies and again for the references (the ceiling), so 2 x 5 sequence
scores per context row. The evaluation's generation is not repeated here; add the time printed to
the evaluation's (4.2 s for 1,000 rows on one H200, docs/benchmarks.md).
"""

from __future__ import annotations

import argparse
import json
import random
import time

import torch

from bench.common import device_name, quiet_transformers, versions
from chat.model import load_model, load_tokenizer
from finetune.config import TrainConfig
from finetune.context_score import context_score, reply_scores
from finetune.data import fitted_sources
from finetune.sample_data import generate_split


def sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def rows(n: int) -> list[dict]:
    found, _ = generate_split(max(n, 300), random.Random("bench"), allow_held_out=True, seen=set())
    return [found[i % len(found)] for i in range(n)]


@torch.no_grad()
def loss_forward(model, tokenizer, data: list[dict], cfg, batch: int) -> None:
    """The evaluation's loss forward of these rows (prefix, fitted sources, labels), one per row."""
    device = next(model.parameters()).device
    for start in range(0, len(data), batch):
        part = data[start : start + batch]
        texts = fitted_sources([r["texts"] for r in part], tokenizer, cfg.source_prefix, cfg.max_source_length)
        enc = tokenizer(texts, max_length=cfg.max_source_length, truncation=True, padding=True, return_tensors="pt")
        labels = tokenizer(
            text_target=[r["labels"] for r in part], max_length=64, truncation=True, padding=True, return_tensors="pt"
        ).input_ids
        labels[labels == tokenizer.pad_token_id] = -100
        model(**{k: v.to(device) for k, v in enc.items()}, labels=labels.to(device))


def timed(fn, repeats: int) -> tuple[float, object]:
    times, out = [], None
    for _ in range(repeats):
        sync()
        start = time.perf_counter()
        out = fn()
        sync()
        times.append(time.perf_counter() - start)
    return min(times), out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.eval_context", description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="random-400M")
    parser.add_argument("--rows", type=int, default=1000)
    parser.add_argument(
        "--batch", type=int, default=1000, help="rows per forward (the eval batch; evaluation uses ≥ 64)"
    )
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
    parser.add_argument("--repeats", type=int, default=2)
    args = parser.parse_args(argv)
    quiet_transformers()
    device = "cuda" if torch.cuda.is_available() else "cpu"
    tokenizer = load_tokenizer(args.model)
    model = load_model(args.model, dtype=getattr(torch, args.dtype)).to(device).eval()
    cfg = TrainConfig(dataset_name="sample", per_device_eval_batch_size=args.batch)
    data = rows(args.rows)
    sources, replies = [r["texts"] for r in data], [r["labels"] for r in data]

    def score(flat_sources, flat_replies):
        return reply_scores(model, tokenizer, flat_sources, flat_replies, cfg, batch_size=args.batch)

    loss_forward(model, tokenizer, data[:8], cfg, args.batch)  # warm-up
    loss_s, _ = timed(lambda: loss_forward(model, tokenizer, data, cfg, args.batch), args.repeats)
    context_s, figures = timed(
        lambda: context_score(model, tokenizer, sources, replies, replies, cfg, score=score), args.repeats
    )
    result = {
        "header": f"{args.model} {args.dtype}, {args.rows} rows, batch {args.batch}, {device_name()}",
        "environment": versions(),
        "loss_forward_s": round(loss_s, 3),
        "context_score_s": round(context_s, 3),
        "context_rows": figures.get("eval_context_rows"),
        "sequences_scored": 2 * 5 * (figures.get("eval_context_rows") or 0),
        "context_vs_loss_forward": round(context_s / loss_s, 2),
        "eval_context_hits": figures.get("eval_context_hits"),
    }
    print(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
