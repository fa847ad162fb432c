"""One timed run of the benchmark (``bench/train.py``): a variant (recipe, strategy, data, batch,
processes), the exact ``accelerate launch ... -m finetune`` command it runs, and the numbers its
metrics.jsonl gives. Nothing here imports torch: the runs are subprocesses."""

from __future__ import annotations

import json
import logging
import os
import shutil
import statistics
import subprocess
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

from chat.layout import ROOT
from finetune.jobs.command import free_port

log = logging.getLogger("bench.train")  # one logger for the whole benchmark

PREFIX = "chatbot: "  # the seed's --source_prefix, in both recipes
FLOPS_PER_SAMPLE = 173e9  # 6 x weights x the tokens each weight sees at 128/64 (see docs/benchmarks.md)
N_EVAL = 1_000


@dataclass(frozen=True)
class Variant:
    recipe: str  # "seed" | "tuned"
    strategy: str  # "zero2" | "ddp"
    data: str  # "fixed" | "realistic"
    batch: int | str  # micro-batch per process; "auto" (CLI runs): finetune/memory.py picks it
    processes: int
    evaluate: bool = False  # 1,000 rows with the seed's generation settings
    steps: int = 12
    cpu: bool = False  # smoke mode: tiny model, fp32
    # "cli": the project's CLI, loader and all; "compute": bench/train_compute.py, the recipe's
    # DeepSpeed JSON and optimizer on batches already on the GPU (no loader, no evaluation)
    mode: str = "cli"
    dtype: str | None = None  # precision other than the recipe's own (fp16 seed, bf16 tuned)
    compile: str = "none"  # compute runs: "layers" = torch.compile of every layer, "model" = of the whole model
    attention: str = "sdpa"  # compute runs: the CLI's --attention choice (sdpa lets PyTorch pick the kernel)
    # PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True/False; None: the process's own default (the CLI
    # turns expandable segments on, bench.train_compute leaves PyTorch's off)
    expandable: bool | None = None
    profile: int = 0  # compute runs: steps profiled from step 5 (bench/profile.py)
    bucket: float | None = None  # compute runs: DeepSpeed bucket sizes (elements)
    packing: bool | None = None  # CLI runs: --packing (None: the CLI's default, on for tuned)
    zero: str = ""  # compute runs: DeepSpeed zero_optimization overrides, "stage=1,overlap_comm=false"

    @property
    def precision(self) -> str:
        return "fp32" if self.cpu else self.dtype or ("fp16" if self.recipe == "seed" else "bf16")

    @property
    def name(self) -> str:
        recipe = f"{self.recipe}-compute" if self.mode == "compute" else self.recipe
        extras = (
            {"none": "", "layers": "-compile", "model": "-compile-model"}[self.compile]
            + (f"-bucket{self.bucket / 1e6:g}M" if self.bucket else "")
            + (f"-{self.attention}" if self.attention != "sdpa" else "")
            + {None: "", True: "-expandable", False: "-noexpandable"}[self.expandable]
            + ("-nopack" if self.packing is False else "")
            + (f"-zero-{self.zero.replace('=', '').replace(',', '-')}" if self.zero else "")
        )
        return f"{recipe}-{self.strategy}-{self.precision}-{self.data}-b{self.batch}-x{self.processes}{extras}"

    @property
    def plain(self) -> bool:
        """A CLI run of the recipe as it is (its precision, a fixed batch): what ratios pair up."""
        return self.mode == "cli" and self.dtype is None and self.batch != "auto" and self.packing is None


def setup_of(result: dict) -> tuple[str, str, str, int]:
    """(recipe, strategy, data, processes) of a run's result: runs of one setup are compared."""
    v = result["variant"]
    if v.get("mode", "cli") != "cli":
        return f"{v['recipe']}-{v['mode']}", v["strategy"], v["data"], v["processes"]
    return v["recipe"], v["strategy"], v["data"], v["processes"]


def command(v: Variant, data_dir: Path, out_dir: Path, smoke: bool) -> list[str]:
    """The exact launcher + CLI (or bench/train_compute.py) argv of one variant."""
    if smoke:  # CPU: one process, DeepSpeed ZeRO-2 on gloo; the seed keeps its own JSON
        launcher = ["--config_file", "configs/accelerate/cpu_zero2.yaml", "--num_processes", "1"]
        if v.recipe == "seed":
            launcher += ["--deepspeed_config_file", "configs/ds_zero2_seed.json"]
    else:
        config = {"zero2": "zero2_seed.yaml" if v.recipe == "seed" else "zero2.yaml", "ddp": "ddp.yaml"}[v.strategy]
        launcher = ["--config_file", f"configs/accelerate/{config}", "--num_processes", str(v.processes)]
        launcher += ["--mixed_precision", v.precision]
    accelerate = [sys.executable, "-m", "accelerate.commands.launch", "--main_process_port", str(free_port())]
    if v.mode == "compute":
        args = ["--model", "tiny" if smoke else "random-400M", "--train_file", str(data_dir / f"{v.data}_train.jsonl")]
        args += ["--batch", str(v.batch), "--steps", str(v.steps), "--logging_steps", "1" if v.cpu else "2"]
        args += [
            "--pad",
            "max" if v.recipe == "seed" else "batch",
            "--compile",
            v.compile,
            "--output_dir",
            str(out_dir),
        ]
        args += ["--bucket", f"{v.bucket:g}"] if v.bucket else []
        args += ["--zero", v.zero] if v.zero else []
        args += ["--profile", str(v.profile)] if v.profile else []
        args += ["--attention", v.attention] if v.attention != "sdpa" else []
        return [*accelerate, *launcher, "-m", "bench.train_compute", *args]
    eval_batch = max(1, N_EVAL // v.processes) if v.recipe == "tuned" else 100  # the seed evaluated 100 per GPU
    flags = {
        "model_name_or_path": "tiny" if smoke else "random-400M",
        "train_file": data_dir / f"{v.data}_train.jsonl",
        "validation_file": data_dir / f"{v.data}_validation.jsonl",
        "max_source_length": 128,
        "max_target_length": 64,
        "source_prefix": PREFIX,
        "val_max_target_length": 64,
        "val_min_target_length": 64,
        "num_beams": 10,
        "n_val": 8 if smoke else N_EVAL if v.evaluate else 2 * v.processes,
        "per_device_train_batch_size": v.batch,
        "per_device_eval_batch_size": 8 if smoke else eval_batch,
        "max_train_steps": v.steps,
        "logging_steps": 1 if v.cpu else 2,
        "save_model": "false",
        "seed": 25,
        "learning_rate": "1e-6",
        "weight_decay": "0.0",
        "num_warmup_steps": 100,
        "output_dir": out_dir,
    }
    args = [word for flag, value in flags.items() for word in (f"--{flag}", str(value))]
    if v.packing is not None:
        args += ["--packing", str(v.packing).lower()]
    if v.recipe == "seed":
        args += ["--pad_to_max_length", "--group_by_length", "false", "--fast_ngram_blocking", "false"]
        args += ["--dataloader_num_workers", "0", "--attention", "sdpa", "--eval_attention", "sdpa"]
    return [*accelerate, *launcher, "-m", "finetune", *args]


def summarize(events: list[dict], launched: float, v: Variant) -> dict:
    """Numbers of one run from its metrics.jsonl events."""
    logs = [e for e in events if e["event"] == "log"]
    steady = [e["samples_per_second"] for e in logs if e["step"] > 2] or [e["samples_per_second"] for e in logs]
    out = {"steps": len(logs), "losses": [round(e["loss"], 5) for e in logs]}
    if steady:
        rate = statistics.median(steady)
        out.update(
            samples_per_second=rate, epoch_10k_seconds=10_000 / rate, first_step_seconds=logs[0]["time"] - launched
        )
        if v.data == "fixed" and not v.cpu:  # the FLOP count is the 400M model's
            out["tflops_per_gpu"] = rate * FLOPS_PER_SAMPLE / v.processes / 1e12
    retries = [e["alloc_retries"] for e in logs if e.get("alloc_retries") is not None]
    if retries:  # the caching allocator freeing everything and retrying: a full sync each time
        out["alloc_retries"] = max(retries)
    peaks = [e["gpu_mem_gib"] for e in logs if e.get("gpu_mem_gib") is not None]
    if peaks:
        out["peak_gib"] = max(peaks)
    start = next((e for e in events if e["event"] == "start"), {})
    if start.get("gpu_mem_static_gib") is not None:
        out["static_gib"] = start["gpu_mem_static_gib"]
    if start.get("global_batch_size"):  # what 'auto' resolved to
        out["batch_used"] = start["global_batch_size"] // max(start.get("num_processes") or 1, 1)
    evals = [e for e in events if e["event"] == "eval"]
    if evals and evals[-1].get("eval_loss") is not None:
        out["eval_loss"] = evals[-1]["eval_loss"]
    if v.evaluate and evals:
        out.update(eval_seconds=evals[-1]["eval_epoch_seconds"], eval_bleu=evals[-1]["eval_bleu"])
    return out


def env_of(v: Variant) -> dict | None:
    """The run's environment: this one, with the allocator setting the variant asks for (if any)."""
    if v.expandable is None:
        return None
    return {**os.environ, "PYTORCH_CUDA_ALLOC_CONF": f"expandable_segments:{v.expandable}"}


def run(v: Variant, data_dir: Path, work: Path, smoke: bool, timeout: float, tag: str = "") -> dict:
    out_dir = work / f"{tag}{v.name}"
    if out_dir.exists():  # a rerun of the same variant starts clean
        shutil.rmtree(out_dir)
    argv = command(v, data_dir, out_dir, smoke)
    log.info("%s: %s", v.name, " ".join(argv[2:]))
    launched = time.time()
    try:
        proc = subprocess.run(
            argv, cwd=ROOT, env=env_of(v), capture_output=True, text=True, timeout=timeout, check=False
        )
        code, stderr = proc.returncode, proc.stderr
    except subprocess.TimeoutExpired as err:
        partial = err.stderr or ""
        code, stderr = "timeout", partial.decode(errors="replace") if isinstance(partial, bytes) else partial
    if out_dir.exists():
        (out_dir / "launch.log").write_text(stderr)  # the run's own log, for when a number looks wrong
    result = {
        "variant": asdict(v),
        "name": v.name,
        "precision": v.precision,
        "wall_seconds": time.time() - launched,
        "ok": code == 0,
    }
    metrics = out_dir / "metrics.jsonl"
    events = [json.loads(line) for line in metrics.read_text().splitlines()] if metrics.exists() else []
    result.update(summarize(events, launched, v))
    if code != 0:
        errors = [e["message"] for e in events if e["event"] == "error"]
        tail = [line for line in stderr.splitlines() if "error" in line.lower()][-3:]
        result["error"] = errors[-1] if errors else (" | ".join(tail) or f"exit {code}")
        result["oom"] = "out of memory" in (result["error"] + stderr).lower()
    if (out_dir / "profile.json").exists():  # where the GPU time went (bench/profile.py)
        result["profile"] = json.loads((out_dir / "profile.json").read_text())
    log.info("%s: %s", v.name, {k: result[k] for k in result if k not in ("variant", "losses", "profile")})
    return result
