"""A recipe's compute alone: its DeepSpeed JSON and optimizer, batches already on the GPU, no
data loader, no evaluation. ``bench.train`` runs it next to the CLI, so every training ratio has
this baseline from the same run (the "seed compute" rows of docs/benchmarks.md), and uses it to
try speed levers (torch.compile per layer or of the whole model, DeepSpeed bucket sizes, batch
sizes) cheaply, and profile where a step's GPU time goes (``--profile``: kernels grouped by kind).

    accelerate launch --config_file configs/accelerate/zero2_seed.yaml --num_processes 1 \\
        --mixed_precision fp16 -m bench.train_compute --model random-400M \\
        --train_file runs/bench/data/fixed_train.jsonl --batch 800 --output_dir /tmp/seed-compute

Batches are tokenized up front exactly as the recipe's CLI would pad them (``--pad max``: every
row to the max lengths, the seed; ``batch``: to the longest row, the tuned default) and moved to
the GPU before the first step. The optimizer and schedule are the CLI's own
(``finetune.parts.make_optimizer``), so the seed's JSON brings DeepSpeed's Adam and WarmupDecayLR.
It writes the CLI's metrics.jsonl events (``start``, ``log`` every ``--logging_steps``, then
``eval``: the teacher-forced loss on the shipped sample validation rows after the run's steps,
the quality check that levers must not move by more than 2%).
"""

from __future__ import annotations

import argparse
import json
import random
import time
from pathlib import Path

import torch
from accelerate.utils import set_seed

from bench.profile import Profile
from bench.train_runs import PREFIX
from chat.layout import SAMPLE_DIR
from chat.model import ATTENTION, configure_attention, load_model, load_tokenizer
from finetune.checkpoint import MetricsWriter
from finetune.config import TrainConfig, int_or_auto
from finetune.memory import resolve_batch
from finetune.parts import make_accelerator, make_optimizer

DISTINCT_BATCHES = 4  # cycled: enough to keep the data varied, little tokenizing and GPU memory


def collate(tokenizer, rows: list[dict], source_len: int, target_len: int, pad: str, device) -> dict:
    """One batch as the recipe's CLI would collate it, already on ``device``."""
    padding = {"padding": "max_length"} if pad == "max" else {"padding": "longest", "pad_to_multiple_of": 8}
    src = tokenizer([PREFIX + r["texts"] for r in rows], max_length=source_len, truncation=True, **padding)
    tgt = tokenizer(text_target=[r["labels"] for r in rows], max_length=target_len, truncation=True, **padding)
    labels = torch.tensor(tgt.input_ids)
    labels[labels == tokenizer.pad_token_id] = -100
    batch = {"input_ids": torch.tensor(src.input_ids), "attention_mask": torch.tensor(src.attention_mask)}
    return {k: v.to(device) for k, v in {**batch, "labels": labels}.items()}


def read_rows(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def compile_layers(model) -> int:
    """torch.compile every encoder and decoder layer in place (identical layers share one graph)."""
    layers = [*model.model.encoder.layers, *model.model.decoder.layers]
    for layer in layers:
        layer.compile()
    return len(layers)


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m bench.train_compute", description=__doc__.split("\n")[0])
    parser.add_argument("--model", default="random-400M")
    parser.add_argument("--train_file", type=Path, required=True)
    parser.add_argument("--quality_file", type=Path, default=SAMPLE_DIR / "validation.jsonl")
    parser.add_argument("--batch", type=int_or_auto, required=True, help="Micro-batch per process, or 'auto'.")
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--logging_steps", type=int, default=2)
    parser.add_argument("--source_len", type=int, default=128)
    parser.add_argument("--target_len", type=int, default=64)
    parser.add_argument("--pad", choices=("max", "batch"), default="batch")
    parser.add_argument("--compile", choices=("none", "layers", "model"), default="none")
    parser.add_argument("--profile", type=int, default=0, help="Steps to profile from step 5.")
    parser.add_argument("--attention", choices=ATTENTION, default="sdpa", help="As the CLI's --attention.")
    parser.add_argument("--bucket", type=float, help="DeepSpeed reduce/allgather bucket size (elements).")
    parser.add_argument(
        "--zero",
        type=zero_overrides,
        default={},
        help="DeepSpeed zero_optimization overrides, e.g. stage=1,overlap_comm=false",
    )
    parser.add_argument("--learning_rate", type=float, default=1e-4)
    parser.add_argument("--num_warmup_steps", type=int, default=2)
    parser.add_argument("--seed", type=int, default=25)
    parser.add_argument("--output_dir", type=Path, required=True)
    return parser.parse_args(argv)


def zero_overrides(text: str) -> dict:
    """``stage=1,overlap_comm=false`` -> {"stage": 1, "overlap_comm": False} (JSON values)."""
    out = {}
    for item in filter(None, text.split(",")):
        key, sep, value = item.partition("=")
        if not sep or not key.strip():
            raise argparse.ArgumentTypeError(f"expected key=value, got {item!r}")
        out[key.strip()] = json.loads(value.strip())
    return out


def main(argv: list[str] | None = None) -> int:
    args = parse(argv)
    cfg = TrainConfig(
        model_name_or_path=args.model,
        dataset_name="sample",
        per_device_train_batch_size=args.batch,
        learning_rate=args.learning_rate,
        num_warmup_steps=args.num_warmup_steps,
        max_train_steps=args.steps,
        output_dir=str(args.output_dir),
        seed=args.seed,
    )
    acc = make_accelerator(cfg)
    set_seed(args.seed)
    metrics = MetricsWriter(args.output_dir, enabled=acc.is_main_process)
    tokenizer = load_tokenizer(args.model)
    model = load_model(args.model, attn_implementation=configure_attention(args.attention))
    args.batch = cfg.per_device_train_batch_size = resolve_batch(cfg, acc, model)  # as the CLI resolves 'auto'
    rows = read_rows(args.train_file)
    random.Random(args.seed + acc.process_index).shuffle(rows)
    need = args.batch * DISTINCT_BATCHES
    rows = (rows * (need // len(rows) + 1))[:need]
    batches = [
        collate(tokenizer, rows[i : i + args.batch], args.source_len, args.target_len, args.pad, acc.device)
        for i in range(0, need, args.batch)
    ]
    quality = collate(tokenizer, read_rows(args.quality_file), args.source_len, args.target_len, "max", acc.device)
    ds = acc.state.deepspeed_plugin
    if ds:  # no loader to take the micro-batch from
        ds.deepspeed_config["train_micro_batch_size_per_gpu"] = args.batch
        if args.bucket:
            zero = ds.deepspeed_config["zero_optimization"]
            zero["reduce_bucket_size"] = zero["allgather_bucket_size"] = args.bucket
        ds.deepspeed_config["zero_optimization"].update(args.zero)
    if args.compile == "layers":
        compile_layers(model)
    elif args.compile == "model":  # one graph for the whole forward (fixed shapes: no recompiles)
        model.compile()
    optimizer, scheduler = make_optimizer(acc, model, cfg, args.steps)
    model, optimizer, scheduler = acc.prepare(model, optimizer, scheduler)
    cuda = torch.cuda.is_available()
    metrics.write(
        "start",
        total_steps=args.steps,
        num_processes=acc.num_processes,
        mixed_precision=acc.mixed_precision,
        global_batch_size=args.batch * acc.num_processes,
        gpu_mem_static_gib=torch.cuda.memory_allocated() / 2**30 if cuda else None,
        compile=args.compile,
        bucket=args.bucket,
        zero=args.zero,
    )
    model.train()
    profiler = Profile(args.output_dir, first=5, steps=args.profile) if args.profile and acc.is_main_process else None
    start, samples = time.perf_counter(), 0
    for step in range(1, args.steps + 1):
        if profiler:
            profiler.at(step)
        loss = model(**batches[(step - 1) % len(batches)]).loss
        acc.backward(loss)
        optimizer.step()
        scheduler.step()
        optimizer.zero_grad()
        samples += args.batch * acc.num_processes
        if step % args.logging_steps == 0 or step in (1, args.steps):  # the CLI's log steps
            value = acc.reduce(loss.detach().float(), "mean").item()  # waits for the GPU
            elapsed = time.perf_counter() - start
            entry = {"step": step, "loss": value, "samples_per_second": samples / elapsed}
            if cuda:
                entry["gpu_mem_gib"] = torch.cuda.max_memory_allocated() / 2**30
                entry["alloc_retries"] = torch.cuda.memory_stats().get("num_alloc_retries", 0)
            metrics.write("log", **entry)
            start, samples = time.perf_counter(), 0
    model.eval()
    with torch.no_grad():
        eval_loss = acc.reduce(model(**quality).loss.detach().float(), "mean").item()
    metrics.write("eval", step=args.steps, eval_loss=eval_loss, eval_rows=len(quality["labels"]))
    acc.end_training()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
