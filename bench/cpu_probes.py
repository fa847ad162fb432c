"""What the CPU study (``bench/cpu_variants.py``) measures with: the engine's decoding settings,
models loaded as the engine serves them, fixed-length prompts, timed greedy (streamed) and beam
replies with the CPU time other processes took meanwhile, teacher-forced logits, and the memory
probe that runs in a fresh subprocess per mode."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time
from dataclasses import replace

import torch

from bench.common import quiet_transformers, sample_rows
from chat.engine import BASE_PREFIX, GENERATION_PRESETS, GenerationSettings, load_checkpoint
from chat.fastgen import CACHE_KWARG
from chat.layout import ROOT
from chat.model import load_model, load_tokenizer
from chat.optimize import Int8Linear, memory_mib, optimize_for_cpu

# The study compares the model's modes, not the engine's extras: greedy is the ``fast`` preset's
# decoding without its n-gram blocking and repetition penalty (the engine's own cost, timed with
# them in docs/chat-benchmarks.md); beam-10 is the ``faithful`` preset unchanged.
GREEDY = replace(
    GENERATION_PRESETS["fast"], no_repeat_ngram_size=0, encoder_no_repeat_ngram_size=0, repetition_penalty=1.0
)
FAITHFUL = GENERATION_PRESETS["faithful"]


# ---------------------------------------------------------------------------------------------
# Setup helpers


def decoding(settings: GenerationSettings, reply_tokens: int, forced: bool = True) -> dict:
    """generate() kwargs of ``settings`` for replies of at most ``reply_tokens`` tokens, exactly as
    many when ``forced`` (random weights never emit EOS; the demo check stops naturally)."""
    settings = replace(settings, min_new_tokens=reply_tokens if forced else 0, max_new_tokens=reply_tokens)
    return settings.generate_kwargs()


def load(spec: str, mode: str):
    """``spec`` as the chat engine serves it in ``mode``: model (on the CPU) and tokenizer."""
    loaded = load_checkpoint(spec, optimize=mode)
    if loaded.model.device.type != "cpu":  # the engine serves on a GPU when it sees one
        raise SystemExit("bench.cpu_variants is a CPU study: run it with CUDA_VISIBLE_DEVICES=")
    return loaded.model, loaded.tokenizer


def build_prompts(tokenizer, n: int, length: int) -> list[torch.Tensor]:
    """``n`` prompts of exactly ``length`` tokens: BASE_PREFIX + the last tokens of a dialogue + </s>."""
    rows = sample_rows("validation")
    prefix = tokenizer(BASE_PREFIX, add_special_tokens=False).input_ids
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

    kwargs = decoding(GREEDY, reply_tokens)

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
                result["out"] = model.generate(
                    input_ids=input_ids, attention_mask=torch.ones_like(input_ids), streamer=streamer, **kwargs
                )
        except BaseException as err:  # noqa: BLE001 - re-raised in the main thread below
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
    return {
        "latency": total,
        "first_token": (streamer.first_token_at or t0 + total) - t0,
        "first_text": (first_text or t0 + total) - t0,
        "other": meter.stop(),
        "tokens": result["out"][0, 1:].tolist(),
    }


def timed_beam(model, input_ids, reply_tokens: int) -> dict:
    meter = CpuMeter().start()
    t0 = time.perf_counter()
    with torch.inference_mode():
        out = model.generate(
            input_ids=input_ids, attention_mask=torch.ones_like(input_ids), **decoding(FAITHFUL, reply_tokens)
        )
    return {"latency": time.perf_counter() - t0, "other": meter.stop(), "tokens": out[0, 1:].tolist()}


def read_bandwidth_gbs(megabytes: int = 256, repeats: int = 10) -> float:
    """Memory read bandwidth as this process sees it: GB/s of a sum over ``megabytes`` of floats
    (larger than any cache), the best of ``repeats``. A decoder step that reads every weight once
    cannot run faster than the weights' bytes over this."""
    x = torch.ones(megabytes * 2**20 // 4)
    x.sum()
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        x.sum()
        best = min(best, time.perf_counter() - t0)
    return x.numel() * 4 / best / 1e9


def decoder_step_split(model, input_ids, steps: int = 24) -> dict:
    """Where a greedy decoder step's time goes: the median wall ms of ``steps`` steps (the model's
    forward with a growing cache, as generate() calls it), and for one more step under
    torch.profiler the ms its linear layers' kernels took (``linear_ms``; quantized or not), the
    other operators' (``other_ops_ms``), the rest of the wall being Python and module calls
    (``outside_ops_ms``), and the bytes of weights a step reads."""
    from torch.profiler import ProfilerActivity, profile
    from transformers import DynamicCache, EncoderDecoderCache

    mask = torch.ones_like(input_ids)
    with torch.inference_mode():
        encoded = model.get_encoder()(input_ids=input_ids, attention_mask=mask)
        cache = EncoderDecoderCache(DynamicCache(), DynamicCache())
        token = torch.tensor([[model.config.decoder_start_token_id]])

        def step():
            out = model(encoder_outputs=encoded, attention_mask=mask, decoder_input_ids=token, **{CACHE_KWARG: cache})
            return out.logits[:, -1:].argmax(-1)

        walls = []
        for _ in range(steps):
            t0 = time.perf_counter()
            token = step()
            walls.append(time.perf_counter() - t0)
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            t0 = time.perf_counter()
            step()
            profiled_wall = time.perf_counter() - t0
    ops = [e for e in prof.key_averages() if not e.key.startswith("ProfilerStep")]
    linear = sum(e.self_cpu_time_total for e in ops if "linear" in e.key or e.key in ("aten::addmm", "aten::mm"))
    total = sum(e.self_cpu_time_total for e in ops)
    decoder = model.get_decoder()
    weights = sum(_stored_bytes(m) for m in [*decoder.layers, model.lm_head])
    return {
        "step_ms": sorted(walls)[len(walls) // 2] * 1e3,
        "profiled_step_ms": profiled_wall * 1e3,
        "linear_ms": linear / 1e3,
        "other_ops_ms": (total - linear) / 1e3,
        "outside_ops_ms": profiled_wall * 1e3 - total / 1e3,
        "weight_mb_per_step": weights / 1e6,
    }


def _stored_bytes(module) -> int:
    """Bytes of ``module``'s weights as stored (a dynamically quantized linear layer keeps its
    int8 weight packed, outside ``parameters()``)."""
    total = 0
    for sub in module.modules():
        if isinstance(sub, Int8Linear):
            total += sub.int8_bytes()  # int8: one byte each (biases and scales are small)
        total += sum(p.numel() * p.element_size() for p in sub.parameters(recurse=False))
    return total


def teacher_forced_logits(model, input_ids, decoder_ids: torch.Tensor) -> torch.Tensor:
    with torch.inference_mode():
        return model(
            input_ids=input_ids, attention_mask=torch.ones_like(input_ids), decoder_input_ids=decoder_ids
        ).logits.float()


def token_agreement(a: list[int], b: list[int]) -> float:
    n = max(len(a), len(b))
    return sum(x == y for x, y in zip(a, b)) / n if n else 1.0


# ---------------------------------------------------------------------------------------------
# Memory probe (runs in a fresh subprocess per mode)


def rss_probe(model_name: str, mode: str, prompt_tokens: int, reply_tokens: int) -> dict:
    """Memory and time of loading and optimizing, taken apart: the two steps ``load_checkpoint``
    runs on a CPU (``load_model``, then ``optimize_for_cpu``), each timed on its own."""
    quiet_transformers()
    base = memory_mib()["rss"]
    t0 = time.perf_counter()
    model = load_model(model_name)
    load_s = time.perf_counter() - t0
    after_load = memory_mib()["rss"]
    t0 = time.perf_counter()
    model = optimize_for_cpu(model, mode)
    optimize_s = time.perf_counter() - t0
    after_opt = memory_mib()["rss"]
    ids = build_prompts(load_tokenizer(model_name), 1, prompt_tokens)[0]
    with torch.inference_mode():
        for settings in (GREEDY, FAITHFUL):
            model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), **decoding(settings, reply_tokens))
    mem = memory_mib()
    return {
        "mode": mode,
        "rss_imports_mib": base,
        "rss_after_load_mib": after_load,
        "rss_after_optimize_mib": after_opt,
        "rss_serving_mib": mem["rss"],
        "anon_serving_mib": mem["anon"],
        "file_serving_mib": mem["file"],
        "peak_mib": mem["peak"],
        "load_s": load_s,
        "optimize_s": optimize_s,
    }


def run_probe(model_name: str, mode: str, args) -> dict:
    """``rss_probe`` in a fresh ``python -m bench.cpu_variants --rss_probe MODE``: the other modes'
    models and allocations must not count in this mode's RSS."""
    cmd = [sys.executable, "-m", "bench.cpu_variants", "--rss_probe", mode, "--model", model_name]
    cmd += ["--prompt_tokens", str(args.prompt_tokens), "--reply_tokens", str(args.reply_tokens)]
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])))
    proc = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT, env=env, timeout=600, check=False)
    lines = [line for line in proc.stdout.splitlines() if line.startswith("{")]
    if proc.returncode or not lines:
        raise RuntimeError(f"memory probe for {mode} failed:\n{proc.stderr[-2000:]}")
    return json.loads(lines[-1])
