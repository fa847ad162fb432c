"""What staging a join costs the GPU step loop's worker on the host: ``python -m bench.join_stage``.

Before a join's recorded launch, ``chat.stepgraphs.SlotBatch`` puts every joiner's source ids, mask
and settings into one host tensor (``chat.stepgraphs.stage``) and copies it to the device. Under
load hundreds of chats join at once (closed-loop clients that started together finish together),
and the worker does this while every running row waits. This times ``stage`` against the nested
lists it replaced (``torch.tensor`` of a list of lists, kept here as the baseline), in the same run,
for ``--joiners`` at once, on the demo model's real sources (the shipped validation prompts as the
chat builds them) in slots of ``--sources`` encoder positions (128: BlenderBot-400M's), and checks
that both give the same tensors. Needs no GPU: it is the host's side alone.
"""

from __future__ import annotations

import argparse
import itertools
import time
from dataclasses import replace

import torch

from bench.chat import prompt_set
from bench.common import cpu_name, md_table, percentile, versions, write_json
from chat.engine import DEMO_DIR, ChatEngine, load_checkpoint
from chat.stepgraphs import stage

# A greedy row's settings (chat.greedy.plain_settings): the fast preset's penalty and n-gram size; the
# lengths stand in for any (the staging's cost does not depend on the values).
SETTINGS = {"penalty": 1.2, "eos_until": 1, "forced_at": 23, "ngram": 3}


def stage_lists(joiners: list, n: int, sources: int, pad: int, spare: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The baseline: ``stage`` as it was written before 2026-12-08, Python lists made a tensor."""
    staged = [[pad] * sources + [1] + [0] * (sources - 1) + [spare, 0, -1, 0, 0]] * n
    penalty = [1.0] * n
    for k, (ids, slot, s, lane) in enumerate(joiners):
        fields = [slot, s["eos_until"], s["forced_at"], s["ngram"], lane]
        staged[k] = ids + [pad] * (sources - len(ids)) + [1] * len(ids) + [0] * (sources - len(ids)) + fields
        penalty[k] = s["penalty"]
    return torch.tensor(staged), torch.tensor(penalty)


def demo_sources(count: int, sources: int) -> list[list[int]]:
    """``count`` sources as the chat builds them for the shipped prompts (cycled), at most ``sources`` long."""
    engine = ChatEngine(load_checkpoint(str(DEMO_DIR), optimize="none"), "bench")  # only builds inputs here
    built = []
    for conv, message in prompt_set(32):
        ids = engine.build_input(replace(conv, turns=[*conv.turns, message]))[0]["input_ids"][0].tolist()
        built.append(ids[-sources:])
    return list(itertools.islice(itertools.cycle(built), count))


def time_ms(fn, args: tuple, repeats: int) -> float:
    """Median ms of ``fn(*args)`` over ``repeats`` calls."""
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn(*args)
        times.append((time.perf_counter() - start) * 1e3)
    return percentile(times, 50)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.join_stage", description=__doc__.splitlines()[0])
    parser.add_argument("--joiners", default="1,16,64,256", help="comma-separated counts of requests joining at once")
    parser.add_argument("--sources", type=int, default=128, help="encoder positions a slot holds")
    parser.add_argument("--repeats", type=int, default=50)
    parser.add_argument("--out", help="write the results as JSON here")
    args = parser.parse_args(argv)
    try:
        counts = [int(n) for n in args.joiners.split(",")]
    except ValueError:
        parser.error(f"--joiners takes comma-separated whole numbers, got {args.joiners!r}")
    if min(counts) < 1 or args.sources < 1 or args.repeats < 1:
        parser.error("--joiners, --sources and --repeats must be whole numbers of 1 or more")
    pool = demo_sources(max(counts), args.sources)
    results = []
    for count in counts:
        joiners = [(ids, slot, SETTINGS, slot % 3) for slot, ids in enumerate(pool[:count])]
        n = 1 << (count - 1).bit_length()  # the recorded join's width: joiners rounded up to a power of two
        call = (joiners, n, args.sources, 0, n)
        old, new = stage_lists(*call), stage(*call)
        same = all(torch.equal(a, b) and a.dtype == b.dtype for a, b in zip(old, new))
        results.append(
            {
                "joiners": count,
                "lists_ms": time_ms(stage_lists, call, args.repeats),
                "stage_ms": time_ms(stage, call, args.repeats),
                "same": same,
            }
        )
    known = versions()
    header = f"{cpu_name()}, torch {known['torch']}, {known['date']}, {args.sources} source positions"
    rows = [
        [str(r["joiners"]), f"{r['lists_ms']:.2f}", f"{r['stage_ms']:.2f}", f"{r['lists_ms'] / r['stage_ms']:.1f}x"]
        + ["yes" if r["same"] else "NO"]
        for r in results
    ]
    print(header)
    print("\n".join(md_table(["joiners", "nested lists (ms)", "stage (ms)", "faster", "same tensors"], rows)))
    if args.out:
        write_json(args.out, {"header": header, "results": results})
    return 0 if all(r["same"] for r in results) else 1


if __name__ == "__main__":
    raise SystemExit(main())
