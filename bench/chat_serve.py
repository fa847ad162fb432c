"""The chat under load through the running app: ``python -m bench.chat_serve``.

Starts the app as its users do (``python app.py``, ``--model`` as its CHAT_MODEL; offline the
bundled demo model) or uses one already running (``--url``), and for each concurrency N drives it
with N clients at once, each sending its next message when its last reply ended (closed loop): on
gradio's ``/chat`` endpoint (gradio_client, streamed; and with a plain HTTP client on gradio's
HTTP API, which tells the server's cost from gradio_client's) and on the OpenAI-compatible
``/v1/chat/completions`` (the official openai client, ``stream=True``), against the same chats on
the engine alone in this process (same model, same default scheduler) in the same run. For each:
replies/s, reply latency p50/p95, time to the first text p50, and the CPU time per reply of the
app's process (its server and engine) and of the clients (for the engine alone, its engine).

The clients through the server run in processes of their own, ``--clients_per_process`` to each
(the engine alone's in this process, beside the engine): 64 streaming clients in one Python process
spent 150-220 ms of CPU a reply on an H100's host, against 3-5 ms for one, and so measured their own
GIL rather than the server.

The API gives one client address a bounded share of its capacity (``api.access``), so the app is
started as if behind a proxy (``PERSONA_CHAT_BEHIND_PROXY=1``) and each API client names its own
address in ``X-Forwarded-For``, as a proxy would for N different visitors.
"""

from __future__ import annotations

import argparse
import os
from dataclasses import replace

from bench.api import running_app
from bench.common import closed_loop, command_line, cpu_name, cpu_seconds, md_table, versions, write_json
from bench.serve_clients import paths, server_round
from chat.layout import DEMO_DIR

# torch and the chat engine are imported inside the functions: the client processes (spawned) import
# this module again as their __main__, and eight of them importing torch at once on the H100's host
# took minutes.


def engine_round(engine, preset: str, max_tokens: int, chats, clients: int, replies: int) -> dict:
    """The same chats on the engine alone (a ``ChatEngine``), its clients threads of this process."""
    from chat.engine import GENERATION_PRESETS

    settings = replace(GENERATION_PRESETS[preset], max_new_tokens=max_tokens)

    def engine_client(k: int):
        return lambda conv, message: (text for text, _ in engine.stream(conv, message, settings))

    cpu = cpu_seconds()
    round_ = closed_loop(engine_client, chats, clients, replies)
    return {**round_, "client_processes": 0, "bench_cpu_per_reply": (cpu_seconds() - cpu) / replies}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.chat_serve", description=__doc__.splitlines()[0])
    parser.add_argument("--url", help="an app already running (default: start python app.py)")
    parser.add_argument("--model", help="the app's CHAT_MODEL and the engine's model (default: the demo model)")
    parser.add_argument("--optimize", help="the engine's CPU mode (default: as the app's, CHAT_OPTIMIZE or int8)")
    parser.add_argument("--preset", default="fast", choices=["fast", "faithful"])
    parser.add_argument("--concurrency", default="1,8")
    parser.add_argument("--replies", type=int, default=16, help="replies per round (at least the clients)")
    parser.add_argument("--max_tokens", type=int, default=24)
    parser.add_argument("--prompts", type=int, default=8)
    parser.add_argument("--clients_per_process", type=int, default=8, help="clients through the server to a process")
    parser.add_argument("--app_pid", type=int, help="with --url: the app's process, to read its CPU time")
    parser.add_argument("--out", help="write the results as JSON here")
    args = parser.parse_args(argv)
    if args.clients_per_process < 1:
        parser.error("--clients_per_process must be 1 or more")
    if args.app_pid is not None:  # else its CPU would read as 0.0, a wrong number rather than none
        import psutil

        if not args.url:
            parser.error("--app_pid is for an app started apart (--url); the app this starts is read anyway")
        if not psutil.pid_exists(args.app_pid):
            parser.error(f"--app_pid {args.app_pid}: no such process")
    from bench.chat import prompt_set
    from bench.common import quiet_transformers
    from chat.engine import ChatEngine, load_apart

    quiet_transformers()
    spec = args.model or str(DEMO_DIR)
    engine = ChatEngine(load_apart(spec, optimize=args.optimize), "bench")
    chats = prompt_set(args.prompts)
    os.environ["PERSONA_CHAT_BEHIND_PROXY"] = "1"  # see the module docstring
    if args.optimize:
        os.environ["CHAT_OPTIMIZE"] = args.optimize  # the app's engine as this one
    results = []
    with running_app(spec) if not args.url else _given(args.url) as (url, _log, pid):
        pid = pid or args.app_pid  # (None: an app not ours, its CPU not read)
        names = list(paths(url, args.preset, args.max_tokens, []))  # (and the API answers)
        engine_round(engine, args.preset, args.max_tokens, chats, 2, 2)  # warm up every path
        for name in names:
            server_round(url, name, args.preset, args.max_tokens, chats, 2, 2, args.clients_per_process)
        for clients in [int(c) for c in args.concurrency.split(",")]:
            for name in ["engine alone", *names]:
                replies = max(args.replies, clients)
                app_cpu = None if pid is None else cpu_seconds(pid, descendants=True)
                if name == "engine alone":
                    round_ = engine_round(engine, args.preset, args.max_tokens, chats, clients, replies)
                else:
                    per = args.clients_per_process
                    round_ = server_round(url, name, args.preset, args.max_tokens, chats, clients, replies, per)
                app_cpu = None if pid is None else (cpu_seconds(pid, descendants=True) - app_cpu) / replies
                results.append({"path": name, **round_, "app_cpu_per_reply": app_cpu})
                # Each round as it ends (and the JSON so far): a run stopped at a time limit keeps them.
                print(f"{name}, {clients} clients: {round_['replies_per_s']:.2f} replies/s, p95 {round_['p95']:.3f} s")
                if args.out:
                    write_json(args.out, {"command": command_line("bench.chat_serve", argv), "results": results})
    env = versions("gradio", "openai")
    header = (
        f"{engine.current.id}, preset {args.preset}, up to {args.max_tokens} tokens, "
        f"{cpu_name()}, {os.cpu_count()} CPUs, {env['date']}"
    )
    rows = []
    for r in results:
        alone = next(b for b in results if b["clients"] == r["clients"] and b["path"] == "engine alone")
        rows.append(
            [
                r["path"],
                str(r["clients"]),
                f"{r['replies_per_s']:.2f} ({r['replies_per_s'] / alone['replies_per_s']:.2f}x)",
                f"{r['p50']:.3f} s",
                f"{r['p95']:.3f} s",
                f"{r['first_text_p50']:.3f} s",
                "" if r["app_cpu_per_reply"] is None else f"{r['app_cpu_per_reply'] * 1e3:.1f} ms",
                f"{r['bench_cpu_per_reply'] * 1e3:.1f} ms ({r['client_processes']})",
                str(len(r["errors"])),
            ]
        )
    print(header)
    columns = ["path", "clients", "replies/s (vs engine)", "p50", "p95", "first text p50", "app CPU/reply"]
    print("\n".join(md_table([*columns, "bench CPU/reply (processes)", "errors"], rows)))
    if args.out:
        write_json(args.out, {"header": header, "command": command_line("bench.chat_serve", argv), "results": results})
    return 0


class _given:
    """``running_app``'s shape for an app already running at ``url``."""

    def __init__(self, url: str):
        self.url = url if url.endswith("/") else url + "/"

    def __enter__(self):
        return self.url, [], None

    def __exit__(self, *exc):
        return False


if __name__ == "__main__":
    raise SystemExit(main())
