"""Helpers the benchmarks share: what machine and versions a result came from, percentiles,
the sample prompts, and writing results. Heavy imports stay inside the functions, so
``bench.train`` (which only launches subprocesses) starts without torch."""

from __future__ import annotations

import datetime
import importlib
import json
import platform
import subprocess
import sys
import threading
import time
from pathlib import Path

from chat.layout import SAMPLE_DIR


def cpu_name() -> str:
    """The CPU's model name as ``lscpu`` reports it (``platform`` as a fallback)."""
    try:
        out = subprocess.run(["lscpu"], capture_output=True, text=True, timeout=10, check=False).stdout
        for line in out.splitlines():
            if line.startswith("Model name:"):
                return line.split(":", 1)[1].strip()
    except (OSError, subprocess.SubprocessError):
        pass
    return platform.processor() or platform.machine() or "unknown CPU"


def device_name() -> str:
    """The first GPU's name, or the CPU's when there is none."""
    import torch

    return torch.cuda.get_device_name(0) if torch.cuda.is_available() else cpu_name()


def versions(*packages: str) -> dict[str, str]:
    """Today's date and the versions of Python, torch, transformers and ``packages``: the header
    every result records, so numbers from different runs can be told apart."""
    found = {name: importlib.import_module(name).__version__ for name in ("torch", "transformers", *packages)}
    return dict(date=datetime.date.today().isoformat(), python=platform.python_version(), **found)


def command_line(module: str, argv: list[str] | None) -> str:
    """How to rerun this benchmark: ``python -m MODULE ARGS`` (``argv`` None: the process's own)."""
    return " ".join(["python -m", module, *(sys.argv[1:] if argv is None else argv)])


def percentile(values: list[float], q: float) -> float:
    """The ``q``-th percentile (``q`` in 0..100) with linear interpolation between the two nearest
    samples: numpy's default method, and ``statistics.median`` at ``q=50``. So a p95 over 8 samples
    lies 65 % of the way from the 7th to the 8th (slowest) one."""
    if not values:
        raise ValueError("percentile of no values")
    if not 0 <= q <= 100:
        raise ValueError(f"q is a percentage in 0..100, got {q}")
    s = sorted(values)
    k = (len(s) - 1) * q / 100
    lo = int(k)
    hi = min(lo + 1, len(s) - 1)
    return s[lo] + (s[hi] - s[lo]) * (k - lo)


def closed_loop(make_stream, chats, clients: int, replies: int) -> dict:
    """``clients`` threads in a closed loop, each with its own client (``make_stream(k)`` gives client
    k's ``stream(conv, message)``, an iterator of the reply so far), sending ``chats`` in turn until
    ``replies`` replies are done: ``round_result``'s replies/s, percentiles, each reply's text, latency
    and time to its first text and the errors (a failed reply is counted, not a dead client)."""
    lock, errors = threading.Lock(), []
    texts: dict[int, str | None] = {}
    latencies: dict[int, float] = {}
    firsts: dict[int, float] = {}
    taken = iter(range(replies))

    def client(k: int) -> None:
        stream = make_stream(k)
        while True:
            with lock:
                i = next(taken, None)
            if i is None:
                return
            conv, message = chats[i % len(chats)]
            t0, first, text = time.perf_counter(), None, ""
            try:
                for text in stream(conv, message):
                    if first is None and text:
                        first = time.perf_counter() - t0
            except Exception as err:  # noqa: BLE001 - reported in the results
                with lock:
                    errors.append(f"{type(err).__name__}: {err}")
                    texts[i] = None
                continue
            with lock:
                latencies[i] = time.perf_counter() - t0
                firsts[i] = first if first is not None else latencies[i]
                texts[i] = text

    threads = [threading.Thread(target=client, args=(k,)) for k in range(clients)]
    t0 = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    wall = time.perf_counter() - t0
    per_reply = [[d.get(i) for i in range(replies)] for d in (texts, latencies, firsts)]
    return round_result(clients, wall, *per_reply, errors)


def round_result(clients: int, wall: float, texts: list, latencies: list, first_texts: list, errors: list) -> dict:
    """A closed-loop round's result from its replies (one entry each, None where it failed): replies/s
    over ``wall`` seconds, latency p50/p95 and time to the first text p50 over the replies that came."""
    done = [x for x in latencies if x is not None]
    if not done:  # nothing to measure: say why rather than fail on the percentiles
        first = errors[0] if errors else "no error recorded"
        raise RuntimeError(f"all {len(texts)} replies failed; the first: {first}")
    return {
        "clients": clients,
        "replies": len(texts),
        "replies_per_s": len(texts) / wall,
        "p50": percentile(done, 50),
        "p95": percentile(done, 95),
        "first_text_p50": percentile([x for x in first_texts if x is not None], 50),
        "texts": texts,
        "latencies": latencies,
        "first_texts": first_texts,
        "errors": errors,
    }


def cpu_seconds(pid: int | None = None, descendants: bool = False) -> float:
    """CPU time (user + system) a process has used so far: this one, or ``pid``'s (0.0 once it has
    ended), with ``descendants`` its live children's and theirs too (an app and its engine process;
    a child that ends between two readings takes its time with it). Over a round, CPU seconds per
    wall second near 1.0 in a process of many Python threads means the GIL, not the device, sets its pace."""
    if pid is None and not descendants:
        return time.process_time()
    import psutil

    def used(process) -> float:
        try:
            times = process.cpu_times()
        except psutil.NoSuchProcess:
            return 0.0
        return times.user + times.system

    try:
        process = psutil.Process(pid)
        tree = [process, *(process.children(recursive=True) if descendants else [])]
    except psutil.NoSuchProcess:
        return 0.0
    return sum(used(p) for p in tree)


def sample_rows(split: str = "validation") -> list[dict]:
    """The rows of the shipped sample data (``texts``: the source, ``labels``: the reply)."""
    lines = (SAMPLE_DIR / f"{split}.jsonl").read_text().splitlines()
    return [json.loads(line) for line in lines if line.strip()]


def quiet_transformers() -> None:
    """Errors only, no progress bars: a benchmark's stdout is its results."""
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()
    hf_logging.disable_progress_bar()


def md_table(header: list[str], rows: list[list], align: str = "") -> list[str]:
    """A markdown table as lines; ``align`` has one letter per column, ``l`` (the default) or ``r``."""
    seps = ["---:" if a == "r" else "---" for a in align.ljust(len(header), "l")]
    return ["| " + " | ".join(map(str, cells)) + " |" for cells in (header, seps, *rows)]


def write_json(path: str | Path, data: dict, indent: int = 2) -> Path:
    """Write ``data`` to ``path`` as JSON (making its folder), and return the path."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(data, indent=indent) + "\n")
    return path
