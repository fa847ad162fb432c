"""Compare the CPU optimizations of ``chat.optimize`` in one process: latency, streaming, memory, numerics.

    PERSONA_CHAT_CACHE=/tmp/pcache2 python -m bench.cpu_variants            # ~3-5 min on 2 cores
    python -m bench.cpu_variants --variants none,int8 --prompts 4 --out bench.json

Every model is loaded as the chat engine loads it (``chat.engine.load_checkpoint``: its checks,
its generation config, ``optimize_for_cpu`` in the variant's mode), and the decoding settings
are the engine's presets. For each variant (a mode of ``optimize_for_cpu``, optionally
``@THREADS``, e.g. ``int8@1``) and a fixed set of 64-token prompts (the engine's ``BASE_PREFIX``
+ the most recent text of sample validation dialogues), it measures

* greedy, streamed through ``TextIteratorStreamer`` in a thread (how the ``fast`` preset serves):
  total latency, time to the first generated token reaching the streamer, and (in ``--out`` only)
  time to the first non-empty text chunk, which on random weights is meaningless: most of the
  model's 8008 ids are outside the preset tokenizer's 1934 and decode to nothing;
* beam-10 with the ``faithful`` preset's settings;
* agreement with fp32: identical greedy / beam tokens (position by position), and on a forward
  pass teacher-forced with fp32's greedy reply, top-1 agreement and the relative L2 error of the
  logits; the same on the bundled *trained* demo model (natural stopping; skip with ``--no_demo_check``);
* memory: each mode is loaded and optimized in a fresh subprocess (so RSS is not polluted by the
  other variants), reporting RSS after load+optimize+warm-up and the peak (VmHWM).

Replies are forced to ``--reply_tokens`` tokens (min = max new tokens): the default model is the
``random-400M`` preset (blenderbot-400M-distill's shape, random weights that never emit EOS).

Variants are interleaved prompt by prompt (with rotating order) so background load hits them
alike; the CPU time other processes used during each variant's samples is reported as
"other load" (in cores) to make noise visible.

The measuring pieces (decoding settings, loading, prompts, timed replies, the memory probe) are
in ``bench/cpu_probes.py``; this file runs the study and renders its table.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

import torch

from bench.common import command_line, cpu_name, md_table, percentile, quiet_transformers, versions, write_json
from bench.cpu_probes import (
    FAITHFUL,
    GREEDY,
    build_prompts,
    decoder_step_split,
    decoding,
    load,
    read_bandwidth_gbs,
    rss_probe,
    run_probe,
    teacher_forced_logits,
    timed_beam,
    timed_stream,
    token_agreement,
)
from chat.layout import DEMO_DIR, ROOT
from chat.optimize import OPTIMIZE_MODES

# ---------------------------------------------------------------------------------------------
# Demo-model check: agreement with fp32 on real (tiny, trained) weights, natural stopping


def demo_check(modes: list[str], n_prompts: int, reply_tokens: int) -> dict:
    outs: dict[str, dict[str, list[list[int]]]] = {}
    for mode in ["none"] + [m for m in modes if m != "none"]:
        model, tokenizer = load(str(DEMO_DIR), mode)
        prompts = build_prompts(tokenizer, n_prompts, 64)
        res = outs[mode] = {"greedy": [], "beam": []}
        with torch.inference_mode():
            for ids in prompts:
                for key, settings in (("greedy", GREEDY), ("beam", FAITHFUL)):
                    out = model.generate(input_ids=ids, **decoding(settings, reply_tokens, forced=False))
                    res[key].append(out[0, 1:].tolist())
    report = {}
    for mode, res in outs.items():
        report[mode] = {}
        for key in ("greedy", "beam"):
            ref = outs["none"][key]
            report[mode][key + "_identical"] = sum(a == b for a, b in zip(res[key], ref)) / len(ref)
            report[mode][key + "_tokens"] = statistics.mean(token_agreement(a, b) for a, b in zip(res[key], ref))
    return report


# ---------------------------------------------------------------------------------------------
# The timed runs and what they add up to


def parse_variant(spec: str, default_threads: int) -> tuple[str, str, int]:
    mode, _, threads = spec.partition("@")
    if mode not in OPTIMIZE_MODES:
        raise SystemExit(f"unknown mode {mode!r} in {spec!r}: expected one of {', '.join(OPTIMIZE_MODES)}")
    n = int(threads) if threads else default_threads
    return (f"{mode}@{n}", mode, n)


def time_variants(variants, models: dict, tokenizer, prompts, repeats: int, reply_tokens: int) -> dict:
    """Every variant on every prompt, greedy then beam; interleaved prompt by prompt in rotating
    order, so background load hits the variants alike."""
    for _, mode, threads in variants:  # warm-up: oneDNN/fbgemm primitives for every shape
        torch.set_num_threads(threads)
        timed_stream(models[mode], tokenizer, prompts[0], reply_tokens)
        timed_beam(models[mode], prompts[0], reply_tokens)
    samples = {name: {"greedy": [], "beam": []} for name, _, _ in variants}
    for kind in ("greedy", "beam"):
        for rep in range(repeats):
            for i, ids in enumerate(prompts):
                r = (i + rep) % len(variants)
                for name, mode, threads in variants[r:] + variants[:r]:
                    torch.set_num_threads(threads)
                    if kind == "greedy":
                        s = timed_stream(models[mode], tokenizer, ids, reply_tokens)
                    else:
                        s = timed_beam(models[mode], ids, reply_tokens)
                    s["prompt"] = i
                    samples[name][kind].append(s)
    return samples


def numerics(models: dict, prompts, ref_greedy: dict) -> dict:
    """Per mode, on a forward pass teacher-forced with fp32's greedy replies: the logits' relative
    L2 error against fp32's and how often their top-1 token agrees."""
    start = models["none"].generation_config.decoder_start_token_id
    ref_logits, out = {}, {}
    for mode, model in models.items():
        rel, top1 = [], []
        for i, ids in enumerate(prompts):
            logits = teacher_forced_logits(model, ids, torch.tensor([[start] + ref_greedy[i][:-1]]))
            ref = ref_logits.setdefault(i, logits) if mode == "none" else ref_logits[i]
            rel.append(((logits - ref).norm() / ref.norm()).item())
            top1.append((logits.argmax(-1) == ref.argmax(-1)).float().mean().item())
        out[mode] = {"logits_rel_err": statistics.mean(rel), "teacher_forced_top1": statistics.mean(top1)}
    return out


def summarize(variants, samples: dict, ref_name: str, n_prompts: int, numbers: dict, memory: dict) -> list[dict]:
    """One row per variant: latency percentiles, agreement with fp32's tokens, numerics, memory."""
    ref_greedy = {s["prompt"]: s["tokens"] for s in samples[ref_name]["greedy"][:n_prompts]}
    ref_beam = {s["prompt"]: s["tokens"] for s in samples[ref_name]["beam"][:n_prompts]}
    rows = []
    for name, mode, threads in variants:
        g, b = samples[name]["greedy"], samples[name]["beam"]

        def p(values: list[dict], key: str, q: float) -> float:
            return percentile([s[key] for s in values], q)

        rows.append(
            {
                "variant": name,
                "mode": mode,
                "threads": threads,
                "greedy_p50": p(g, "latency", 50),
                "greedy_p95": p(g, "latency", 95),
                "first_token_p50": p(g, "first_token", 50),
                "first_token_p95": p(g, "first_token", 95),
                "first_text_p50": p(g, "first_text", 50),
                "beam_p50": p(b, "latency", 50),
                "beam_p95": p(b, "latency", 95),
                "other_load": statistics.mean(s["other"] for s in g + b),
                "greedy_agree": statistics.mean(token_agreement(s["tokens"], ref_greedy[s["prompt"]]) for s in g),
                "beam_agree": statistics.mean(token_agreement(s["tokens"], ref_beam[s["prompt"]]) for s in b),
                **numbers[mode],
                "memory": memory.get(mode),
            }
        )
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.cpu_variants", description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="random-400M", help="preset name or model directory")
    parser.add_argument(
        "--variants",
        default="none,bf16,int8,int8@1",
        help="comma-separated MODE[@THREADS]; fp32 ('none' at the default thread count) is the "
        "reference and is always included",
    )
    parser.add_argument("--prompts", type=int, default=8)
    parser.add_argument("--repeats", type=int, default=1, help="timed passes over the prompts")
    parser.add_argument("--prompt_tokens", type=int, default=64)
    parser.add_argument("--reply_tokens", type=int, default=24)
    parser.add_argument("--no_rss", action="store_true", help="skip the per-mode memory subprocesses")
    parser.add_argument(
        "--no_demo_check",
        action="store_true",
        help="skip the agreement check on the bundled trained demo model (chat/demo_model)",
    )
    parser.add_argument("--busy", type=int, default=0, help="spin N busy processes while timing (simulated contention)")
    parser.add_argument(
        "--step_split",
        action="store_true",
        help="also split one greedy decoder step's time per mode (linear layers, other operators, Python) "
        "and measure the memory read bandwidth",
    )
    parser.add_argument("--out", help="write the results as JSON here")
    parser.add_argument("--rss_probe", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    quiet_transformers()

    if args.rss_probe:
        print(json.dumps(rss_probe(args.model, args.rss_probe, args.prompt_tokens, args.reply_tokens)))
        return 0

    started = time.perf_counter()
    default_threads = torch.get_num_threads()
    variants = [parse_variant(v.strip(), default_threads) for v in args.variants.split(",") if v.strip()]
    ref_name = f"none@{default_threads}"
    if ref_name not in [v[0] for v in variants]:
        variants.insert(0, (ref_name, "none", default_threads))
    variants = list(dict.fromkeys(variants))
    modes = list(dict.fromkeys(m for _, m, _ in variants))
    header = {
        "cpu": cpu_name(),
        "cores": os.cpu_count(),
        "threads": default_threads,
        **versions(),
        "model": args.model,
        "prompts": args.prompts,
        "repeats": args.repeats,
        "prompt_tokens": args.prompt_tokens,
        "reply_tokens": args.reply_tokens,
        "loadavg_start": os.getloadavg()[0],
        "command": command_line("bench.cpu_variants", argv),
    }
    print(
        f"# {header['cpu']} ({header['cores']} CPUs), torch {header['torch']}, "
        f"transformers {header['transformers']}, load average {header['loadavg_start']:.2f}",
        flush=True,
    )

    memory = {}
    if not args.no_rss:
        for mode in modes:
            memory[mode] = run_probe(args.model, mode, args)
            print(f"memory {mode}: {memory[mode]}", flush=True)

    models = {}
    for mode in ["none"] + [m for m in modes if m != "none"]:  # fp32 first: the reference
        t0 = time.perf_counter()
        models[mode], tokenizer = load(args.model, mode)
        print(f"loaded {mode} in {time.perf_counter() - t0:.1f} s", flush=True)
    prompts = build_prompts(tokenizer, args.prompts, args.prompt_tokens)

    busy = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(args.busy)]
    try:
        samples = time_variants(variants, models, tokenizer, prompts, args.repeats, args.reply_tokens)
    finally:
        for p in busy:
            p.kill()
            p.wait()
    torch.set_num_threads(default_threads)
    print(f"timed at {time.perf_counter() - started:.0f} s", flush=True)

    ref_greedy = {s["prompt"]: s["tokens"] for s in samples[ref_name]["greedy"][: args.prompts]}  # rep 0
    results = summarize(variants, samples, ref_name, args.prompts, numerics(models, prompts, ref_greedy), memory)
    demo = None
    if not args.no_demo_check and (DEMO_DIR / "config.json").is_file():
        demo = demo_check(modes, args.prompts, args.reply_tokens)

    split = None
    if args.step_split:
        split = {"read_bandwidth_gbs": read_bandwidth_gbs()}
        for mode in modes:
            split[mode] = decoder_step_split(models[mode], prompts[0], args.reply_tokens)
        print(f"step split: {json.dumps(split)}", flush=True)

    header["loadavg_end"] = os.getloadavg()[0]
    header["wall_s"] = time.perf_counter() - started
    print()
    print(render(header, results, demo))
    if args.out:
        # indent 1: the per-sample token lists make this file long
        data = {"header": header, "results": results, "demo_check": demo, "step_split": split, "samples": samples}
        write_json(args.out, data, indent=1)
    return 0


def render(header: dict, results: list[dict], demo: dict | None) -> str:
    ref = results[0]
    h = header
    title = (
        f"{h['cpu']}, {h['cores']} CPUs, torch {h['torch']}, transformers {h['transformers']}, {h['date']}; "
        f"model {h['model']}; {h['prompts']} prompts x {h['repeats']} of {h['prompt_tokens']} tokens, replies "
        f"forced to {h['reply_tokens']} tokens; load average {h['loadavg_start']:.2f} -> {h['loadavg_end']:.2f}; "
        f"wall {h['wall_s']:.0f} s"
    )
    lines = [title, ""]
    rows = []
    for r in results:
        mem = r["memory"]
        rows.append(
            [
                r["variant"],
                f"{r['greedy_p50']:.2f} / {r['greedy_p95']:.2f}",
                f"{r['first_token_p50']:.3f} / {r['first_token_p95']:.3f}",
                f"{r['beam_p50']:.2f} / {r['beam_p95']:.2f}",
                f"{ref['greedy_p50'] / r['greedy_p50']:.1f}x / {ref['beam_p50'] / r['beam_p50']:.1f}x",
                f"{mem['rss_serving_mib']:.0f} ({mem['anon_serving_mib']:.0f}) / {mem['peak_mib']:.0f}" if mem else "-",
                f"{mem['load_s']:.1f} + {mem['optimize_s']:.1f}" if mem else "-",
                f"{r['greedy_agree']:.0%} / {r['beam_agree']:.0%}",
                f"{r['teacher_forced_top1']:.0%}",
                f"{r['logits_rel_err']:.4f}",
                f"{r['other_load']:.2f}",
            ]
        )
    lines += md_table(
        [
            "variant",
            "greedy p50 / p95 (s)",
            "1st token p50 / p95 (s)",
            "beam-10 p50 / p95 (s)",
            "speed-up greedy / beam",
            "RSS serving (anon) / peak (MiB)",
            "load + optimize (s)",
            "greedy / beam tokens = fp32",
            "TF top-1",
            "logits rel err",
            "other load (cores)",
        ],
        rows,
    )
    if demo:
        note = f"Trained demo model ({DEMO_DIR.relative_to(ROOT)}, d_model 128), natural stopping, agreement with its"
        lines += ["", note + " fp32 replies:", ""]
        lines += md_table(
            ["mode", "greedy identical replies / tokens", "beam-10 identical replies / tokens"],
            [
                [
                    mode,
                    f"{d['greedy_identical']:.0%} / {d['greedy_tokens']:.0%}",
                    f"{d['beam_identical']:.0%} / {d['beam_tokens']:.0%}",
                ]
                for mode, d in demo.items()
            ],
        )
    return "\n".join(lines)


if __name__ == "__main__":
    os.environ["CUDA_VISIBLE_DEVICES"] = ""  # a CPU study: the engine must not place the models on a GPU
    sys.exit(main())
