"""LoRA's dropped down projection alone on a GPU: finetune/lora_dropout.py's kernels against
PyTorch's dropout + matrix product and against no dropout, forward and backward, on the 400M shapes.

    python -m bench.lora_dropout --out runs/bench-lora-dropout     # one CUDA GPU; prints JSON

Each case is ``h = dropout(x) @ A^T`` (A: rank x features, bf16) on one step's rows of the
train_lora bench (800 rows of 128 source tokens: 102,400 x 1,280 for the attention and fc1 inputs,
x 5,120 for fc2's), then ``h.backward(g)`` with gradients for x and A: the median of 20 timed
repetitions after 2 warm-up ones, in CUDA events. ``GB/s`` counts the traffic the kernels cannot
avoid (x read twice, dx written once), so it says how close a case is to the memory's bandwidth.
``--also MODULE`` times another module with the same ``dropped_down`` (an older version of the
kernels, say) in the same run.
"""

from __future__ import annotations

import argparse
import importlib
import json
import logging
from pathlib import Path

import torch
import torch.nn.functional as F

from bench.common import command_line, versions, write_json
from bench.kernels import median_ms

log = logging.getLogger(__name__)
SHAPES = ((102_400, 1_280), (102_400, 5_120))


def cases(modules: dict, p: float) -> dict:
    """name -> ``f(x, a)`` returning h."""
    out = {
        "torch-dropout": lambda x, a: F.linear(F.dropout(x, p, training=True), a),
        "no-dropout": lambda x, a: F.linear(x, a),
    }
    for name, module in modules.items():
        out[name] = lambda x, a, m=module: m.dropped_down(x, a, p)
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, required=True, help="Folder for results.json.")
    parser.add_argument("--rank", type=int, default=8, help="LoRA's rank.")
    parser.add_argument("--p", type=float, default=0.05, help="Dropout probability.")
    parser.add_argument("--blocks", default="", help="Tilings to try: BLOCK_M:BLOCK_K:NUM_WARPS,...")
    parser.add_argument("--also", action="append", default=[], help="Another module with dropped_down to time.")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    if not torch.cuda.is_available():
        parser.error("needs a CUDA GPU")
    modules = {"kernels": importlib.import_module("finetune.lora_dropout")}
    modules.update({name: importlib.import_module(name) for name in args.also})
    configs = [tuple(int(v) for v in c.split(":")) for c in args.blocks.split(",")] if args.blocks else [None]
    results = []
    for rows, cols in SHAPES:
        torch.manual_seed(0)
        x = torch.randn(rows, cols, device="cuda", dtype=torch.bfloat16, requires_grad=True)
        a = (torch.randn(args.rank, cols, device="cuda") / cols**0.5).to(torch.bfloat16).requires_grad_(True)
        g = torch.randn(rows, args.rank, device="cuda", dtype=torch.bfloat16)
        for config in configs:
            for module in modules.values():  # the tiling every kernel module reads at call time
                if config:
                    module.BLOCK_M, module.BLOCK_K, module.NUM_WARPS = config
            for name, fn in cases(modules, args.p).items():
                if config and config != configs[0] and name in ("torch-dropout", "no-dropout"):
                    continue  # no tiling of theirs to vary

                def step(fn=fn, x=x, a=a, g=g):
                    x.grad = a.grad = None
                    fn(x, a).backward(g)

                def forward(fn=fn, x=x, a=a):
                    with torch.no_grad():
                        fn(x.detach(), a.detach())

                ms = median_ms(step, 20)
                entry = {"case": name, "rows": rows, "features": cols, "rank": args.rank, "p": args.p, "ms": ms}
                entry["forward_ms"] = median_ms(forward, 20)
                entry["gb_per_s"] = 3 * x.numel() * x.element_size() / ms / 1e6
                if config and name not in ("torch-dropout", "no-dropout"):
                    entry["block_m"], entry["block_k"], entry["num_warps"] = config
                log.info("%s", entry)
                results.append(entry)
    env = {"device": torch.cuda.get_device_name(), **versions("triton")}
    report = {"environment": env, "command": command_line("bench.lora_dropout", argv), "results": results}
    write_json(args.out / "results.json", report)
    log.info("%s", json.dumps(report, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
