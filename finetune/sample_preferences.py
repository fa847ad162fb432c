"""Build the shipped sample preference set the way the app's corrections build one.

    python -m finetune.sample_preferences [--model chat/demo_model] [--out_dir data/sample]

For every row of the sample's train and validation splits, the model answers greedily (its own
reply, as the chat would give it); where that reply differs from the dataset's, the row becomes a
DPO pair: chosen = the dataset's reply (what a correction would say), rejected = the model's own.
Rows where the two agree give nothing to prefer and are dropped. Writes
``preferences-train.jsonl`` and ``preferences-validation.jsonl`` (``texts``, ``chosen``,
``rejected``: the DPO row shape of ``finetune.preference_data``); ``kto_rows`` turns pairs into
KTO rows (the chosen reply desirable, the rejected one not). Greedy decoding on the CPU in fp32 is
deterministic, so running it again writes the same bytes.
"""

from __future__ import annotations

import argparse
import json
import logging
from pathlib import Path

import torch

from chat.layout import DEMO_DIR, SAMPLE_DIR
from chat.model import load_model, load_tokenizer
from finetune.data import fitted_sources

log = logging.getLogger(__name__)

PREFIX, MAX_SOURCE, MAX_REPLY = "chatbot: ", 128, 64  # the demo model's training_args.json
SPLITS = ("train", "validation")


@torch.no_grad()
def greedy_replies(model, tokenizer, texts: list[str], batch_size: int = 64) -> list[str]:
    """The model's greedy reply to each source (prefix added, long sources fitted as training does)."""
    replies = []
    for start in range(0, len(texts), batch_size):
        sources = fitted_sources(texts[start : start + batch_size], tokenizer, PREFIX, MAX_SOURCE)
        batch = tokenizer(sources, max_length=MAX_SOURCE, truncation=True, padding=True, return_tensors="pt")
        out = model.generate(
            **batch, num_beams=1, do_sample=False, max_length=MAX_REPLY, min_length=1, no_repeat_ngram_size=0
        )
        replies += [t.strip() for t in tokenizer.batch_decode(out, skip_special_tokens=True)]
    return replies


def build_pairs(rows: list[dict], replies: list[str]) -> list[dict]:
    """DPO rows where the model's reply differs from the dataset's (chosen = the dataset's)."""
    return [
        {"texts": row["texts"], "chosen": row["labels"].strip(), "rejected": reply}
        for row, reply in zip(rows, replies)
        if reply and reply != row["labels"].strip()
    ]


def kto_rows(pairs: list[dict]) -> list[dict]:
    """Each pair as two KTO rows: the chosen reply desirable, the rejected one not."""
    out = []
    for pair in pairs:
        out.append({"texts": pair["texts"], "response": pair["chosen"], "label": True})
        out.append({"texts": pair["texts"], "response": pair["rejected"], "label": False})
    return out


def read_rows(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m finetune.sample_preferences", description=__doc__.split("\n")[0])
    parser.add_argument("--model", default=str(DEMO_DIR), help="the model whose own replies are the rejected ones")
    parser.add_argument("--data_dir", default=str(SAMPLE_DIR), help="where train.jsonl / validation.jsonl are")
    parser.add_argument("--out_dir", default=str(SAMPLE_DIR))
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    torch.manual_seed(0)
    model, tokenizer = load_model(args.model).eval(), load_tokenizer(args.model)
    out = Path(args.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    for split in SPLITS:
        rows = read_rows(Path(args.data_dir) / f"{split}.jsonl")
        pairs = build_pairs(rows, greedy_replies(model, tokenizer, [r["texts"] for r in rows]))
        path = out / f"preferences-{split}.jsonl"
        path.write_text("".join(json.dumps(p) + "\n" for p in pairs))
        log.info(f"{path}: {len(pairs)} pairs from {len(rows)} rows (the model's greedy reply differs)")


if __name__ == "__main__":
    main()
