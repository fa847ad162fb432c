"""The pieces the training recipe (``finetune/train.py``) puts together: the accelerator, the
output-dir check, the data loaders, the step plan, optimizer and schedule, the loop's loss
window and its ``log`` event, the profiler, stop requests and the final save. Each is small and does one thing; the
recipe reads as their order.
"""

from __future__ import annotations

import ctypes
import itertools
import json
import logging
import math
import os
import shutil
import signal
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch
from accelerate import Accelerator
from accelerate.logging import get_logger
from accelerate.utils import DataLoaderConfiguration, DummyOptim, DummyScheduler, InitProcessGroupKwargs
from torch.utils.data import DataLoader
from transformers import DataCollatorForSeq2Seq, get_scheduler

from chat.layout import FINAL, RESULTS_FILE, TRAINING_ARGS_FILE
from finetune import checkpoint as ckpt
from finetune import lora
from finetune.checkpoint import TrainingError  # (defined there, where saving raises it too)
from finetune.config import TrainConfig
from finetune.cpu_ops import CPU_OPS_NAMES, cpu_op_state, deepspeed_on_cpu, extension_dir
from finetune.data import LengthGroupedSampler, row_lengths
from finetune.evaluate import generation_kwargs
from finetune.hub import write_model_card
from finetune.packing import PackingCollator, token_costs

log = get_logger(__name__)


class OutputDirInUse(TrainingError):
    """--output_dir holds an earlier run. Its metrics.jsonl stays that run's: no error event."""


@dataclass
class LossWindow:
    """What the loop sums up between two log steps / checks. The tensors stay on the device:
    reading them every step would make the CPU wait for the GPU each step instead of queueing
    the next one."""

    sums: torch.Tensor  # (sum of finite losses, their count) since the last log step
    bad_run: torch.Tensor  # consecutive steps with a non-finite loss
    worst_bad_run: torch.Tensor  # longest such run since the last check
    # speed: per launch attempt, since its last log (a resume measures its own)
    start: float = field(default_factory=time.perf_counter)
    samples: int = 0  # on all processes, since the last log step

    @classmethod
    def on(cls, device, carried: tuple[float, float] | None = None) -> LossWindow:
        """An empty window, or one holding ``carried`` (loss sum, count: a checkpoint's open window)."""
        sums = torch.tensor(carried or (0.0, 0.0), dtype=torch.float32, device=device)
        return cls(sums, torch.zeros((), device=device), torch.zeros((), device=device))


# --------------------------------------------------------------------------- the launcher's lifetime

PR_SET_PDEATHSIG = 1  # <linux/prctl.h>
LAUNCHERS = ("accelerate", "torchrun", "deepspeed")  # program names
LAUNCHER_MODULES = ("accelerate.commands", "torch.distributed.run", "torch.distributed.launch", "deepspeed.launcher")


def is_rank0() -> bool:
    """RANK, not the accelerator: a run can fail, or check its checkpoint, before the accelerator exists."""
    return os.environ.get("RANK", "0") == "0"


def is_launcher(cmdline: list[str]) -> bool:
    """``accelerate launch``, ``torchrun``, ``deepspeed`` or ``python -m`` one of them."""
    if any(os.path.basename(arg) in LAUNCHERS for arg in cmdline[:2]):
        return True
    module = cmdline[cmdline.index("-m") + 1] if "-m" in cmdline[:-1] else ""
    return module.startswith(LAUNCHER_MODULES)


def watch_launcher(poll_seconds: float = 1.0) -> None:
    """A rank started by a launcher gets SIGTERM (so: checkpoint and stop) when the launcher dies.

    torch elastic starts each rank in a session of its own, so a ``kill -9`` of ``accelerate
    launch`` (or of the app's process group) used to leave the ranks training to the end.
    PR_SET_PDEATHSIG covers the direct parent: the elastic agent, which ``accelerate launch``
    runs inside its own process (the tree is accelerate launch -> ranks). When the agent is a
    separate process under a launcher (e.g. ``accelerate launch`` -> torchrun -> ranks), the
    agent outlives a killed launcher, so a watchdog thread polls the launchers above the parent.
    Nothing happens outside a launcher (no LOCAL_RANK/RANK in the environment)."""
    if "LOCAL_RANK" not in os.environ and "RANK" not in os.environ:
        return
    import psutil

    parent = os.getppid()
    armed = sys.platform.startswith("linux") and ctypes.CDLL(None).prctl(PR_SET_PDEATHSIG, signal.SIGTERM, 0, 0, 0) == 0
    try:
        above = [p for p in psutil.Process(parent).parents() if p.pid > 1]
        # the launchers right above the parent (not a shell or the app above those)
        watched = list(itertools.takewhile(lambda p: is_launcher(p.cmdline()), above))
        orphan = parent == 1 and not is_launcher(psutil.Process(1).cmdline())
    except psutil.Error:
        watched, orphan = [], False
    # The launcher may have died before prctl, while Python imported the recipe: this process
    # then belongs to init already (or to a subreaper, which goes unnoticed) and no signal comes.
    if orphan or os.getppid() != parent:
        launcher_gone(parent)
    elif watched or not armed:  # (without PDEATHSIG the thread also watches the parent)
        threading.Thread(
            target=poll_launchers, args=(parent, watched, poll_seconds), daemon=True, name="launcher-watchdog"
        ).start()


def poll_launchers(parent: int, watched: list, poll_seconds: float) -> None:
    import psutil

    while True:
        time.sleep(poll_seconds)
        for proc in watched:
            try:
                alive = proc.is_running() and proc.status() != psutil.STATUS_ZOMBIE  # (same process: pid reuse)
            except psutil.Error:
                alive = False
            if not alive:
                launcher_gone(proc.pid)
                return
        if os.getppid() != parent:  # re-parented: the parent died
            launcher_gone(parent)
            return


def launcher_gone(pid: int) -> None:
    logging.getLogger("finetune").warning(f"the launcher (pid {pid}) is gone: stopping this process")
    os.kill(os.getpid(), signal.SIGTERM)  # StopRequest once the loop runs; before that, the default: exit


# --------------------------------------------------------------------------- the pieces of setup()


def make_accelerator(cfg: TrainConfig) -> Accelerator:
    handlers = []
    if deepspeed_on_cpu() and "LOCAL_RANK" in os.environ:
        # DeepSpeed on CPU: without an explicit gloo backend accelerate counts one process.
        handlers.append(InitProcessGroupKwargs(backend="gloo"))
    return Accelerator(
        gradient_accumulation_steps=cfg.gradient_accumulation_steps,
        log_with=cfg.report_to if cfg.with_tracking else None,  # "all" = every installed tracker
        project_dir=cfg.output_dir,
        kwargs_handlers=handlers,
        # A seeded sampler makes the data order reproducible, so a resumed run sees what an
        # uninterrupted one would have.
        dataloader_config=DataLoaderConfiguration(use_seedable_sampler=True),
    )


def check_compiler() -> None:
    """DeepSpeed on the CPU compiles its CPU Adam op (a torch extension) at the first run: without
    a C++ compiler that is a long traceback minutes in. Fail at once with what is missing."""
    if not deepspeed_on_cpu():
        return
    names = [os.environ["CXX"]] if os.environ.get("CXX") else []
    if not any(shutil.which(name) for name in [*names, "c++", "g++"]):
        raise TrainingError(
            "DeepSpeed builds its CPU Adam op with a C++ compiler and none was found "
            f"({'/'.join([*names, 'c++', 'g++'])} on PATH): install one, e.g. `apt-get install g++`, "
            "or run `make run` which sets it up"
        )


def _op_phase(step: str, what: str, otherwise: str) -> str:
    state = cpu_op_state(step)
    if state == "unbuilt":
        return f"building DeepSpeed's {what} (the first CPU run on this machine; about a minute)"
    if state == "locked":  # another process of this run, or another run, builds it; or a killed build left the lock
        return (
            f"building DeepSpeed's {what}, or waiting while another process builds it (about a minute; if this "
            f"lasts while nothing builds, an interrupted build left `{extension_dir(CPU_OPS_NAMES[step])}/lock`: "
            "delete that file)"
        )
    return otherwise


def connecting_phase() -> str:
    """The ``phase`` event's text while the processes connect (the accelerator is made): the first
    CPU run spent ~55 s here building DeepSpeed's shared-memory op under "connecting the processes"."""
    return _op_phase("connect", "CPU communication op", "connecting the processes")


def preparing_phase(accelerator) -> str:
    """The ``phase`` event's text while accelerator.prepare runs."""
    plugin = accelerator.state.deepspeed_plugin
    if plugin is None:
        return "preparing the model"
    config = plugin.deepspeed_config
    offload = (config.get("zero_optimization", {}).get("offload_optimizer") or {}).get("device")
    if "optimizer" in config or offload == "cpu":  # DeepSpeed's own optimizer: CPU Adam on the CPU
        return _op_phase("prepare", "CPU Adam op", "preparing DeepSpeed")
    return "preparing DeepSpeed"


def check_output_dir(cfg: TrainConfig) -> None:
    """Refuse to start a fresh run where one already started: two runs' metrics and checkpoints
    would mix. A folder where a run failed before its start (bad data, unknown model) holds only
    that failure's error event, so the same command can simply run again."""
    out = Path(cfg.output_dir)
    if cfg.resume_from_checkpoint is None and ckpt.run_started(out):
        raise OutputDirInUse(
            f"{out} already holds a run; pass --resume_from_checkpoint latest to continue it, "
            "or choose another --output_dir",
            file=str(out),
        )


def make_loaders(
    accelerator, data, tokenizer, cfg: TrainConfig, model_config, prefs=None
) -> tuple[DataLoader, DataLoader, DataLoader | None]:
    """Train, validation and (when the data has the split) held-out feedback loaders; training
    batches packed when ``cfg.packs`` (evaluation generates from plain padded batches), or the
    preference rows' batches of ``prefs`` (finetune.preference_train.Preferences)."""
    pad_multiple = 8 if accelerator.mixed_precision != "no" else None
    collator = DataCollatorForSeq2Seq(tokenizer, label_pad_token_id=-100, pad_to_multiple_of=pad_multiple)
    train_collator = collator
    if cfg.packs:
        train_collator = PackingCollator(
            tokenizer.pad_token_id,
            model_config.decoder_start_token_id,
            cfg.max_source_length,
            cfg.max_target_length,
            costs=token_costs(model_config),
            multiple=pad_multiple,
        )
    # Collating hundreds of rows per step in Python would leave the GPU waiting: workers do it.
    workers = cfg.dataloader_num_workers
    if workers is None:
        workers = 2 if torch.cuda.is_available() else 0
    loader_kwargs = {"collate_fn": collator, "num_workers": workers, "pin_memory": torch.cuda.is_available()}
    # Each loader gets its own generator: creating an iterator must not draw from the global RNG,
    # or a resumed run (which creates it after restoring RNG states) would see different dropout.
    if cfg.group_by_length and not cfg.pad_to_max_length:
        group = cfg.per_device_train_batch_size * accelerator.num_processes  # one step's rows on all processes
        order = {"sampler": LengthGroupedSampler(row_lengths(data["train"]), group, cfg.seed)}
    else:
        order = {"shuffle": True}
    if prefs:
        train_dl = prefs.train_loader(cfg, **loader_kwargs)
    else:
        train_dl = DataLoader(
            data["train"],
            batch_size=cfg.per_device_train_batch_size,
            **order,
            **{**loader_kwargs, "collate_fn": train_collator},
            generator=torch.Generator().manual_seed(cfg.seed),
        )
    eval_dl, feedback_dl = (
        DataLoader(
            data[split],
            batch_size=cfg.per_device_eval_batch_size,
            **loader_kwargs,
            generator=torch.Generator().manual_seed(cfg.seed),
        )
        if split in data
        else None
        for split in ("validation", "feedback")
    )
    return train_dl, eval_dl, feedback_dl


def plan_steps(train_rows: int, accelerator, cfg: TrainConfig) -> tuple[int, int, int]:
    """(steps per epoch, total steps, epochs), steps per epoch as the prepared (sharded) loader has them."""
    batches = math.ceil(math.ceil(train_rows / cfg.per_device_train_batch_size) / accelerator.num_processes)
    steps_per_epoch = math.ceil(batches / cfg.gradient_accumulation_steps)
    total_steps = cfg.max_train_steps or cfg.num_train_epochs * steps_per_epoch
    return steps_per_epoch, total_steps, math.ceil(total_steps / steps_per_epoch)


def make_optimizer(accelerator, model, cfg, total_steps: int):
    """DeepSpeed's own optimizer/scheduler when its JSON defines them, torch/transformers otherwise."""
    ds = accelerator.state.deepspeed_plugin
    ds_cfg = ds.deepspeed_config if ds else {}
    no_decay = ("bias", "layer_norm.weight", "layernorm_embedding.weight")
    trained = [(n, p) for n, p in model.named_parameters() if p.requires_grad]  # (a LoRA run's base is frozen)
    groups = [
        {"params": [p for n, p in trained if not n.endswith(no_decay)], "weight_decay": cfg.weight_decay},
        {"params": [p for n, p in trained if n.endswith(no_decay)], "weight_decay": 0.0},
    ]
    groups = [group for group in groups if group["params"]]  # (LoRA has no biases or norms)
    if "optimizer" in ds_cfg:
        optimizer = DummyOptim(groups, lr=cfg.learning_rate, weight_decay=cfg.weight_decay)
    else:
        optimizer = torch.optim.AdamW(groups, lr=cfg.learning_rate, fused=torch.cuda.is_available())
    # accelerate expects schedules counted in per-process steps (it divides DeepSpeed's total
    # by the process count and steps a torch scheduler once per process), hence the scaling.
    if "scheduler" in ds_cfg:
        scheduler = DummyScheduler(
            optimizer, total_num_steps=total_steps * accelerator.num_processes, warmup_num_steps=cfg.num_warmup_steps
        )
    else:
        scheduler = get_scheduler(
            cfg.lr_scheduler_type,
            optimizer,
            num_warmup_steps=cfg.num_warmup_steps * accelerator.num_processes,
            num_training_steps=total_steps * accelerator.num_processes,
        )
    if ds and ds_cfg.get("gradient_clipping") == "auto":
        ds_cfg["gradient_clipping"] = cfg.max_grad_norm
    return optimizer, scheduler


def start_profiler(folder: str):
    """torch.profiler over optimizer steps 3-5; tables sorted by device and by CPU time."""
    out = Path(folder)
    try:  # fail now, with a clear message, not at step 5 after minutes of training
        out.mkdir(parents=True, exist_ok=True)
        (out / ".write-test").touch()
        (out / ".write-test").unlink()
    except OSError as err:
        raise TrainingError(
            f"--profile_dir {folder}: cannot write there ({err.strerror or err})", file=folder
        ) from None
    activities = [torch.profiler.ProfilerActivity.CPU]
    if torch.cuda.is_available():
        activities.append(torch.profiler.ProfilerActivity.CUDA)

    def write(prof):
        averages = prof.key_averages()
        for key in ("cuda_time_total", "cpu_time_total"):
            if key == "cuda_time_total" and not torch.cuda.is_available():
                continue
            (out / f"train_steps_by_{key}.txt").write_text(averages.table(sort_by=key, row_limit=40))
        log.info(f"profile of steps 3-5 written to {out}")

    profiler = torch.profiler.profile(
        activities=activities,
        on_trace_ready=write,
        schedule=torch.profiler.schedule(wait=2, warmup=0, active=3, repeat=1),
    )
    profiler.start()
    return profiler


# --------------------------------------------------------------------------- the loop's pieces


def log_window(run, epoch: int, partial: bool = False) -> None:
    """The ``log`` event: mean loss over all processes since the last one, learning rate, speed
    (since the last log of this attempt). ``partial``: the loss window stays open (the event
    says so), and only the speed is measured afresh."""
    acc, window, step = run.accelerator, run.window, run.completed
    loss_sum, count = acc.reduce(window.sums, "sum").tolist()
    elapsed = time.perf_counter() - window.start
    entry = {
        "step": step,
        "epoch": round(epoch + (step - epoch * run.steps_per_epoch) / run.steps_per_epoch, 4),
        "loss": loss_sum / max(count, 1),
        "lr": run.scheduler.get_last_lr()[0],
        "samples_per_second": window.samples / elapsed,
    }
    if torch.cuda.is_available():
        entry["gpu_mem_gib"] = torch.cuda.max_memory_allocated() / 2**30
        entry["alloc_retries"] = torch.cuda.memory_stats().get("num_alloc_retries", 0)
    run.metrics.write("log", **entry, **({"partial": True} if partial else {}))
    run.progress.set_postfix(loss=f"{entry['loss']:.4f}")
    if run.progress.disable:
        log.info(
            f"step {step} / {run.total_steps}: loss {entry['loss']:.4f}{' so far' if partial else ''}, "
            f"lr {entry['lr']:.3g}, {entry['samples_per_second']:.1f} samples/s"
        )
    if run.cfg.with_tracking and not partial:  # a tracker's curve has the points metrics.jsonl's has
        acc.log(
            {"train_loss": entry["loss"], "lr": entry["lr"], "samples_per_second": entry["samples_per_second"]},
            step=step,
        )
    if not partial:
        window.sums.zero_()
    window.start, window.samples = time.perf_counter(), 0


class StopRequest:
    """Set by SIGTERM/SIGINT or by a STOP file in the output dir; checked collectively at each
    check point of the loop (log steps, checkpoints, and every CHECK_EVERY steps)."""

    def __init__(self, output_dir: str):
        self.file = Path(output_dir) / ckpt.STOP_FILE
        self.signalled = False
        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, self._handle)

    def _handle(self, signum, frame):
        self.signalled = True

    def __call__(self) -> bool:
        return self.signalled or self.file.exists()


def save_final(accelerator, model, tokenizer, cfg: TrainConfig, results: dict) -> Path:
    """save_pretrained (safetensors, full fp32 weights even under ZeRO) + everything chat needs. A
    LoRA run's save_pretrained is peft's: its adapter files only, and no generation config (finetune/lora.py)."""
    dest = Path(cfg.output_dir) / FINAL
    tmp = Path(cfg.output_dir) / f".{FINAL}.tmp"
    # A full disk is a TrainingError naming final/, and the half-written folder goes away.
    with ckpt.saving(dest, cfg.output_dir, tmp=tmp if accelerator.is_main_process else None):
        state_dict = accelerator.get_state_dict(model)  # every rank: ZeRO-3 gathers shards here
        if accelerator.is_main_process:
            shutil.rmtree(tmp, ignore_errors=True)  # left over from a crash
            tmp.mkdir(parents=True)
            state_dict = {k: v.float() if v.is_floating_point() else v for k, v in state_dict.items()}
            unwrapped = accelerator.unwrap_model(model)
            extra, base = lora.final_args(unwrapped) if cfg.adapter == "lora" else ({}, None)
            # (peft would look the base's config up on the Hub to decide about embedding layers: none are trained)
            options = {"save_embedding_layers": False} if base else {}
            unwrapped.save_pretrained(tmp, state_dict=state_dict, safe_serialization=True, **options)
            tokenizer.save_pretrained(tmp)
            if base is None:
                gen = unwrapped.generation_config
                for key, value in generation_kwargs(cfg).items():
                    setattr(gen, key, value)
                gen.save_pretrained(tmp)
            (tmp / TRAINING_ARGS_FILE).write_text(json.dumps({**cfg.to_dict(), **extra}, indent=2))
            (tmp / RESULTS_FILE).write_text(json.dumps(results, indent=2))
            write_model_card(tmp, cfg, results, accelerator.num_processes, adapter_base=base)
            # The app and a Space serve from it: safetensors writes model.safetensors 0600.
            for path in [tmp, *tmp.rglob("*")]:
                path.chmod(0o755 if path.is_dir() else 0o644)
            ckpt.publish_dir(tmp, dest)
        accelerator.wait_for_everyone()
    return dest
