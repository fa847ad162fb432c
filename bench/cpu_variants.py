"""Compare the CPU optimizations of ``chat.optimize`` in one process: latency, streaming, memory, numerics.

    PERSONA_CHAT_CACHE=/tmp/pcache2 python -m bench.cpu_variants            # ~3-5 min on 2 cores
    python -m bench.cpu_variants --variants none,int8 --prompts 4 --out bench.json

For each variant (a mode of ``optimize_for_cpu``, optionally ``@THREADS``, e.g. ``int8@1``) and a
fixed set of 64-token prompts ("chatbot: " + the most recent text of sample validation
dialogues), it measures

* greedy, streamed through ``TextIteratorStreamer`` in a thread (how the ``fast`` preset serves):
  total latency, time to the first generated token reaching the streamer, and (in ``--out`` only)
  time to the first non-empty text chunk, which on random weights is meaningless: most of the
  model's 8008 ids are outside the preset tokenizer's 1934 and decode to nothing;
* beam-10 with the ``faithful`` settings (no_repeat_ngram_size 3, encoder_no_repeat_ngram_size 3,
  repetition_penalty 1.2, length_penalty 1.0);
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
"""

from __future__ import annotations

import argparse
import copy
import datetime
import json
import os
import platform
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path

import torch

from chat.optimize import OPTIMIZE_MODES, memory_mib, optimize_for_cpu

ROOT = Path(__file__).resolve().parent.parent
SAMPLE = ROOT / "data" / "sample" / "validation.jsonl"
DEMO_DIR = ROOT / "chat" / "demo_model"
PREFIX = "chatbot: "
FAITHFUL = dict(num_beams=10, no_repeat_ngram_size=3, encoder_no_repeat_ngram_size=3, repetition_penalty=1.2,
                length_penalty=1.0, do_sample=False)
GREEDY = dict(num_beams=1, do_sample=False)


# ---------------------------------------------------------------------------------------------
# Setup helpers


def quiet_transformers() -> None:
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()
    hf_logging.disable_progress_bar()


def cpu_name() -> str:
    try:
        out = subprocess.run(["lscpu"], capture_output=True, text=True, timeout=10).stdout
        for line in out.splitlines():
            if line.startswith("Model name:"):
                return line.split(":", 1)[1].strip()
    except (OSError, subprocess.SubprocessError):
        pass
    return platform.processor() or "unknown CPU"


def chat_generation_config(model):
    """Only the token ids of the saved generation config (as the chat engine does): no length clash."""
    from transformers import GenerationConfig

    saved = model.generation_config
    return GenerationConfig(decoder_start_token_id=saved.decoder_start_token_id, bos_token_id=saved.bos_token_id,
                            eos_token_id=saved.eos_token_id, pad_token_id=saved.pad_token_id,
                            forced_eos_token_id=saved.forced_eos_token_id)


def load(model_name: str, mode: str | None = None, num_threads: int | None = None):
    from chat.model import load_model

    model = load_model(model_name).eval()
    model.generation_config = chat_generation_config(model)
    if mode is not None:
        model = optimize_for_cpu(model, mode, num_threads=num_threads)
    return model


def build_prompts(tokenizer, n: int, length: int) -> list[torch.Tensor]:
    """``n`` prompts of exactly ``length`` tokens: PREFIX + the last tokens of a dialogue + </s>."""
    rows = [json.loads(line) for line in SAMPLE.read_text().splitlines() if line.strip()]
    prefix = tokenizer(PREFIX, add_special_tokens=False).input_ids
    body_len = length - len(prefix) - 1
    if body_len < 1:
        raise ValueError(f"prompt length {length} leaves no room after the prefix")
    bodies = [tokenizer(r["texts"], add_special_tokens=False).input_ids for r in rows]
    long_enough = [b for b in bodies if len(b) >= body_len]
    if len(long_enough) < n:  # pad short dialogues with the next rows' text
        long_enough = []
        for i, body in enumerate(bodies):
            j = i
            while len(body) < body_len:
                j = (j + 1) % len(bodies)
                body = body + bodies[j]
            long_enough.append(body)
    picks = [long_enough[round(i * (len(long_enough) - 1) / max(n - 1, 1))] for i in range(n)]
    eos = tokenizer.eos_token_id
    return [torch.tensor([prefix + body[-body_len:] + [eos]]) for body in picks]


# ---------------------------------------------------------------------------------------------
# Measuring


class CpuMeter:
    """CPU time used by *other* processes (in cores) between ``start()`` and ``stop()``."""

    TICK = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100

    @staticmethod
    def _read() -> tuple[float, float, float]:
        try:
            with open("/proc/stat") as fh:
                vals = [int(v) for v in fh.readline().split()[1:]]
            busy = sum(vals) - vals[3] - (vals[4] if len(vals) > 4 else 0)  # minus idle, iowait
            with open("/proc/self/stat") as fh:
                fields = fh.read().rsplit(")", 1)[1].split()
            own = int(fields[11]) + int(fields[12])  # utime + stime (all threads)
            return busy, own, time.perf_counter()
        except (OSError, ValueError, IndexError):
            return 0, 0, time.perf_counter()

    def start(self):
        self._t0 = self._read()
        return self

    def stop(self) -> float:
        busy, own, t = self._read()
        busy0, own0, t0 = self._t0
        return max(0.0, ((busy - busy0) - (own - own0)) / self.TICK / max(t - t0, 1e-6))


def timed_stream(model, tokenizer, input_ids, reply_tokens: int) -> dict:
    """Greedy through TextIteratorStreamer in a thread, as a streaming server does."""
    from transformers import TextIteratorStreamer

    class Streamer(TextIteratorStreamer):
        first_token_at = None

        def put(self, value):
            if self.first_token_at is None and not self.next_tokens_are_prompt:
                self.first_token_at = time.perf_counter()
            super().put(value)

    streamer = Streamer(tokenizer, skip_prompt=True, skip_special_tokens=True, timeout=600)
    result: dict = {}

    def target():
        try:
            with torch.inference_mode():
                result["out"] = model.generate(input_ids=input_ids, attention_mask=torch.ones_like(input_ids),
                                               min_new_tokens=reply_tokens, max_new_tokens=reply_tokens,
                                               streamer=streamer, **GREEDY)
        except BaseException as err:  # surface it in the main thread
            result["err"] = err
            streamer.end()

    meter = CpuMeter().start()
    t0 = time.perf_counter()
    thread = threading.Thread(target=target, daemon=True)
    thread.start()
    first_text = None
    for chunk in streamer:
        if chunk and first_text is None:
            first_text = time.perf_counter()
    thread.join()
    total = time.perf_counter() - t0
    if "err" in result:
        raise result["err"]
    return dict(latency=total, first_token=(streamer.first_token_at or t0 + total) - t0,
                first_text=(first_text or t0 + total) - t0, other=meter.stop(),
                tokens=result["out"][0, 1:].tolist())


def timed_beam(model, input_ids, reply_tokens: int) -> dict:
    meter = CpuMeter().start()
    t0 = time.perf_counter()
    with torch.inference_mode():
        out = model.generate(input_ids=input_ids, attention_mask=torch.ones_like(input_ids),
                             min_new_tokens=reply_tokens, max_new_tokens=reply_tokens, **FAITHFUL)
    return dict(latency=time.perf_counter() - t0, other=meter.stop(), tokens=out[0, 1:].tolist())


def teacher_forced_logits(model, input_ids, decoder_ids: torch.Tensor) -> torch.Tensor:
    with torch.inference_mode():
        return model(input_ids=input_ids, attention_mask=torch.ones_like(input_ids),
                     decoder_input_ids=decoder_ids).logits.float()


def pct(values: list[float], q: float) -> float:
    """Percentile with linear interpolation (q in 0..100)."""
    s = sorted(values)
    if len(s) == 1:
        return s[0]
    k = (len(s) - 1) * q / 100
    lo = int(k)
    hi = min(lo + 1, len(s) - 1)
    return s[lo] + (s[hi] - s[lo]) * (k - lo)


def token_agreement(a: list[int], b: list[int]) -> float:
    n = max(len(a), len(b))
    return sum(x == y for x, y in zip(a, b)) / n if n else 1.0


# ---------------------------------------------------------------------------------------------
# Memory probe (runs in a fresh subprocess per mode)


def rss_probe(model_name: str, mode: str, prompt_tokens: int, reply_tokens: int) -> dict:
    from chat.model import load_tokenizer

    quiet_transformers()
    base = memory_mib()["rss"]
    t0 = time.perf_counter()
    model = load(model_name)
    load_s = time.perf_counter() - t0
    after_load = memory_mib()["rss"]
    t0 = time.perf_counter()
    model = optimize_for_cpu(model, mode)
    optimize_s = time.perf_counter() - t0
    after_opt = memory_mib()["rss"]
    ids = build_prompts(load_tokenizer(model_name), 1, prompt_tokens)[0]
    with torch.inference_mode():
        for kw in (GREEDY, FAITHFUL):
            model.generate(input_ids=ids, min_new_tokens=reply_tokens, max_new_tokens=reply_tokens, **kw)
    mem = memory_mib()
    return dict(mode=mode, rss_imports_mib=base, rss_after_load_mib=after_load, rss_after_optimize_mib=after_opt,
                rss_serving_mib=mem["rss"], anon_serving_mib=mem["anon"], file_serving_mib=mem["file"],
                peak_mib=mem["peak"], load_s=load_s, optimize_s=optimize_s)


def run_probe(model_name: str, mode: str, args) -> dict:
    cmd = [sys.executable, "-m", "bench.cpu_variants", "--rss_probe", mode, "--model", model_name,
           "--prompt_tokens", str(args.prompt_tokens), "--reply_tokens", str(args.reply_tokens)]
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])))
    proc = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT, env=env, timeout=600)
    lines = [line for line in proc.stdout.splitlines() if line.startswith("{")]
    if proc.returncode or not lines:
        raise RuntimeError(f"memory probe for {mode} failed:\n{proc.stderr[-2000:]}")
    return json.loads(lines[-1])


# ---------------------------------------------------------------------------------------------
# Demo-model check: agreement with fp32 on real (tiny, trained) weights, natural stopping


def demo_check(modes: list[str], n_prompts: int, reply_tokens: int) -> dict:
    from chat.model import load_tokenizer

    tok = load_tokenizer(str(DEMO_DIR))
    prompts = build_prompts(tok, n_prompts, 64)
    outs: dict[str, dict[str, list[list[int]]]] = {}
    for mode in ["none"] + [m for m in modes if m != "none"]:
        model = load(str(DEMO_DIR), mode)
        res = outs[mode] = {"greedy": [], "beam": []}
        with torch.inference_mode():
            for ids in prompts:
                for key, kw in (("greedy", GREEDY), ("beam", FAITHFUL)):
                    out = model.generate(input_ids=ids, max_new_tokens=reply_tokens, **kw)
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


def parse_variant(spec: str, default_threads: int) -> tuple[str, str, int]:
    mode, _, threads = spec.partition("@")
    if mode not in OPTIMIZE_MODES:
        raise SystemExit(f"unknown mode {mode!r} in {spec!r}: expected one of {', '.join(OPTIMIZE_MODES)}")
    n = int(threads) if threads else default_threads
    return (f"{mode}@{n}", mode, n)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="random-400M", help="preset name or model directory")
    parser.add_argument("--variants", default="none,bf16,int8,int8@1",
                        help="comma-separated MODE[@THREADS]; fp32 ('none' at the default thread count) is the "
                             "reference and is always included")
    parser.add_argument("--prompts", type=int, default=8)
    parser.add_argument("--repeats", type=int, default=1, help="timed passes over the prompts")
    parser.add_argument("--prompt_tokens", type=int, default=64)
    parser.add_argument("--reply_tokens", type=int, default=24)
    parser.add_argument("--no_rss", action="store_true", help="skip the per-mode memory subprocesses")
    parser.add_argument("--no_demo_check", action="store_true",
                        help="skip the agreement check on the bundled trained demo model (chat/demo_model)")
    parser.add_argument("--busy", type=int, default=0, help="spin N busy processes while timing (simulated contention)")
    parser.add_argument("--out", help="write the results as JSON here")
    parser.add_argument("--rss_probe", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    quiet_transformers()

    if args.rss_probe:
        print(json.dumps(rss_probe(args.model, args.rss_probe, args.prompt_tokens, args.reply_tokens)))
        return 0

    from chat.model import load_tokenizer

    started = time.perf_counter()
    default_threads = torch.get_num_threads()
    variants = [parse_variant(v.strip(), default_threads) for v in args.variants.split(",") if v.strip()]
    ref_name = f"none@{default_threads}"
    if ref_name not in [v[0] for v in variants]:
        variants.insert(0, (ref_name, "none", default_threads))
    variants = list(dict.fromkeys(variants))
    modes = list(dict.fromkeys(m for _, m, _ in variants))
    header = dict(cpu=cpu_name(), cores=os.cpu_count(), torch=torch.__version__, threads=default_threads,
                  transformers=__import__("transformers").__version__, python=platform.python_version(),
                  model=args.model, prompts=args.prompts, repeats=args.repeats, prompt_tokens=args.prompt_tokens,
                  reply_tokens=args.reply_tokens, date=datetime.date.today().isoformat(),
                  loadavg_start=os.getloadavg()[0],
                  command="python -m bench.cpu_variants " + " ".join(argv if argv is not None else sys.argv[1:]))
    print(f"# {header['cpu']} ({header['cores']} CPUs), torch {header['torch']}, "
          f"transformers {header['transformers']}, load average {header['loadavg_start']:.2f}", flush=True)

    memory = {}
    if not args.no_rss:
        for mode in modes:
            memory[mode] = run_probe(args.model, mode, args)
            print(f"memory {mode}: {memory[mode]}", flush=True)

    tokenizer = load_tokenizer(args.model)
    prompts = build_prompts(tokenizer, args.prompts, args.prompt_tokens)
    base = load(args.model)
    models = {}
    for mode in modes:
        t0 = time.perf_counter()
        models[mode] = base if mode == "none" else optimize_for_cpu(copy.deepcopy(base), mode)
        print(f"prepared {mode} in {time.perf_counter() - t0:.1f} s", flush=True)

    busy = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(args.busy)]
    try:
        for name, mode, threads in variants:  # warm-up: oneDNN/fbgemm primitives for every shape
            torch.set_num_threads(threads)
            timed_stream(models[mode], tokenizer, prompts[0], args.reply_tokens)
            timed_beam(models[mode], prompts[0], args.reply_tokens)
        print(f"warmed up at {time.perf_counter() - started:.0f} s", flush=True)
        samples = {name: {"greedy": [], "beam": []} for name, _, _ in variants}
        for kind in ("greedy", "beam"):
            for rep in range(args.repeats):
                for i, ids in enumerate(prompts):
                    r = (i + rep) % len(variants)
                    for name, mode, threads in variants[r:] + variants[:r]:
                        torch.set_num_threads(threads)
                        if kind == "greedy":
                            s = timed_stream(models[mode], tokenizer, ids, args.reply_tokens)
                        else:
                            s = timed_beam(models[mode], ids, args.reply_tokens)
                        s["prompt"] = i
                        samples[name][kind].append(s)
            print(f"{kind} done at {time.perf_counter() - started:.0f} s", flush=True)
    finally:
        for p in busy:
            p.kill()
            p.wait()
    torch.set_num_threads(default_threads)

    # Numerics against fp32: teacher-forced on fp32's greedy replies (rep 0).
    ref_greedy = {s["prompt"]: s["tokens"] for s in samples[ref_name]["greedy"][: args.prompts]}
    ref_beam = {s["prompt"]: s["tokens"] for s in samples[ref_name]["beam"][: args.prompts]}
    ref_logits = {}
    numerics = {}
    for mode in modes:
        rel, top1 = [], []
        for i, ids in enumerate(prompts):
            dec = torch.tensor([[base.generation_config.decoder_start_token_id] + ref_greedy[i][:-1]])
            logits = teacher_forced_logits(models[mode], ids, dec)
            if mode == "none":
                ref_logits[i] = logits
            ref = ref_logits[i]
            rel.append(((logits - ref).norm() / ref.norm()).item())
            top1.append((logits.argmax(-1) == ref.argmax(-1)).float().mean().item())
        numerics[mode] = dict(logits_rel_err=statistics.mean(rel), teacher_forced_top1=statistics.mean(top1))

    results = []
    for name, mode, threads in variants:
        g, b = samples[name]["greedy"], samples[name]["beam"]
        row = dict(variant=name, mode=mode, threads=threads,
                   greedy_p50=pct([s["latency"] for s in g], 50), greedy_p95=pct([s["latency"] for s in g], 95),
                   first_token_p50=pct([s["first_token"] for s in g], 50),
                   first_token_p95=pct([s["first_token"] for s in g], 95),
                   first_text_p50=pct([s["first_text"] for s in g], 50),
                   beam_p50=pct([s["latency"] for s in b], 50), beam_p95=pct([s["latency"] for s in b], 95),
                   other_load=statistics.mean(s["other"] for s in g + b),
                   greedy_agree=statistics.mean(token_agreement(s["tokens"], ref_greedy[s["prompt"]]) for s in g),
                   beam_agree=statistics.mean(token_agreement(s["tokens"], ref_beam[s["prompt"]]) for s in b),
                   **numerics[mode], memory=memory.get(mode))
        results.append(row)

    demo = None
    if not args.no_demo_check and (DEMO_DIR / "config.json").is_file():
        demo = demo_check(modes, args.prompts, args.reply_tokens)

    header["loadavg_end"] = os.getloadavg()[0]
    header["wall_s"] = time.perf_counter() - started
    print()
    print(render(header, results, demo))
    if args.out:
        Path(args.out).write_text(json.dumps(dict(header=header, results=results, demo_check=demo,
                                                  samples=samples), indent=1))
    return 0


def render(header: dict, results: list[dict], demo: dict | None) -> str:
    ref = results[0]
    lines = [
        f"{header['cpu']}, {header['cores']} CPUs, torch {header['torch']}, transformers {header['transformers']}, "
        f"{header['date']}; model {header['model']}; {header['prompts']} prompts x {header['repeats']} of "
        f"{header['prompt_tokens']} tokens, replies forced to {header['reply_tokens']} tokens; "
        f"load average {header['loadavg_start']:.2f} -> {header['loadavg_end']:.2f}; wall {header['wall_s']:.0f} s",
        "",
        "| variant | greedy p50 / p95 (s) | 1st token p50 / p95 (s) | beam-10 p50 / p95 (s) "
        "| speed-up greedy / beam | RSS serving (anon) / peak (MiB) | load + optimize (s) "
        "| greedy / beam tokens = fp32 "
        "| TF top-1 | logits rel err | other load (cores) |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in results:
        mem = r["memory"]
        mem_s = f"{mem['rss_serving_mib']:.0f} ({mem['anon_serving_mib']:.0f}) / {mem['peak_mib']:.0f}" if mem else "-"
        load_s = f"{mem['load_s']:.1f} + {mem['optimize_s']:.1f}" if mem else "-"
        lines.append(
            f"| {r['variant']} | {r['greedy_p50']:.2f} / {r['greedy_p95']:.2f} | {r['first_token_p50']:.3f} / "
            f"{r['first_token_p95']:.3f} | {r['beam_p50']:.2f} / {r['beam_p95']:.2f} | "
            f"{ref['greedy_p50'] / r['greedy_p50']:.1f}x / {ref['beam_p50'] / r['beam_p50']:.1f}x | {mem_s} | "
            f"{load_s} | "
            f"{r['greedy_agree']:.0%} / {r['beam_agree']:.0%} | {r['teacher_forced_top1']:.0%} | "
            f"{r['logits_rel_err']:.4f} | {r['other_load']:.2f} |"
        )
    if demo:
        lines += ["", "Trained demo model (chat/demo_model, d_model 128), natural stopping, "
                  "agreement with its fp32 replies:", "",
                  "| mode | greedy identical replies / tokens | beam-10 identical replies / tokens |", "|---|---|---|"]
        for mode, d in demo.items():
            lines.append(f"| {mode} | {d['greedy_identical']:.0%} / {d['greedy_tokens']:.0%} | "
                         f"{d['beam_identical']:.0%} / {d['beam_tokens']:.0%} |")
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
