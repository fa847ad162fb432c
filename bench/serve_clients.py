"""Clients of the running app in processes of their own, for ``bench.chat_serve``.

One Python process of 64 streaming clients spent 150-220 ms of CPU a reply on an H100's host (3-5 ms
with one client) and so measured its own GIL rather than the server: ``server_round`` spreads a round's
clients over spawned processes, starts them together and merges their replies into one round. This
module imports neither torch nor the chat engine, so each of those processes starts in about a second;
the chats travel as plain fields.
"""

from __future__ import annotations

import dataclasses
import math
import multiprocessing
import os
import time
import traceback
import uuid
from types import SimpleNamespace

from bench.api import api_stream, chat_http_stream, chat_stream
from bench.common import closed_loop, cpu_seconds, round_result


def paths(url: str, preset: str, max_tokens: int, opened: list) -> dict:
    """The ways through the server, name -> (k -> client k's stream function); the gradio_clients made
    go to ``opened`` (each keeps threads of its own running until closed: 64 of them left open slowed
    the next rounds' clients)."""
    import httpx
    import openai
    from gradio_client import Client

    asked = {"max_new_tokens": max_tokens}  # /chat's and the API's settings
    model = openai.OpenAI(base_url=url + "v1", api_key="unused").models.list().data[0].id

    def chat_client(k: int):
        client = Client(url, verbose=False)
        opened.append(client)
        return lambda conv, message: chat_stream(client, conv, message, preset, asked)

    def chat_http_client(k: int):
        session, hash_ = httpx.Client(timeout=600), uuid.uuid4().hex  # one gradio session per client
        return lambda conv, message: chat_http_stream(session, url, conv, message, preset, asked, hash_)

    def api_client(k: int):
        key = os.environ.get("PERSONA_CHAT_API_KEY", "unused")
        headers = {"X-Forwarded-For": address(k)}
        client = openai.OpenAI(base_url=url + "v1", api_key=key, default_headers=headers)
        return lambda conv, message: api_stream(client, model, conv, message, preset, asked)

    return {"/chat (HTTP, httpx)": chat_http_client, "/v1 (openai)": api_client, "/chat (gradio_client)": chat_client}


def server_round(url, name, preset, max_tokens, chats, clients: int, replies: int, per_process: int) -> dict:
    """``clients`` clients of path ``name`` in closed loops, ``per_process`` to a spawned process, all
    starting together: the replies split between the processes as the clients are, each process's
    prompts where its share of the replies begins, so reply i is the same chat as in one process."""
    ctx = multiprocessing.get_context("spawn")
    shares = plan(clients, replies, per_process)
    n = len(shares)
    plain = [(dataclasses.asdict(conv), message) for conv, message in chats]  # (no chat.engine to unpickle)
    barrier, procs = ctx.Barrier(n), []
    for first, c, start, r in shares:
        head, conn = ctx.Pipe(duplex=False)
        turned = plain[start % len(plain) :] + plain[: start % len(plain)]
        args = (conn, barrier, url, name, preset, max_tokens, turned, first, c, r)
        procs.append((ctx.Process(target=_clients, args=args, daemon=True), head))
    for proc, _ in procs:
        proc.start()
    parts = []
    for proc, head in procs:
        while not head.poll(1) and proc.is_alive():
            pass
        parts.append(head.recv() if head.poll(0) else {"failed": f"ended with exit code {proc.exitcode}, no result"})
        proc.join(30)
    failed = [p["failed"] for p in parts if "failed" in p]
    if failed:
        raise RuntimeError(f"{len(failed)} of {n} client processes failed; the first:\n{failed[0]}")
    return merged(parts, clients)


def plan(clients: int, replies: int, per_process: int) -> list[tuple[int, int, int, int]]:
    """The round's processes, at most ``per_process`` clients each, as even as can be: per process
    (its first client's index, its clients, its first reply's index, its replies)."""
    n = math.ceil(clients / per_process)
    cuts = [(clients * j // n, replies * j // n) for j in range(n + 1)]
    return [(c0, c1 - c0, r0, r1 - r0) for (c0, r0), (c1, r1) in zip(cuts, cuts[1:])]


def address(k: int) -> str:
    """The address API client k of a round names (``X-Forwarded-For``, as a proxy would for visitor k):
    one of its own, as the API bounds the replies of one address at once."""
    return f"10.0.{k // 250}.{k % 250 + 1}"


def _clients(conn, barrier, url, name, preset, max_tokens, chats, first, clients, replies) -> None:
    """One client process: its clients (``first`` the index of its first of the round's, so each client
    of the API names an address of its own) made, then (once every process is ready) its closed loop."""
    try:
        chats = [(SimpleNamespace(**conv), message) for conv, message in chats]
        opened: list = []
        make = paths(url, preset, max_tokens, opened)[name]
        barrier.wait(timeout=600)
        t0, cpu = time.monotonic(), cpu_seconds()
        round_ = closed_loop(lambda k: make(first + k), chats, clients, replies)
        close(opened)
        conn.send({**round_, "started": t0, "ended": time.monotonic(), "cpu": cpu_seconds() - cpu})
    except BaseException:  # noqa: BLE001 - the parent reports it
        barrier.abort()  # the other processes stop waiting for this one
        conn.send({"failed": traceback.format_exc()})
    finally:
        conn.close()


def merged(parts: list[dict], clients: int) -> dict:
    """One round from its processes' parts: replies over the time from the first start to the last
    end (``time.monotonic``, one clock for all processes of the machine), percentiles over all replies."""
    joined = [[x for p in parts for x in p[key]] for key in ("texts", "latencies", "first_texts", "errors")]
    wall = max(p["ended"] for p in parts) - min(p["started"] for p in parts)
    result = round_result(clients, wall, *joined)
    cpu = sum(p["cpu"] for p in parts) / result["replies"]
    return {**result, "client_processes": len(parts), "bench_cpu_per_reply": cpu}


def close(clients: list) -> None:
    while clients:
        clients.pop().close()
