"""The OpenAI-compatible API against the /chat endpoint, through the running app: ``python -m bench.api``.

Starts the app as its users do (``python app.py``: ``--model`` or CHAT_MODEL, else the 400M base
model, offline the bundled demo model), or uses one already running (``--url``, e.g. a Space),
and sends the same conversations (bench.chat's prompt set from the shipped validation data) one
at a time, alternately to gradio's ``/chat`` endpoint (gradio_client, its streamed reply) and to
``/v1/chat/completions`` (the official openai client, ``stream=True``, with the same 1 ms poll
beside it that gradio_client runs while it streams: see ``polled``), with the same preset and
settings. For each: seconds to the whole reply and to its first text, p50 and p95, the API's
p50 relative to /chat's (target: within 10 %), the median of the paired ratios (each API reply
against the /chat reply to the same prompt timed next to it: robust to a machine's changing
load), the app's CPU seconds per reply (all its threads: what a reply costs the server, whatever
else the machine runs; when the benchmark started the app) and how many replies were identical. Results go to
stdout as a markdown table and, with ``--out``, to a JSON file.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import threading
import time
import urllib.request
from contextlib import contextmanager

from bench.common import command_line, cpu_name, md_table, percentile, versions, write_json
from chat.layout import ROOT


@contextmanager
def running_app(model: str | None, timeout_s: float = 600):
    """``python app.py`` on a free port until the block ends; yields its URL."""
    from finetune.jobs.command import free_port

    port = free_port()
    env = dict(
        os.environ, GRADIO_SERVER_NAME="127.0.0.1", GRADIO_SERVER_PORT=str(port), GRADIO_ANALYTICS_ENABLED="False"
    )
    if model:
        env["CHAT_MODEL"] = model
    proc = subprocess.Popen(
        [sys.executable, "app.py"], cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
    )
    lines: list[str] = []
    threading.Thread(target=lambda: lines.extend(proc.stdout), daemon=True).start()
    url, started = f"http://127.0.0.1:{port}/", time.monotonic()
    try:
        while True:
            if proc.poll() is not None or time.monotonic() - started > timeout_s:
                raise RuntimeError("app.py did not start:\n" + "".join(lines[-30:]))
            try:
                urllib.request.urlopen(url + "config", timeout=2)
                break
            except OSError:
                time.sleep(0.5)
        yield url, lines, proc.pid
    finally:
        proc.terminate()
        proc.wait(timeout=30)


def timed(stream, app=None) -> tuple[float, float | None, str, float | None]:
    """Drain ``stream`` (the reply so far, as it grows): seconds to the whole reply and to its first
    text, the text, and the CPU seconds the app process (a ``psutil.Process``) spent meanwhile."""
    cpu = sum(app.cpu_times()[:2]) if app else None
    t0, first, text = time.perf_counter(), None, ""
    for text in stream:
        if first is None and text:
            first = time.perf_counter() - t0
    whole = time.perf_counter() - t0
    return whole, first, text, (sum(app.cpu_times()[:2]) - cpu if app else None)


# gradio_client's own iterator (``for update in job``) waits without end for a job whose end it missed:
# seen with 64 clients at once (gradio_client 2.7.2, gradio 6.31), the server idle, one job never
# FINISHED (as in gradio's issue #9968). A job without news for this long is a failed reply, counted.
STALL_S = 60.0


def chat_stream(client, conv, message: str, preset: str, settings: dict, stall_s: float = STALL_S):
    """The reply so far, as gradio streams ``/chat``'s updates (each with the id of the model writing
    it), read from the job's outputs; TimeoutError after ``stall_s`` seconds with no update."""
    job = client.submit(message, conv.kind, conv.context, preset, list(conv.turns), settings, api_name="/chat")
    seen, last = 0, time.monotonic()
    while True:
        done = job.done()  # before reading: the outputs read after it are all of them
        outputs = job.outputs()
        for reply, _ in outputs[seen:]:
            yield reply
        if len(outputs) > seen:
            seen, last = len(outputs), time.monotonic()
        if done:
            job.result()  # raises the call's error, if it failed
            return
        if time.monotonic() - last > stall_s:
            raise TimeoutError(f"/chat through gradio_client: no update for {stall_s:.0f} s ({job.status().code})")
        time.sleep(0.002)


def chat_http_stream(session, url: str, conv, message: str, preset: str, settings: dict, session_hash=None):
    """``chat_stream`` over gradio's own HTTP API with a plain HTTP client (``httpx``): POST the call,
    then read its server-sent events. What the server costs, without gradio_client's own work.

    ``session_hash``: the client's gradio session, as gradio_client and a browser tab keep one. A
    call without one is a new session, and gradio builds each new session's copy of every block's
    config in its event loop before the call runs: 23 ms for this app's 270 blocks on a 2-core Xeon,
    which bounded 64 such clients on an H100 to 21-26 replies/s (docs/chat-benchmarks.md)."""
    data = [message, conv.kind, conv.context, preset, list(conv.turns), settings, conv.model or ""]
    body = {"data": data, **({"session_hash": session_hash} if session_hash else {})}
    event = session.post(f"{url}gradio_api/call/chat", json=body).raise_for_status().json()["event_id"]
    with session.stream("GET", f"{url}gradio_api/call/chat/{event}") as reply:
        kind = None
        for line in reply.iter_lines():
            if line.startswith("event:"):
                kind = line.removeprefix("event:").strip()
            elif line.startswith("data:") and kind == "error":
                raise RuntimeError(f"/chat failed: {line.removeprefix('data:').strip()}")
            elif line.startswith("data:") and kind in ("generating", "complete"):
                out = json.loads(line.removeprefix("data:"))
                if out:
                    yield out[0]  # the reply so far (then the id of the model writing it)


def polled(stream):
    """``stream`` with a thread beside it that wakes every millisecond, as gradio_client's own
    streaming iterator does while it waits (``Job.__next__``). On a virtual machine such a poller
    keeps the CPUs from idling, which makes the app's decoding faster (measured: the 400M model's
    streamed API reply p50 10.4 -> 6.4 s with it, and /chat through ``predict``, which does not
    poll, 8.3 s against 3.7 s streamed): timing the API without it would compare clients."""
    stop = threading.Event()

    def poll():
        while not stop.is_set():
            time.sleep(0.001)

    thread = threading.Thread(target=poll, daemon=True)
    thread.start()
    try:
        yield from stream
    finally:
        stop.set()
        thread.join()


def api_stream(client, model: str, conv, message: str, preset: str, settings: dict):
    system = [{"role": "system", "content": conv.context}] if conv.context else []
    roles = ["user", "assistant"] * len(conv.turns)
    turns = [{"role": r, "content": t} for r, t in zip(roles[-len(conv.turns) :], conv.turns, strict=True)]
    stream = client.chat.completions.create(
        model=model,
        messages=[*system, *turns, {"role": "user", "content": message}],
        stream=True,
        max_tokens=settings["max_new_tokens"],
        extra_body={"kind": conv.kind, "preset": preset},
    )
    text = ""
    for chunk in stream:
        if chunk.choices and chunk.choices[0].delta.content:
            text += chunk.choices[0].delta.content
            yield text


def summary(runs: list[tuple[float, float | None, str, float | None]]) -> dict:
    whole = [w for w, _, _, _ in runs]
    firsts = [f for _, f, _, _ in runs if f is not None]
    cpu = [c for *_, c in runs if c is not None]
    return {
        "p50": percentile(whole, 50),
        "p95": percentile(whole, 95),
        "first_text_p50": percentile(firsts, 50) if firsts else None,
        "app_cpu_p50": percentile(cpu, 50) if cpu else None,
        "seconds": whole,
        "app_cpu_seconds": cpu,
        "replies": [t for _, _, t, _ in runs],
    }


def measure(url: str, preset: str, prompts, repeats: int, warmup: int, max_tokens: int, pid: int | None = None) -> dict:
    import openai
    import psutil
    from gradio_client import Client

    app = psutil.Process(pid) if pid else None
    chat = Client(url, verbose=False)
    api = openai.OpenAI(base_url=url + "v1", api_key=os.environ.get("PERSONA_CHAT_API_KEY", "unused"))
    model = api.models.list().data[0].id
    settings = {"max_new_tokens": max_tokens}
    runs = {"chat": [], "api": []}
    calls = {
        "chat": lambda conv, m: chat_stream(chat, conv, m, preset, settings),
        "api": lambda conv, m: polled(api_stream(api, model, conv, m, preset, settings)),
    }
    for conv, message in prompts[:warmup]:
        for name in calls:
            timed(calls[name](conv, message))
    for r in range(repeats):
        for i, (conv, message) in enumerate(prompts):
            order = ("chat", "api") if (i + r) % 2 == 0 else ("api", "chat")  # neither always goes first
            for name in order:
                runs[name].append(timed(calls[name](conv, message), app))
    chat_s, api_s = summary(runs["chat"]), summary(runs["api"])
    same = sum(a == b for a, b in zip(chat_s["replies"], api_s["replies"], strict=True))
    # Each API reply against the /chat reply to the same prompt, timed just before or after it: on a
    # shared machine this pairing cancels the load that drifts over a run.
    paired = percentile([a / c for a, c in zip(api_s["seconds"], chat_s["seconds"], strict=True)], 50)
    return {
        "model": model,
        "preset": preset,
        "chat": chat_s,
        "api": api_s,
        "same_replies": same,
        "paired_ratio_p50": paired,
    }


def table(result: dict) -> str:
    rows = []
    for name, label in (("chat", "/chat (gradio_client, streamed)"), ("api", "/v1/chat/completions (openai, stream)")):
        r = result[name]
        first = "–" if r["first_text_p50"] is None else f"{r['first_text_p50']:.3f} s"
        cpu = "–" if r["app_cpu_p50"] is None else f"{r['app_cpu_p50']:.3f} s"
        ratio = r["p50"] / result["chat"]["p50"]
        rows.append([label, f"{r['p50']:.3f} s ({ratio:.2f}x)", f"{r['p95']:.3f} s", first, cpu, len(r["seconds"])])
    header = ["endpoint", "p50 (vs /chat)", "p95", "first text p50", "app CPU p50", "replies"]
    return "\n".join(md_table(header, rows, "lrrrrr"))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.api", description=__doc__.splitlines()[0])
    parser.add_argument("--url", help="an app already running (default: start python app.py)")
    parser.add_argument("--model", help="the app's CHAT_MODEL (default: the app's own choice)")
    parser.add_argument("--preset", default="fast", choices=["fast", "faithful"])
    parser.add_argument("--prompts", type=int, default=8)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--warmup", type=int, default=2, help="prompts sent to both first, untimed")
    parser.add_argument("--max_tokens", type=int, default=40)
    parser.add_argument("--out", help="write the results as JSON here")
    args = parser.parse_args(argv)
    from bench.chat import prompt_set  # (torch: not for bench.serve_clients' processes, which import this module)

    prompts = prompt_set(args.prompts)
    if args.url:
        result, log = measure(args.url, args.preset, prompts, args.repeats, args.warmup, args.max_tokens), []
    else:
        with running_app(args.model) as (url, log, pid):
            result = measure(url, args.preset, prompts, args.repeats, args.warmup, args.max_tokens, pid)
    serving = next((line.split(": ", 1)[-1].strip() for line in log if " app: " in line), "")
    env = versions("gradio", "openai")
    header = (
        f"{result['model']} ({serving or args.url}), preset {args.preset}, up to {args.max_tokens} tokens, "
        f"{len(prompts)} prompts x {args.repeats}, {cpu_name()}, {os.cpu_count()} CPUs, {env['date']}"
    )
    print(header)
    print(table(result))
    print(
        f"API / chat p50: {result['api']['p50'] / result['chat']['p50']:.2f}; median of the paired ratios "
        f"(each API reply / the /chat reply to the same prompt next to it): {result['paired_ratio_p50']:.2f}; "
        f"same reply from both: {result['same_replies']}/{len(result['api']['replies'])}"
    )
    if args.out:
        data = {"header": header, "command": command_line("bench.api", argv), "environment": env, "result": result}
        write_json(args.out, data)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
