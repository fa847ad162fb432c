"""The chat engine under load: ``python -m bench.chat_load``.

N clients chat at once, each sending its next message as soon as its last reply ended (a closed
loop), through the engine's streaming path (what /chat and the API call), every reply forced to
exactly ``--reply_tokens`` new tokens of the ``--preset`` (``fast``: greedy, streamed; ``faithful``:
beam 10, whole). For each scheduler (``static``: chat.batching's generate() per batch; ``step``:
chat.stepping's continuous batching) and each concurrency, in the same run and alternating, on one
loaded model: replies/s, reply latency p50/p95, time to the first streamed text p50, and whether
the replies are those of the first scheduler (greedy and beam search: they must be). ``--adapters
K`` spreads the clients over K LoRA adapters of the model (made with random weights) instead of the
base alone; ``--faithful_every N`` makes every Nth chat ask for ``faithful`` replies (their latency
p50 apart) beside the others.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from dataclasses import replace
from pathlib import Path

import torch

from bench.chat import prompt_set
from bench.chat_adapters import make_adapter
from bench.common import (
    closed_loop,
    command_line,
    cpu_seconds,
    device_name,
    md_table,
    percentile,
    quiet_transformers,
    versions,
    write_json,
)
from chat.batching import Batcher
from chat.engine import GENERATION_PRESETS, ChatEngine, load_apart
from chat.model import ModelLoadError
from chat.stepping import StepBatcher
from chat.stepproc import ProcessBatcher

SCHEDULERS = ("static", "step", "step-serial", "step-eager", "step-beams", "step-lanes", "step-apart", "step-process")


def make_batcher(scheduler: str, max_batch: int) -> Batcher | StepBatcher:
    """``static``: generate() per batch; ``step``: the step loop (on a GPU in slots, steps replayed
    from CUDA graphs, the next started before a step's tokens are handed out); ``step-serial``: the
    same, one step at a time; ``step-eager``: the step loop without graphs; ``step-beams``: the step
    loop with beam search in its steps (``StepBatcher.beams``, off by default; in slots a slot per
    beam); ``step-lanes``: on a GPU adapters' rows in the slots too, each through its own adapter by
    lanes in recorded steps (``StepBatcher.adapters_in_slots``, the default since 2026-12-05: the
    same as ``step``); ``step-apart``: on a GPU adapters' requests to the static batcher instead (the
    default before); ``step-process``: ``step``'s worker in a process of its own (``chat.stepproc``,
    on the CPU too here)."""
    if scheduler == "static":
        return Batcher(max_batch=max_batch)
    if scheduler not in SCHEDULERS:
        raise SystemExit(f"unknown scheduler {scheduler!r}: {', '.join(SCHEDULERS)}")
    # What the step loop does not take (beam search; on a GPU adapters' rows) goes to a static
    # batcher with the same bound on rows.
    stepper = StepBatcher(max_batch=max_batch, fallback=Batcher(max_batch=max_batch))
    if scheduler == "step-eager":
        stepper.cuda_graphs = "off"
    if scheduler == "step-serial":
        stepper.lookahead = False
    if scheduler == "step-beams":
        stepper.beams = True
    if scheduler in ("step-lanes", "step-apart"):
        stepper.adapters_in_slots = scheduler == "step-lanes"
    if scheduler == "step-process":
        return ProcessBatcher(max_batch, local=stepper, devices=("cpu", "cuda"))
    return stepper


def load_round(
    engine: ChatEngine, chats, clients: int, replies: int, settings, stream: bool = True, other=(0, None)
) -> dict:
    """``clients`` threads in a closed loop on the engine's stream (or, ``stream=False``, its whole
    replies, as the API's non-streamed completions) until ``replies`` replies are done; ``other``:
    (N, settings) for every Nth chat instead, whose latency p50 is reported apart."""
    every, other_settings = other
    marked = {id(conv) for conv, _ in chats[::every]} if every else set()

    def make_stream(_k: int):
        def stream_of(conv, message):
            own = other_settings if id(conv) in marked else settings
            if not stream:
                return iter([engine.reply(conv, message, own)[0]])
            return (text for text, _ in engine.stream(conv, message, own))

        return stream_of

    result = closed_loop(make_stream, chats, clients, replies)
    if every:
        kinds = [id(chats[i % len(chats)][0]) in marked for i in range(replies)]  # as closed_loop picks chats
        mine = [t for t, other in zip(result["latencies"], kinds) if other and t is not None]
        rest = [t for t, other in zip(result["latencies"], kinds) if not other and t is not None]
        result.update(other_p50=percentile(mine, 50), p50=percentile(rest, 50), p95=percentile(rest, 95))
    return result


def adapter_chats(engine: ChatEngine, spec: str, prompts, count: int, rank: int, root: Path):
    """``count`` LoRA adapters of the model (random weights), attached; the prompts spread over them."""
    ids = [engine.load(str(make_adapter(spec, rank, root, seed=k, name=f"bot{k}"))).id for k in range(count)]
    return [(replace(conv, model=ids[i % count]), message) for i, (conv, message) in enumerate(prompts)]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.chat_load", description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="facebook/blenderbot-400M-distill", help="else random-400M offline")
    parser.add_argument("--optimize", default="none", help="none, bf16 or int8 (one)")
    parser.add_argument("--schedulers", default="static,step", help=", ".join(SCHEDULERS))
    parser.add_argument("--concurrency", default="1,8", help="comma-separated client counts")
    parser.add_argument("--replies", type=int, default=16, help="replies per round (at least the clients)")
    parser.add_argument("--reply_tokens", type=int, default=24)
    parser.add_argument("--preset", default="fast", choices=sorted(GENERATION_PRESETS))
    parser.add_argument("--faithful_every", type=int, default=0, help="every Nth chat asks for faithful")
    parser.add_argument("--max_batch", type=int, default=8, help="rows per batch / step")
    parser.add_argument("--prompts", type=int, default=8)
    parser.add_argument("--threads", type=int, help="torch's CPU threads")
    parser.add_argument("--no_stream", action="store_true", help="whole replies, not streamed (no text per token)")
    parser.add_argument("--stream_interval", type=float, help="s between a stream's texts (default: the engine's)")
    parser.add_argument("--tf32", action="store_true", help="fp32 products on a GPU's TF32 tensor cores")
    parser.add_argument("--switch_interval", type=float, help="Python's thread switch interval (s; Python: 0.005)")
    parser.add_argument("--adapters", type=int, default=0, help="spread the chats over this many LoRA adapters")
    parser.add_argument("--adapter_r", type=int, default=8)
    parser.add_argument("--out", help="write the results as JSON here")
    args = parser.parse_args(argv)
    if args.stream_interval is not None and args.stream_interval < 0:
        parser.error("--stream_interval must be 0 (every token) or more seconds")
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.switch_interval:
        sys.setswitchinterval(args.switch_interval)
    quiet_transformers()
    if args.tf32:
        torch.backends.cuda.matmul.fp32_precision = "tf32"
    spec = args.model
    try:
        loaded = load_apart(spec, optimize=args.optimize)
    except ModelLoadError:
        spec = "random-400M"
        loaded = load_apart(spec, optimize=args.optimize)
    schedulers = args.schedulers.split(",")
    # One engine (and so one set of attached adapters); each round runs on one scheduler's batcher.
    batchers = {s: make_batcher(s, args.max_batch) for s in schedulers}
    engine = ChatEngine(loaded, f"bench {spec}", batcher=batchers[schedulers[0]])
    engine.stream_interval = args.stream_interval

    def forced(preset: str):  # every reply exactly --reply_tokens long
        return replace(GENERATION_PRESETS[preset], min_new_tokens=args.reply_tokens, max_new_tokens=args.reply_tokens)

    settings = forced(args.preset)
    other = (args.faithful_every, forced("faithful"))
    counts = [int(c) for c in args.concurrency.split(",")]
    if args.faithful_every and not 2 <= args.faithful_every <= args.prompts:
        parser.error("--faithful_every must be from 2 to --prompts (the other chats ask for --preset)")
    chats = prompt_set(args.prompts)
    try:
        with tempfile.TemporaryDirectory() as root:
            if args.adapters:
                chats = adapter_chats(engine, spec, chats, args.adapters, args.adapter_r, Path(root))
            for name in schedulers:  # warm up each path at the widest concurrency (graphs recorded)
                engine._batcher = batchers[name]
                load_round(engine, chats, max(counts), max(counts), settings, not args.no_stream, other)
            results = []
            for clients in counts:
                replies = max(args.replies, clients)
                for name in schedulers:
                    engine._batcher = batchers[name]
                    sent = getattr(engine._batcher, "sent", None)  # replies an engine process served
                    pid = getattr(engine._batcher, "pid", None)
                    cpu = cpu_seconds(), None if pid is None else cpu_seconds(pid)
                    started = time.time()  # wall clock: to match a round with a profiler's samples
                    result = load_round(engine, chats, clients, replies, settings, not args.no_stream, other)
                    wall = result["replies"] / result["replies_per_s"]
                    busy = {  # CPU seconds per wall second of the round: this process's, the engine process's
                        "cpu_busy": (cpu_seconds() - cpu[0]) / wall,
                        "engine_cpu_busy": None if pid is None else (cpu_seconds(pid) - cpu[1]) / wall,
                    }
                    apart = None if sent is None else engine._batcher.sent - sent
                    results.append(
                        {"scheduler": name, **result, **busy, "engine_process_replies": apart, "started": started}
                    )
    finally:  # an engine process stops here, not when this process exits (under pytest: much later)
        for batcher in batchers.values():
            if hasattr(batcher, "close"):
                batcher.close()
    hardware = device_name() + ("" if torch.cuda.is_available() else f", {torch.get_num_threads()} threads")
    env = versions()
    header = (
        f"{spec} ({args.optimize}{', TF32' if args.tf32 else ''}"
        f"{f', {args.adapters} LoRA adapters' if args.adapters else ''}), "
        f"{args.reply_tokens}-token {args.preset} replies{' (not streamed)' if args.no_stream else ''}"
        f"{'' if args.stream_interval is None else f' (streamed every {args.stream_interval} s)'}"
        f"{f', 1 in {args.faithful_every} chats faithful' if args.faithful_every else ''}, "
        f"max batch {args.max_batch}, "
        f"{hardware}, torch {env['torch']}, {env['date']}"
    )
    rows = []
    for r in results:
        base = next(b for b in results if b["clients"] == r["clients"])
        same = sum(a == b for a, b in zip(r["texts"], base["texts"]))
        one = next(b for b in results if b["clients"] == results[0]["clients"] and b["scheduler"] == r["scheduler"])
        rows.append(
            [
                r["scheduler"],
                str(r["clients"]),
                f"{r['replies_per_s']:.2f} ({r['replies_per_s'] / one['replies_per_s']:.2f}x)",
                f"{r['p50']:.3f} s",
                f"{r['p95']:.3f} s",
                f"{r['first_text_p50']:.3f} s",
                f"{same}/{len(base['texts'])}",
                str(len(r["errors"])),
                f"{r['cpu_busy']:.2f}" + ("" if r["engine_cpu_busy"] is None else f" + {r['engine_cpu_busy']:.2f}"),
                *([f"{r['other_p50']:.3f} s"] if args.faithful_every else []),
            ]
        )
    header_row = [
        "scheduler",
        "clients",
        f"replies/s (vs {results[0]['clients']} client)",
        "p50",
        "p95",
        "first text p50",
        f"same replies as {schedulers[0]}",
        "errors",
        "CPU busy (+ engine process)",
        *(["faithful replies' p50 (p50/p95: the others')"] if args.faithful_every else []),
    ]
    print(header)
    print("\n".join(md_table(header_row, rows)))
    if args.out:
        write_json(args.out, {"header": header, "command": command_line("bench.chat_load", argv), "results": results})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
