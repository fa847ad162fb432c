"""Where a training step's GPU time goes: torch.profiler over a few steps, kernels grouped by kind.

``bench/train_compute.py --profile N`` profiles N steps from step 5 (after warm-up and any
compilation) and writes ``profile.json`` (the groups, the top kernels and the wall time) next to
the run's metrics. The groups answer the question the speed targets ask: how much of a step is
matrix multiplication (what the GEMM rate measures) and how much is everything around it.
"""

from __future__ import annotations

import json
import re
import time
from pathlib import Path

import torch

# First match wins: attention before GEMM (FlashAttention kernels are GEMMs too), norms and
# softmax before the elementwise catch-all.
GROUPS = (
    ("attention", r"fmha|flash|attention|attn|cudnn::fusion"),  # cuDNN's SDPA helpers too
    ("gemm", r"gemm|cutlass|xmma|nvjet|cublas|matmul|sm90_|sm80_|wgmma"),
    ("layer norm", r"layer_?norm|gammabeta"),
    ("softmax / loss", r"softmax|nll|cross_entropy|logsumexp"),
    ("optimizer", r"adam|multi_tensor|foreach"),
    ("dropout", r"dropout|bernoulli|philox"),
    ("copies and casts", r"copy|memcpy|memset|fill|cast|cat_|index"),
    ("reductions", r"reduce|sum|nccl|norm"),
    ("elementwise", r"elementwise|vectorized|unrolled|gelu|add|mul|where|triton"),
)


def group_of(kernel: str) -> str:
    name = kernel.lower()
    return next((group for group, pattern in GROUPS if re.search(pattern, name)), "other")


def summarize(kernels: dict[str, float], wall_ms: float, steps: int) -> dict:
    """Per-step milliseconds by group, the top kernels, and the GPU's busy share of the wall time."""
    groups: dict[str, float] = {}
    for name, ms in kernels.items():
        groups[group_of(name)] = groups.get(group_of(name), 0.0) + ms
    busy = sum(kernels.values())
    top = sorted(kernels.items(), key=lambda kv: -kv[1])[:25]
    return {
        "steps": steps,
        "wall_ms_per_step": wall_ms / steps,
        "busy_ms_per_step": busy / steps,
        "busy_share": busy / wall_ms if wall_ms else None,
        "groups_ms_per_step": {g: ms / steps for g, ms in sorted(groups.items(), key=lambda kv: -kv[1])},
        "top_kernels_ms_per_step": [
            {"kernel": name[:160], "group": group_of(name), "ms": ms / steps} for name, ms in top
        ],
    }


GAP_SIZES = ((0.01, "< 10 µs"), (0.1, "10-100 µs"), (1.0, "0.1-1 ms"), (float("inf"), ">= 1 ms"))


def idle_gaps(spans: list[tuple[float, float, str]], top: int = 12) -> dict:
    """The stretches with no kernel running (µs spans, any stream): their count and milliseconds by
    size (many short gaps: the CPU launching too slowly; a few long ones: syncs), and the longest,
    each with the kernels either side."""
    gaps, busy_until, before = [], None, None
    for start, end, name in sorted(spans):
        if busy_until is not None and start > busy_until:
            gaps.append({"ms": (start - busy_until) / 1000, "after": before[:100], "before": name[:100]})
        if busy_until is None or end > busy_until:
            busy_until, before = end, name
    by_size = {label: {"count": 0, "ms": 0.0} for _, label in GAP_SIZES}
    for gap in gaps:
        label = next(label for limit, label in GAP_SIZES if gap["ms"] < limit)
        by_size[label]["count"] += 1
        by_size[label]["ms"] += gap["ms"]
    return {
        "total_ms": sum(g["ms"] for g in gaps),
        "by_size": by_size,
        "longest": sorted(gaps, key=lambda g: -g["ms"])[:top],
    }


class Profile:
    """Call ``at(step)`` before each step: profiles steps ``first`` .. ``first + steps - 1``."""

    def __init__(self, out_dir: Path, first: int, steps: int):
        self.out, self.first, self.steps = Path(out_dir), first, steps
        self.prof, self.started = None, 0.0

    def at(self, step: int) -> None:
        cuda = torch.cuda.is_available()
        if step == self.first:
            activities = [torch.profiler.ProfilerActivity.CPU]
            activities += [torch.profiler.ProfilerActivity.CUDA] if cuda else []
            if cuda:
                torch.cuda.synchronize()
            self.prof = torch.profiler.profile(activities=activities)
            self.prof.__enter__()
            self.started = time.perf_counter()
        elif step == self.first + self.steps and self.prof is not None:
            if cuda:
                torch.cuda.synchronize()
            wall_ms = (time.perf_counter() - self.started) * 1000
            self.prof.__exit__(None, None, None)
            self.write(wall_ms, cuda)
            self.prof = None

    def write(self, wall_ms: float, cuda: bool) -> None:
        kernels: dict[str, float] = {}
        spans = []  # (start µs, end µs, name) of every kernel, for the idle gaps between them
        for e in self.prof.events():
            on_device = e.device_type == torch.autograd.DeviceType.CUDA
            if cuda and on_device:
                kernels[e.name] = kernels.get(e.name, 0.0) + e.device_time / 1000
                spans.append((e.time_range.start, e.time_range.end, e.name))
            elif not cuda and not e.cpu_children:  # the CPU: leaf operators' own time
                kernels[e.name] = kernels.get(e.name, 0.0) + e.self_cpu_time_total / 1000
        report = summarize(kernels, wall_ms, self.steps)
        report["kernels_per_step"] = len(spans) / self.steps
        report["idle_gaps"] = idle_gaps(spans)
        (self.out / "profile.json").write_text(json.dumps(report, indent=1))
