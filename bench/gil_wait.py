"""What a torch call costs a thread while other threads want the GIL: ``python -m bench.gil_wait``.

A torch call releases the GIL while it runs (its C++ part) and must take it back after; pure Python
keeps it. This times one small in-place torch op and one small piece of Python in the main thread,
alone and beside ``--threads`` other threads that each do a little Python and sleep (as chats'
threads do between streamed tokens). The chat engine's worker is that main thread: under load each
of its torch calls waits for the GIL (why ``chat.stepgraphs`` keeps its calls per step few).
"""

from __future__ import annotations

import argparse
import threading
import time

import torch

from bench.common import cpu_name, md_table, versions, write_json


def time_calls(fn, calls: int) -> float:
    """Mean µs per ``fn()`` over ``calls`` calls."""
    start = time.perf_counter()
    for _ in range(calls):
        fn()
    return (time.perf_counter() - start) / calls * 1e6


def beside(threads: int, calls: int, work: int, sleep_s: float) -> dict:
    """µs per torch op and per piece of Python in this thread, with ``threads`` busy threads running."""
    x, stop = torch.zeros(8), threading.Event()

    def busy() -> None:
        while not stop.is_set():
            total = 0
            for i in range(work):  # a little Python (a reader's decode), then a wait (the next token)
                total += i
            time.sleep(sleep_s)

    others = [threading.Thread(target=busy, daemon=True) for _ in range(threads)]
    for t in others:
        t.start()
    time.sleep(0.1)
    try:
        return {
            "threads": threads,
            "torch_op_us": time_calls(lambda: x.add_(1), calls),
            "python_us": time_calls(lambda: sum(range(10)), calls),
        }
    finally:
        stop.set()
        for t in others:
            t.join()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.gil_wait", description=__doc__.splitlines()[0])
    parser.add_argument("--threads", default="0,4,16,64", help="comma-separated counts of busy threads")
    parser.add_argument("--calls", type=int, default=2000)
    parser.add_argument("--work", type=int, default=200, help="loop turns of Python per busy thread's turn")
    parser.add_argument("--sleep", type=float, default=0.0005, help="s each busy thread sleeps per turn")
    parser.add_argument("--out", help="write the results as JSON here")
    args = parser.parse_args(argv)
    results = [beside(int(n), args.calls, args.work, args.sleep) for n in args.threads.split(",")]
    header = f"{cpu_name()}, torch {versions()['torch']}, {versions()['date']}"
    rows = [[str(r["threads"]), f"{r['torch_op_us']:.1f}", f"{r['python_us']:.2f}"] for r in results]
    print(header)
    print("\n".join(md_table(["busy threads", "torch op (µs)", "Python (µs)"], rows)))
    if args.out:
        write_json(args.out, {"header": header, "results": results})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
