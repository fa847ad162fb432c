"""Chat latency / throughput / memory benchmark: ``python -m bench.chat``.

Measures, on the 400M architecture (real weights when the Hub has them, else ``random-400M``),
for each preset: reply latency p50/p95 over a fixed prompt set from the shipped validation data,
time to the first streamed text (streaming presets), latency when each reply has a source length
the engine has not served (what CUDA-graph recording costs real chats), resident memory, and
replies/s for N concurrent chats against the same chats served one by one. Every reply is forced to exactly
``--reply_tokens`` new tokens so latency does not depend on the weights. ``--optimize`` lists
the variants to compare in one run (the first is the baseline for the speed-up column).
Results go to stdout as a markdown table and, with ``--out``, to a JSON file.

``--adapter``: instead, what a LoRA adapter costs: base and base + adapter in the same run, their
replies interleaved (``bench.chat_adapters``).
"""

from __future__ import annotations

import argparse
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace

import torch

from bench import chat_adapters
from bench.common import (
    command_line,
    device_name,
    md_table,
    percentile,
    quiet_transformers,
    sample_rows,
    versions,
    write_json,
)
from chat.adapters import LORA_TARGETS
from chat.batching import graph_mode
from chat.engine import GENERATION_PRESETS, ChatEngine, Conversation, load_apart
from chat.model import ModelLoadError
from chat.optimize import memory_mib
from chat.prompt import KINDS, format_context, split_source

# How each kind's context starts and ends in a source, read off the format itself so it cannot drift.
_PARTS = {kind: format_context(kind, "CONTEXT").partition("CONTEXT")[::2] for kind in KINDS if kind != "none"}


def prompt_set(n: int) -> list[tuple[Conversation, str]]:
    """The first ``n`` multi-turn rows of the shipped validation split, as (conversation, message)."""
    rows = [r for r in sample_rows("validation") if r["texts"].count("<s>") >= 3][:n]
    out = []
    for row in rows:
        context_text, turns = split_source(row["texts"])
        kind, context = "none", ""
        for name, (head, tail) in _PARTS.items():
            if context_text.startswith(head):
                kind, context = name, context_text[len(head) :].removesuffix(tail)
        out.append((Conversation(kind, context, turns[:-1]), turns[-1]))
    return out


def source_length(engine: ChatEngine, conv: Conversation, message: str) -> int:
    """Tokens of the source the engine builds for ``message`` after ``conv``."""
    return engine.build_input(replace(conv, turns=[*conv.turns, message]))[0]["input_ids"].shape[1]


def fresh_prompts(engine: ChatEngine, prompts, taken: set[int]) -> list[tuple[Conversation, str]]:
    """The prompts again, each message lengthened by filler words until its source has a token
    length not in ``taken`` (which grows): every reply meets a shape the engine has not served, as
    most real replies do (their lengths vary), so CUDA-graph decoding pays its recording in the time."""
    out = []
    for conv, message in prompts:
        for extra in range(1, 64):
            longer = f"{message}{' really' * extra}"
            length = source_length(engine, conv, longer)
            if length not in taken:
                taken.add(length)
                out.append((conv, longer))
                break
    return out


def timed_reply(engine: ChatEngine, conv: Conversation, message: str, settings) -> tuple[float, float | None]:
    """Seconds to the whole reply and (streaming presets) to its first text."""
    t0 = time.perf_counter()
    if not settings.streams:
        engine.reply(conv, message, settings)
        return time.perf_counter() - t0, None
    stream = engine.stream(conv, message, settings)
    next(stream)
    first = time.perf_counter() - t0
    for _ in stream:
        pass
    return time.perf_counter() - t0, first


def plain_generate(engine: ChatEngine, prompts, settings, repeats: int) -> dict:
    """The baseline: the same prompts through transformers' generate() as it comes (no batcher,
    no chat.fastgen, no CUDA graphs), timed the same way; and its replies, to compare with. It
    runs in a thread that ends with it, as loads do (``chat.engine.load_apart`` says why)."""
    with ThreadPoolExecutor(1) as pool:
        return pool.submit(_plain_generate, engine, prompts, settings, repeats).result()


def _plain_generate(engine: ChatEngine, prompts, settings, repeats: int) -> dict:
    replies, latencies = [], []
    for repeat in range(repeats + 1):  # the first pass warms up
        for conv, message in prompts:
            loaded, encoded, _, kwargs = engine._prepare(conv, message, settings)
            t0 = time.perf_counter()
            with torch.inference_mode():
                inputs = {k: v.to(loaded.model.device) for k, v in encoded.items()}
                out = loaded.model.generate(**inputs, **kwargs)
            if repeat:
                latencies.append(time.perf_counter() - t0)
            else:
                replies.append(engine._clean_reply(loaded.tokenizer.decode(out[0], skip_special_tokens=True)))
    return {"p50": percentile(latencies, 50), "p95": percentile(latencies, 95), "replies": replies}


def bench_variant(
    spec: str,
    variant: str,
    prompts,
    reply_tokens: int,
    repeats: int,
    concurrency: int,
    plain: bool = False,
    window_ms: float | None = None,
) -> dict:
    """One variant, ``optimize[:graphs]`` (graphs: CHAT_CUDA_GRAPHS's capture, compile or off)."""
    optimize, _, graphs = variant.partition(":")
    rss_before = memory_mib()["rss"]
    start = time.perf_counter()
    engine = ChatEngine(load_apart(spec, optimize=optimize), f"bench {spec}")  # as the app loads
    if graphs:
        engine._batcher.cuda_graphs = graph_mode(graphs)
    if window_ms is not None:
        engine._batcher.window_s = window_ms / 1000
    load_s = time.perf_counter() - start
    engine.warm_up()  # prepares the GPU CUDA-graph decoding, as ChatEngine.start does
    warm_s = time.perf_counter() - start - load_s
    result = {
        "optimize": optimize,
        "graphs": engine._batcher.cuda_graphs,
        "batch_window_ms": engine._batcher.window_s * 1000,
        "load_seconds": load_s,
        "warm_up_seconds": warm_s,
        "device": str(engine.current.model.device),
    }
    for name, preset in GENERATION_PRESETS.items():
        settings = replace(preset, min_new_tokens=reply_tokens, max_new_tokens=reply_tokens)
        replies = [engine.reply(conv, message, settings)[0] for conv, message in prompts]  # also warms up
        timings = [timed_reply(engine, conv, message, settings) for _ in range(repeats) for conv, message in prompts]
        latencies, first = [t for t, _ in timings], [f for _, f in timings if f is not None]
        # Then as real chats mostly are: each reply a source length the engine has not served.
        taken = {source_length(engine, c, m) for c, m in prompts}
        fresh = [timed_reply(engine, c, m, settings)[0] for c, m in fresh_prompts(engine, prompts, taken)]
        result[name] = {
            "p50": percentile(latencies, 50),
            "p95": percentile(latencies, 95),
            "first_text_p50": percentile(first, 50) if first else None,
            "new_shape_p50": percentile(fresh, 50),
            "replies": replies,
        }
        if plain:
            result[f"plain_{name}"] = plain_generate(engine, prompts, settings, repeats)
    # Throughput: the same chats one by one, then all at once (batched by the engine).
    settings = replace(GENERATION_PRESETS["fast"], min_new_tokens=reply_tokens, max_new_tokens=reply_tokens)
    chats = (prompts * concurrency)[:concurrency]
    t0 = time.perf_counter()
    for conv, message in chats:
        engine.reply(conv, message, settings)
    sequential = time.perf_counter() - t0
    t0 = time.perf_counter()
    with ThreadPoolExecutor(concurrency) as pool:
        list(pool.map(lambda c: engine.reply(c[0], c[1], settings), chats))
    together = time.perf_counter() - t0
    result["throughput"] = {
        "concurrency": concurrency,
        "sequential_replies_per_s": concurrency / sequential,
        "concurrent_replies_per_s": concurrency / together,
    }
    rss = memory_mib()["rss"]
    result["rss_gib"] = rss / 1024
    result["rss_model_gib"] = (rss - rss_before) / 1024
    return result


def same_replies(result: dict, base: dict, preset: str) -> str:
    """How many of ``result``'s replies for ``preset`` are those of ``base`` (plain generate or
    the first variant), e.g. ``8/8``."""
    ours, theirs = result[preset]["replies"], base["replies"]
    return f"{sum(a == b for a, b in zip(ours, theirs))}/{len(theirs)}"


def table(results: list[dict]) -> str:
    base = results[0]
    header = [
        "variant",
        "fast p50",
        "fast p95",
        "first text p50",
        "faithful p50",
        "faithful p95",
        "same replies as plain/first (fast, faithful)",
        "new source length: fast / faithful p50",
        f"{base['throughput']['concurrency']} chats: one by one → together (replies/s)",
        "RSS GiB",
    ]
    rows = []
    for r in results:
        if "plain_fast" in r:  # the baseline: transformers' generate() as it comes, same prompts
            f, b = r["plain_fast"], r["plain_faithful"]
            rows.append(
                [
                    f"plain generate, {r['optimize']}",
                    f"{f['p50']:.3f} s",
                    f"{f['p95']:.3f} s",
                    "–",
                    f"{b['p50']:.3f} s",
                    f"{b['p95']:.3f} s",
                    "–",
                    "–",
                    "–",
                    "–",
                ]
            )
        f, b, t = r["fast"], r["faithful"], r["throughput"]
        speed = base["fast"]["p50"] / f["p50"]
        ref = {p: base.get(f"plain_{p}", base[p]) for p in ("fast", "faithful")}
        rows.append(
            [
                f"{r['optimize']}, graphs {r.get('graphs', '?')} ({r['device']})",
                f"{f['p50']:.3f} s ({speed:.2f}x)",
                f"{f['p95']:.3f} s",
                f"{f['first_text_p50']:.3f} s",
                f"{b['p50']:.3f} s",
                f"{b['p95']:.3f} s",
                f"{same_replies(r, ref['fast'], 'fast')}, {same_replies(r, ref['faithful'], 'faithful')}",
                f"{f['new_shape_p50']:.3f} / {b['new_shape_p50']:.3f} s",
                f"{t['sequential_replies_per_s']:.2f} → {t['concurrent_replies_per_s']:.2f}",
                f"{r['rss_gib']:.2f}",
            ]
        )
    return "\n".join(md_table(header, rows))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.chat", description=__doc__.splitlines()[0])
    parser.add_argument(
        "--model",
        default="facebook/blenderbot-400M-distill",
        help="checkpoint to time; falls back to random-400M when the Hub is unreachable",
    )
    parser.add_argument(
        "--optimize",
        default="none,auto",
        help="comma-separated variants: none, bf16, int8 or auto, each optionally with :capture, :compile "
        "or :off for its CUDA graphs on a GPU (e.g. none:compile,none:capture)",
    )
    parser.add_argument("--window_ms", type=float, help="the batcher's wait for requests to join a batch")
    parser.add_argument("--plain", action="store_true", help="also time transformers' plain generate() (first variant)")
    parser.add_argument("--reply_tokens", type=int, default=24)
    parser.add_argument("--prompts", type=int, default=8)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--concurrency", type=int, default=8)
    parser.add_argument("--out", help="write the results as JSON here")
    parser.add_argument("--threads", type=int, help="torch's CPU threads (default: torch's, one per core)")
    parser.add_argument("--adapter", action="store_true", help="time base against base + a LoRA adapter instead")
    parser.add_argument("--adapter_r", type=int, default=8, help="rank of the adapter made for --adapter")
    parser.add_argument("--adapter_path", help="a LoRA adapter of --model to time instead of a made one")
    parser.add_argument(
        "--peft_forward", action="store_true", help="with --adapter: LoRA layers through peft's own forward (baseline)"
    )
    args = parser.parse_args(argv)
    if args.adapter_r < 1:
        parser.error("--adapter_r must be at least 1")
    if args.threads is not None:
        if args.threads < 1:
            parser.error("--threads must be at least 1")
        torch.set_num_threads(args.threads)
    quiet_transformers()

    spec = args.model
    try:
        load_apart(spec, optimize="none")  # (no torch work in this long-lived thread: see load_apart)
        weights = "random-init weights" if spec == "random-400M" else "real weights"
    except ModelLoadError:
        spec, weights = "random-400M", "random-init weights (Hub unreachable)"
    prompts = prompt_set(args.prompts)
    variants = args.optimize.split(",")
    if args.adapter:
        what = f"LoRA r{args.adapter_r} on {', '.join(LORA_TARGETS)}" if not args.adapter_path else "LoRA adapter"
        results = chat_adapters.run(
            spec,
            variants,
            prompts,
            args.reply_tokens,
            args.repeats,
            args.adapter_r,
            args.adapter_path,
            args.peft_forward,
        )
    else:
        what = ""
        results = [
            bench_variant(
                spec,
                v,
                prompts,
                args.reply_tokens,
                args.repeats,
                args.concurrency,
                args.plain and i == 0,
                args.window_ms,
            )
            for i, v in enumerate(variants)
        ]
    hardware = device_name() + ("" if torch.cuda.is_available() else f", {torch.get_num_threads()} threads")
    env = versions()
    header = (
        f"{spec} ({weights}){f', {what}' if what else ''}, {args.reply_tokens}-token replies, "
        f"{len(prompts)} prompts x {args.repeats}, {hardware}, torch {env['torch']}, {env['date']}"
    )
    print(header)
    print(chat_adapters.table(results) if args.adapter else table(results))
    if args.out:
        write_json(
            args.out,
            {"header": header, "command": command_line("bench.chat", argv), "environment": env, "results": results},
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
