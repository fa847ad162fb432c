"""The training recipe: BlenderBot on MuDoConv-format data with accelerate (+ DeepSpeed).

Run with ``accelerate launch --config_file configs/accelerate/<name>.yaml -m finetune ...`` or,
on one process, ``python -m finetune ...``. ``train()`` is one straight path of four steps:

- ``setup``: the checkpoint to resume from is chosen and verified, data and model are loaded and
  checked (a bad file or model id fails before the run writes anything but ``phase`` events and
  its error), the accelerator prepares model, optimizer, scheduler and loaders, the checkpoint
  is restored when resuming, and the ``start`` event is written;
- ``train_epoch``: optimizer steps, with periodic logging, checks and checkpoints;
- ``evaluate_epoch``: each epoch ends with an evaluation (and a checkpoint, except the last epoch;
  one checkpoint per step, also when a checkpoint step ends an epoch);
- ``finish``: the final model, all_results.json, the ``done`` event, the Hub push if asked.

With ``--objective dpo|kto`` the same path trains on preference rows: ``finetune/preference_train.py``
holds what differs (its loaders, reference log-probabilities, loss and evaluation: ``run.prefs``).

The pieces it puts together are in ``finetune/parts.py``. ``python -m finetune`` runs it through
``finetune/cli.py``, which turns every failure that ends a run into one ``error`` event in
metrics.jsonl (``cli.error_event`` lists its fields).
"""

from __future__ import annotations

import contextlib
import json
import os
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import datasets
import torch
import transformers
from accelerate import Accelerator
from accelerate.logging import get_logger
from accelerate.utils import set_seed
from torch.utils.data import DataLoader
from tqdm.auto import tqdm
from transformers import AutoConfig

from chat.layout import RESULTS_FILE
from chat.model import configure_attention, load_model, load_tokenizer, resolve
from finetune import checkpoint as ckpt
from finetune import lora, packing, preference_train
from finetune.config import TrainConfig
from finetune.data import load_raw, tokenize
from finetune.evaluate import evaluate_all, scores
from finetune.hub import push
from finetune.memory import resolve_batch
from finetune.parts import (
    LossWindow,
    StopRequest,
    TrainingError,
    check_compiler,
    check_output_dir,
    connecting_phase,
    is_rank0,
    log_window,
    make_accelerator,
    make_loaders,
    make_optimizer,
    plan_steps,
    preparing_phase,
    save_final,
    start_profiler,
)
from finetune.writes import replace_text

log = get_logger(__name__)

# After this many consecutive non-finite losses the run stops. fp16 gets room for DeepSpeed's
# dynamic loss scale to back off (it skips overflowing steps and halves the scale).
NONFINITE_PATIENCE = {"fp16": 50}
# Stop requests and non-finite losses are checked (one small collective) at every log step and
# at least this often; in between, the CPU never waits for the GPU.
CHECK_EVERY = 10


# --------------------------------------------------------------------------- the run's state


@dataclass
class Run:
    """One run: what setup() prepared, and where the loop is. Every step of train() takes it."""

    cfg: TrainConfig
    accelerator: Accelerator
    tokenizer: Any
    model: Any
    optimizer: Any
    scheduler: Any
    train_dl: DataLoader
    eval_dl: DataLoader
    feedback_dl: DataLoader | None  # held-out feedback rows (--feedback_validation_file)
    train_samples: int
    eval_samples: int
    steps_per_epoch: int
    total_steps: int
    epochs: int
    zero_stage: int | None
    metrics: ckpt.MetricsWriter
    prefs: preference_train.Preferences | None = None  # --objective dpo|kto; None for sft
    completed: int = 0  # optimizer steps done (a resumed run starts at its checkpoint's)
    epoch: int = 0  # the epoch being trained; a checkpoint records it with `completed`
    resumed_at: int = 0
    saved_at: int = -1  # the step of the last checkpoint saved (or resumed from)
    skip_batches: int = 0  # micro-batches of its first epoch that a resumed run already trained on
    # The loss window open at the checkpoint a run resumed from, (loss sum, count) over all processes:
    # the run continues it (None: a fresh start, or a checkpoint saved before checkpoints kept it).
    carried: tuple[float, float] | None = None
    # set by begin(), right before the loop
    stop: StopRequest | None = None
    progress: Any = None
    profiler: Any = None
    window: LossWindow | None = None
    # filled by the loop
    results: dict = field(default_factory=dict)  # the last evaluation
    epoch_times: list[float] = field(default_factory=list)
    eval_times: list[float] = field(default_factory=list)
    stopped: bool = False

    @property
    def main(self) -> bool:
        return self.accelerator.is_main_process

    @property
    def patience(self) -> int:
        return NONFINITE_PATIENCE.get(self.accelerator.mixed_precision, 1)


# --------------------------------------------------------------------------- the steps of train()


def train(cfg: TrainConfig) -> dict:
    """Fine-tune as ``cfg`` says. Returns the final results, or {"stopped_at": step} when a stop
    was requested (the run then ends with a checkpoint to resume from)."""
    run = setup(cfg)
    run.model.train()
    for epoch in range(run.epoch, run.epochs):
        if train_epoch(run, epoch) or evaluate_epoch(run, epoch):
            break  # stopped
    return finish(run)


def setup(cfg: TrainConfig) -> Run:
    """Load and check data and model, prepare everything for the accelerator, restore the
    checkpoint when resuming, and announce the run: the loop starts right after."""
    check_output_dir(cfg)
    # What setup is doing, for the app (a silent start can take minutes): `phase` events.
    metrics = ckpt.MetricsWriter(cfg.output_dir, enabled=is_rank0())

    def phase(text: str) -> None:
        with contextlib.suppress(OSError):  # an unwritable --output_dir fails where it did before
            metrics.write("phase", phase=text)

    resume_from = None
    if cfg.resume_from_checkpoint:  # a missing or corrupt checkpoint fails now, not after minutes of loading
        # (before the accelerator: every rank checks the same files and reaches the same choice)
        resume_from = ckpt.choose_checkpoint(
            cfg.output_dir,
            cfg.resume_from_checkpoint,
            processes=int(os.environ.get("WORLD_SIZE", "1")),
            metrics=metrics,
        )
    # Data and model first: a bad file or model id fails here, before the run writes anything
    # but its phases and its error event.
    check_compiler()  # DeepSpeed on the CPU builds an op at its first run: fail now if it cannot
    phase("loading the tokenizer")
    tokenizer = load_tokenizer(cfg.model_name_or_path)
    phase("loading data")
    raw = load_raw(cfg)
    prefs = preference_train.load(cfg, tokenizer)  # the preference rows (None for sft)
    phase(connecting_phase())  # waits for every rank to get here (and, the first time, a DeepSpeed op build)
    accelerator = make_accelerator(cfg)
    if not accelerator.is_local_main_process:
        datasets.utils.logging.set_verbosity_error()
        transformers.utils.logging.set_verbosity_error()
    set_seed(cfg.seed)
    source = lora.prepare(cfg)  # the model, or a LoRA run's base (a finished adapter's, continuing it)
    positions = AutoConfig.from_pretrained(resolve(source)).max_position_embeddings
    if positions < max(cfg.max_source_length, cfg.max_target_length):
        raise TrainingError(f"--max_source_length/--max_target_length exceed the model's {positions} positions")
    phase("tokenizing")
    with accelerator.main_process_first():
        data = tokenize(raw, tokenizer, cfg)
    phase("loading the model")
    # After the accelerator exists, so ZeRO-3 can partition the weights as they load.
    model = load_model(source, attn_implementation=configure_attention(cfg.attention))
    if cfg.adapter == "lora":
        model = lora.wrap(model, cfg, source)  # the base frozen; only the LoRA pairs train
    cfg.per_device_train_batch_size = resolve_batch(cfg, accelerator, model)  # 'auto': the largest that fits
    train_dl, eval_dl, feedback_dl = make_loaders(accelerator, data, tokenizer, cfg, model.config, prefs)
    if cfg.packs:
        packing.install(model)  # hooks that apply packed batches' masks and positions
    train_rows = len(prefs.train if prefs else data["train"])
    steps_per_epoch, total_steps, epochs = plan_steps(train_rows, accelerator, cfg)
    optimizer, scheduler = make_optimizer(accelerator, model, cfg, total_steps)
    phase(preparing_phase(accelerator))
    model, optimizer, train_dl, eval_dl, scheduler, *held = accelerator.prepare(
        model, optimizer, train_dl, eval_dl, scheduler, *[dl for dl in (feedback_dl,) if dl is not None]
    )
    if prefs:  # the reference: the model as the run starts (before a checkpoint is restored)
        phase("computing the reference log-probabilities")
        prefs.prepare(accelerator, model, cfg)
    ds = accelerator.state.deepspeed_plugin
    run = Run(
        cfg,
        accelerator,
        tokenizer,
        model,
        optimizer,
        scheduler,
        train_dl,
        eval_dl,
        held[0] if held else None,
        train_samples=train_rows,
        eval_samples=len(data["validation"]),
        steps_per_epoch=steps_per_epoch,
        total_steps=total_steps,
        epochs=epochs,
        zero_stage=ds.deepspeed_config["zero_optimization"]["stage"] if ds else None,
        metrics=ckpt.MetricsWriter(cfg.output_dir, enabled=accelerator.is_main_process),
        prefs=prefs,
    )
    if resume_from:
        phase("restoring a checkpoint")
        restore(run, resume_from)
    begin(run)
    if prefs and not resume_from:  # BLEU and preference accuracy before the first step
        preference_train.start_evaluation(run)
    return run


def restore(run: Run, path: Path) -> None:
    """Load a checkpoint's full state (weights, optimizer, scheduler, RNGs) and continue where it was.
    Nothing between here and the loop may draw from the global RNG, or the resumed run differs."""
    # (choose_checkpoint checked that it parses and has completed_steps)
    state = json.loads((path / ckpt.STATE_FILE).read_text())
    lora.check_resume(state, run.accelerator.unwrap_model(run.model), path)
    run.accelerator.load_state(str(path), **lora.load_kwargs(run.cfg, run.zero_stage))
    run.completed = run.resumed_at = run.saved_at = state["completed_steps"]
    run.epoch, done_in_epoch = divmod(run.completed, run.steps_per_epoch)
    run.skip_batches = done_in_epoch * run.cfg.gradient_accumulation_steps
    run.carried = ckpt.saved_window(state)
    if run.prefs:
        run.prefs.restored(state)
    log.info(f"resuming from {path} at step {run.completed}")
    if run.carried is None:
        log.info(f"{path} saved no loss window (an older version's): the loss curve starts a new one at the resume")


def begin(run: Run) -> None:
    """Profiler, trackers, the ``start`` event, stop handling and the progress bar."""
    cfg, acc = run.cfg, run.accelerator
    # Before the start event: an unwritable --profile_dir is a failed start, which does not
    # block running the same command again (check_output_dir).
    run.profiler = start_profiler(cfg.profile_dir) if cfg.profile_dir and run.main else None
    if cfg.with_tracking:
        acc.init_trackers(cfg.report_name, config=cfg.tracker_config())
    global_batch = cfg.per_device_train_batch_size * acc.num_processes * cfg.gradient_accumulation_steps
    run.metrics.write(
        "start",
        total_steps=run.total_steps,
        epochs=run.epochs,
        steps_per_epoch=run.steps_per_epoch,
        resumed_at=run.completed,
        num_processes=acc.num_processes,
        distributed=acc.distributed_type.value,
        zero_stage=run.zero_stage,
        mixed_precision=acc.mixed_precision,
        global_batch_size=global_batch,
        train_samples=run.train_samples,
        eval_samples=run.eval_samples,
        # weights + optimizer state before any activation: the fixed part of GPU memory
        gpu_mem_static_gib=torch.cuda.memory_allocated() / 2**30 if torch.cuda.is_available() else None,
    )
    log.info(
        f"{run.train_samples} train / {run.eval_samples} eval rows, {acc.num_processes} processes, "
        f"{acc.distributed_type} (ZeRO stage {run.zero_stage}), {run.total_steps} steps, "
        f"global batch {global_batch}"
    )
    run.stop = StopRequest(cfg.output_dir)
    run.progress = tqdm(  # on a terminal only: in a log file, log_window's line says the same
        total=run.total_steps,
        initial=run.completed,
        desc="training",
        disable=not acc.is_local_main_process or not sys.stderr.isatty(),
    )
    # One rank carries the checkpoint's window: log_window sums the processes' windows.
    run.window = LossWindow.on(acc.device, carried=run.carried if run.main else None)


def train_epoch(run: Run, epoch: int) -> bool:
    """Optimizer steps until the epoch's data or the run's steps run out. True if the run stopped."""
    run.epoch = epoch
    run.train_dl.set_epoch(epoch)
    batches = run.train_dl
    if run.skip_batches:  # a resumed run's first epoch: what its checkpoint already trained on
        batches = run.accelerator.skip_first_batches(run.train_dl, run.skip_batches)
        run.skip_batches = 0
    epoch_start = time.perf_counter()
    for batch in batches:
        finite = forward_backward(run, batch)
        if not run.accelerator.sync_gradients:
            continue  # accumulating: the optimizer step comes with a later micro-batch
        run.completed += 1
        run.progress.update(1)
        if run.profiler:
            run.profiler.step()
        window = run.window
        window.bad_run = torch.where(finite, 0.0, window.bad_run + 1)
        window.worst_bad_run = torch.maximum(window.worst_bad_run, window.bad_run)
        if check(run, epoch):
            return True
        if run.completed >= run.total_steps:
            break
    run.epoch_times.append(time.perf_counter() - epoch_start)
    return False


def forward_backward(run: Run, batch) -> torch.Tensor:
    """One micro-batch: forward, backward, and the optimizer step once the accumulation is
    complete. Adds the loss to the window; returns whether it was finite (a device tensor)."""
    cfg, acc = run.cfg, run.accelerator
    with acc.accumulate(run.model), packing.packed(batch) as inputs:
        try:
            loss = run.prefs.loss(run.model, inputs) if run.prefs else run.model(**inputs).loss
            acc.backward(loss)
            run.optimizer.step()
            run.scheduler.step()
            run.optimizer.zero_grad()
        except torch.cuda.OutOfMemoryError:
            raise TrainingError(
                f"CUDA out of memory at --per_device_train_batch_size {cfg.per_device_train_batch_size} "
                f"(source {cfg.max_source_length} / target {cfg.max_target_length} tokens). Try a smaller batch "
                "with --gradient_accumulation_steps to keep the effective batch, fp16/bf16, or ZeRO-3 + offload "
                "(configs/accelerate/zero3_offload.yaml).",
                step=run.completed,
            ) from None
    window = run.window
    window.samples += packing.samples_in(batch) * acc.num_processes
    value = loss.detach().float()
    finite = torch.isfinite(value)
    window.sums += torch.stack([torch.where(finite, value, 0.0), finite.float()])
    return finite


def check(run: Run, epoch: int) -> bool:
    """After an optimizer step: at log steps, checkpoint steps and every CHECK_EVERY steps, agree
    on stop requests and non-finite losses, then log, stop or save. True if the run stopped."""
    cfg, acc, step = run.cfg, run.accelerator, run.completed
    # The first step is logged too: it shows the run is alive (and when it got going). After a
    # resume that continues its checkpoint's loss window, that log is `partial` (not a point of
    # the curve), so the curve is the uninterrupted run's.
    on_curve = step % cfg.logging_steps == 0 or step == run.total_steps
    log_now = on_curve or step == run.resumed_at + 1
    save_now = bool(cfg.checkpointing_steps) and step % cfg.checkpointing_steps == 0
    # (a checkpoint is only written right after a check, so it never holds a non-finite step)
    if not (log_now or save_now or step % CHECK_EVERY == 0 or step >= run.total_steps):
        return False
    # One small collective keeps every rank's decisions (stop, give up) identical.
    stop_flag = torch.tensor(float(run.stop()), device=acc.device)
    stop_requested, bad_steps = acc.reduce(torch.stack([stop_flag, run.window.worst_bad_run]), "max").tolist()
    run.window.worst_bad_run.zero_()
    if bad_steps >= run.patience:
        raise TrainingError(
            f"the loss was not finite for {int(bad_steps)} step(s) up to step {step}: lower --learning_rate, "
            "add --num_warmup_steps, or use bf16 instead of fp16. Last good checkpoint: "
            f"{(ckpt.list_checkpoints(cfg.output_dir) or ['none'])[-1]}",
            step=step,
        )
    if log_now:
        log_window(run, epoch, partial=not on_curve and run.carried is not None)
    if stop_requested > 0:
        stop_here(
            run, f"stop requested: saved a checkpoint at step {step}; resume with --resume_from_checkpoint latest"
        )
        return True
    if save_now:
        checkpoint(run)
    return False


def checkpoint(run: Run) -> None:
    """Save the training state at this step, once: a checkpoint step can also end an epoch."""
    if run.saved_at == run.completed:
        return
    # The open loss window goes with it (a collective: every rank saves), for a resume to continue.
    loss_sum, count = run.accelerator.reduce(run.window.sums, "sum").tolist()
    state = {"completed_steps": run.completed, "epoch": run.epoch, ckpt.WINDOW: {"loss_sum": loss_sum, "count": count}}
    state.update(lora.checkpoint_state(run.accelerator.unwrap_model(run.model)))  # (a LoRA run's base)
    state.update(run.prefs.state() if run.prefs else {})  # (a preference run's start figures)
    kwargs = lora.save_kwargs(run.cfg, run.zero_stage)  # a LoRA checkpoint leaves the frozen base out
    path = ckpt.save_checkpoint(run.accelerator, run.cfg.output_dir, state, run.cfg.checkpoints_total_limit, **kwargs)
    run.saved_at = run.completed
    run.metrics.write("checkpoint", step=run.completed, path=str(path))


def stop_here(run: Run, message: str) -> None:
    """A stop was requested: save a checkpoint to resume from and end the run without a final model."""
    checkpoint(run)
    run.metrics.write("stopped", step=run.completed)
    log.info(message)
    run.stopped = True


def evaluate_epoch(run: Run, epoch: int) -> bool:
    """Evaluate, write the ``eval`` event, checkpoint unless this is the last epoch. True if the run stopped."""
    cfg, acc = run.cfg, run.accelerator
    zero3, loaders = run.zero_stage == 3, (run.eval_dl, run.feedback_dl)
    results = evaluate_all(acc, run.model, loaders, run.tokenizer, cfg, zero3=zero3, should_stop=run.stop)
    if results is None:  # stop requested mid-evaluation: keep the trained steps, skip this eval
        stop_here(run, f"stop requested during evaluation: saved a checkpoint at step {run.completed}")
        return True
    if run.prefs:
        results.update(run.prefs.evaluate(acc, run.model))  # eval_pref_accuracy, eval_pref_margin
    run.results = results
    run.eval_times.append(results["eval_seconds"])
    train_seconds = run.epoch_times[-1]
    for sample in results["samples"][:5]:  # all of them go to metrics.jsonl
        log.info(
            f"prompt: {sample['prompt']!r} | prediction: {sample['prediction']!r} | reference: {sample['reference']!r}"
        )
    figures = {
        "eval_bleu": results["eval_bleu"],
        "eval_loss": results["eval_loss"],
        **scores(results),  # per kind, held-out feedback
        "train_epoch_seconds": train_seconds,
        "eval_epoch_seconds": results["eval_seconds"],
    }
    run.metrics.write("eval", step=run.completed, epoch=epoch, **figures, samples=results["samples"][:20])
    log.info(
        f"epoch {epoch}: {preference_train.describe(figures)}, eval loss {results['eval_loss']:.4f}, "
        f"train {train_seconds:.1f}s, eval {results['eval_seconds']:.1f}s"
    )
    if cfg.with_tracking:
        acc.log(figures, step=run.completed)
    if run.completed < run.total_steps:  # the last epoch's state is the final model (finish)
        checkpoint(run)
    return False


def finish(run: Run) -> dict:
    """Unless stopped: the final model, all_results.json, the ``done`` event and the Hub push.
    Returns the summary that all_results.json holds ({"stopped_at": step} when stopped)."""
    cfg, acc, results = run.cfg, run.accelerator, run.results
    run.progress.close()
    if run.profiler:  # a run that ends inside steps 3-5 writes the steps it recorded
        run.profiler.stop()
    if run.stopped:
        acc.end_training()
        return {"stopped_at": run.completed}
    summary = {
        "eval_bleu": results["eval_bleu"],
        "eval_loss": results["eval_loss"],
        "eval_samples": results["eval_samples"],
        **scores(results),
        "train_samples": run.train_samples,
        "total_steps": run.completed,
        "train_epoch_seconds": run.epoch_times,
        "eval_epoch_seconds": run.eval_times,
        "num_processes": acc.num_processes,
        "zero_stage": run.zero_stage,
        **(run.prefs.summary(results) if run.prefs else {}),
    }
    final = save_final(acc, run.model, run.tokenizer, cfg, summary) if cfg.save_model else None
    if run.main:
        replace_text(Path(cfg.output_dir) / RESULTS_FILE, json.dumps(summary, indent=2))  # WriteError if it fails
        run.metrics.write(
            "done", step=run.completed, final=str(final) if final else None, eval_bleu=summary["eval_bleu"]
        )
        log.info(
            f"final model in {final} (BLEU {summary['eval_bleu']:.2f})"
            if final
            else f"done, final model not saved (--save_model false); BLEU {summary['eval_bleu']:.2f}"
        )
    acc.end_training()
    if cfg.push_to_hub and run.main:
        url = push(final, cfg.hub_model_id, private=cfg.hub_private)  # a HubError: cli.main() records it
        run.metrics.write("pushed", repo=cfg.hub_model_id, url=url)
        log.info(f"pushed to {url}")
    return summary
