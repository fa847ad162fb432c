"""The training recipe: BlenderBot on MuDoConv-format data with accelerate (+ DeepSpeed).

Run with ``accelerate launch --config_file configs/accelerate/<name>.yaml -m finetune ...`` or,
on one process, ``python -m finetune ...``. The straight path: data and model are loaded and
checked (nothing is written before that), the accelerator prepares everything, the loop trains
with periodic logging and checkpoints, each epoch ends with an evaluation, and the final model
is saved (and pushed to the Hub if asked).
"""

from __future__ import annotations

import json
import logging
import math
import os
import signal
import sys
import tempfile
import time
from pathlib import Path

import datasets
import torch
import transformers
from accelerate import Accelerator
from accelerate.logging import get_logger
from accelerate.utils import DataLoaderConfiguration, DummyOptim, DummyScheduler, InitProcessGroupKwargs, set_seed
from torch.utils.data import DataLoader
from tqdm.auto import tqdm
from transformers import AutoConfig, DataCollatorForSeq2Seq, get_scheduler

from chat.layout import FINAL, RESULTS_FILE, TRAINING_ARGS_FILE
from finetune import checkpoint as ckpt
from finetune.config import TrainConfig, parse_args
from finetune.data import DataError, LengthGroupedSampler, load_raw, row_lengths, tokenize
from finetune.evaluate import evaluate, generation_kwargs
from finetune.hub import HubError, push, write_model_card
from chat.model import ModelLoadError, configure_attention, load_model, load_tokenizer, resolve

log = get_logger(__name__)

# After this many consecutive non-finite losses the run stops. fp16 gets room for DeepSpeed's
# dynamic loss scale to back off (it skips overflowing steps and halves the scale).
NONFINITE_PATIENCE = {"fp16": 50}
# Stop requests and non-finite losses are checked (one small collective) at every log step and
# at least this often; in between, the CPU never waits for the GPU.
CHECK_EVERY = 10


class TrainingError(RuntimeError):
    """A run cannot go on (out of memory, non-finite loss, bad output dir); the message says why."""


def make_accelerator(cfg: TrainConfig) -> Accelerator:
    handlers = []
    launched_deepspeed = os.environ.get("ACCELERATE_USE_DEEPSPEED") == "true" and "LOCAL_RANK" in os.environ
    if launched_deepspeed and not torch.cuda.is_available():
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


def check_output_dir(cfg: TrainConfig) -> None:
    out = Path(cfg.output_dir)
    if cfg.resume_from_checkpoint is None and (out / ckpt.METRICS_FILE).exists():
        raise TrainingError(
            f"{out} already holds a run; pass --resume_from_checkpoint latest to continue it, "
            "or choose another --output_dir"
        )


def make_optimizer(accelerator, model, cfg, total_steps: int):
    """DeepSpeed's own optimizer/scheduler when its JSON defines them, torch/transformers otherwise."""
    ds = accelerator.state.deepspeed_plugin
    ds_cfg = ds.deepspeed_config if ds else {}
    no_decay = ("bias", "layer_norm.weight", "layernorm_embedding.weight")
    groups = [
        {"params": [p for n, p in model.named_parameters() if not n.endswith(no_decay)], "weight_decay": cfg.weight_decay},
        {"params": [p for n, p in model.named_parameters() if n.endswith(no_decay)], "weight_decay": 0.0},
    ]
    if "optimizer" in ds_cfg:
        optimizer = DummyOptim(groups, lr=cfg.learning_rate, weight_decay=cfg.weight_decay)
    else:
        optimizer = torch.optim.AdamW(groups, lr=cfg.learning_rate, fused=torch.cuda.is_available())
    # accelerate expects schedules counted in per-process steps (it divides DeepSpeed's total
    # by the process count and steps a torch scheduler once per process), hence the scaling.
    if "scheduler" in ds_cfg:
        scheduler = DummyScheduler(optimizer, total_num_steps=total_steps * accelerator.num_processes,
                                   warmup_num_steps=cfg.num_warmup_steps)
    else:
        scheduler = get_scheduler(
            cfg.lr_scheduler_type, optimizer,
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
        raise TrainingError(f"--profile_dir {folder}: cannot write there ({err.strerror or err})") from None
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

    profiler = torch.profiler.profile(activities=activities, on_trace_ready=write,
                                      schedule=torch.profiler.schedule(wait=2, warmup=0, active=3, repeat=1))
    profiler.start()
    return profiler


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
    """save_pretrained (safetensors, full fp32 weights even under ZeRO) + everything chat needs."""
    state_dict = accelerator.get_state_dict(model)  # every rank: ZeRO-3 gathers shards here
    dest = Path(cfg.output_dir) / FINAL
    if accelerator.is_main_process:
        tmp = Path(tempfile.mkdtemp(dir=cfg.output_dir, prefix=".final-"))
        tmp.chmod(0o755)  # mkdtemp makes it private; the app and a Space serve from it
        state_dict = {k: v.float() if v.is_floating_point() else v for k, v in state_dict.items()}
        unwrapped = accelerator.unwrap_model(model)
        unwrapped.save_pretrained(tmp, state_dict=state_dict, safe_serialization=True)
        tokenizer.save_pretrained(tmp)
        gen = unwrapped.generation_config
        for key, value in generation_kwargs(cfg).items():
            setattr(gen, key, value)
        gen.save_pretrained(tmp)
        (tmp / TRAINING_ARGS_FILE).write_text(json.dumps(cfg.to_dict(), indent=2))
        (tmp / RESULTS_FILE).write_text(json.dumps(results, indent=2))
        write_model_card(tmp, cfg, results, accelerator.num_processes)
        ckpt.publish_dir(tmp, dest)
    accelerator.wait_for_everyone()
    return dest


def train(cfg: TrainConfig) -> dict:
    check_output_dir(cfg)
    # Data and model first: a bad file or model id fails here, before anything is written.
    tokenizer = load_tokenizer(cfg.model_name_or_path)
    raw = load_raw(cfg)
    accelerator = make_accelerator(cfg)
    main = accelerator.is_main_process
    if not accelerator.is_local_main_process:
        datasets.utils.logging.set_verbosity_error()
        transformers.utils.logging.set_verbosity_error()
    set_seed(cfg.seed)
    positions = AutoConfig.from_pretrained(resolve(cfg.model_name_or_path)).max_position_embeddings
    if positions < max(cfg.max_source_length, cfg.max_target_length):
        raise TrainingError(f"--max_source_length/--max_target_length exceed the model's {positions} positions")
    with accelerator.main_process_first():
        data = tokenize(raw, tokenizer, cfg)
    # After the accelerator exists, so ZeRO-3 can partition the weights as they load.
    model = load_model(cfg.model_name_or_path, attn_implementation=configure_attention(cfg.attention))

    pad_multiple = 8 if accelerator.mixed_precision != "no" else None
    collator = DataCollatorForSeq2Seq(tokenizer, label_pad_token_id=-100, pad_to_multiple_of=pad_multiple)
    # Collating hundreds of rows per step in Python would leave the GPU waiting: workers do it.
    workers = cfg.dataloader_num_workers if cfg.dataloader_num_workers is not None else (2 if torch.cuda.is_available() else 0)
    loader_kwargs = dict(collate_fn=collator, num_workers=workers, pin_memory=torch.cuda.is_available())
    # Each loader gets its own generator: creating an iterator must not draw from the global RNG,
    # or a resumed run (which creates it after restoring RNG states) would see different dropout.
    if cfg.group_by_length and not cfg.pad_to_max_length:
        group = cfg.per_device_train_batch_size * accelerator.num_processes  # one step's rows on all processes
        order = dict(sampler=LengthGroupedSampler(row_lengths(data["train"]), group, cfg.seed))
    else:
        order = dict(shuffle=True)
    train_dl = DataLoader(data["train"], batch_size=cfg.per_device_train_batch_size, **order, **loader_kwargs,
                          generator=torch.Generator().manual_seed(cfg.seed))
    eval_dl = DataLoader(data["validation"], batch_size=cfg.per_device_eval_batch_size, **loader_kwargs,
                         generator=torch.Generator().manual_seed(cfg.seed))

    # Steps per epoch as the prepared (sharded) loader will have them.
    batches = math.ceil(math.ceil(len(train_dl.dataset) / cfg.per_device_train_batch_size) / accelerator.num_processes)
    steps_per_epoch = math.ceil(batches / cfg.gradient_accumulation_steps)
    total_steps = cfg.max_train_steps or cfg.num_train_epochs * steps_per_epoch
    epochs = math.ceil(total_steps / steps_per_epoch)
    optimizer, scheduler = make_optimizer(accelerator, model, cfg, total_steps)
    model, optimizer, train_dl, eval_dl, scheduler = accelerator.prepare(model, optimizer, train_dl, eval_dl, scheduler)
    ds = accelerator.state.deepspeed_plugin
    zero_stage = ds.deepspeed_config["zero_optimization"]["stage"] if ds else None

    completed, first_epoch, skip_batches = 0, 0, 0
    if cfg.resume_from_checkpoint:
        path = ckpt.find_checkpoint(cfg.output_dir, cfg.resume_from_checkpoint)
        accelerator.load_state(str(path))
        completed = json.loads((path / ckpt.STATE_FILE).read_text())["completed_steps"]
        first_epoch, done_in_epoch = divmod(completed, steps_per_epoch)
        skip_batches = done_in_epoch * cfg.gradient_accumulation_steps
        log.info(f"resuming from {path} at step {completed}")
    resumed_at = completed

    metrics = ckpt.MetricsWriter(cfg.output_dir, enabled=main)
    if cfg.with_tracking:
        accelerator.init_trackers(cfg.report_name, config={k: v for k, v in cfg.to_dict().items() if v is not None})
    global_batch = cfg.per_device_train_batch_size * accelerator.num_processes * cfg.gradient_accumulation_steps
    metrics.write("start", total_steps=total_steps, epochs=epochs, steps_per_epoch=steps_per_epoch,
                  resumed_at=completed, num_processes=accelerator.num_processes, distributed=accelerator.distributed_type.value,
                  zero_stage=zero_stage, mixed_precision=accelerator.mixed_precision, global_batch_size=global_batch,
                  train_samples=len(data["train"]), eval_samples=len(data["validation"]),
                  # weights + optimizer state before any activation: the fixed part of GPU memory
                  gpu_mem_static_gib=torch.cuda.memory_allocated() / 2**30 if torch.cuda.is_available() else None)
    log.info(f"{len(data['train'])} train / {len(data['validation'])} eval rows, {accelerator.num_processes} processes, "
             f"{accelerator.distributed_type} (ZeRO stage {zero_stage}), {total_steps} steps, global batch {global_batch}")

    stop = StopRequest(cfg.output_dir)
    patience = NONFINITE_PATIENCE.get(accelerator.mixed_precision, 1)
    progress = tqdm(total=total_steps, initial=completed, desc="training", disable=not accelerator.is_local_main_process)
    state = dict(completed_steps=completed, epoch=first_epoch)
    results, epoch_times, eval_times = {}, [], []
    # Loss sums and non-finite counts stay on the GPU between checks: reading them every step
    # would make the CPU wait for the GPU each step instead of queueing the next one.
    window = torch.zeros(2, device=accelerator.device)  # (sum of finite losses, count)
    bad_run = torch.zeros((), device=accelerator.device)  # consecutive steps with a non-finite loss
    worst_bad_run = torch.zeros((), device=accelerator.device)  # longest such run since the last check
    window_start, window_samples = time.perf_counter(), 0
    stopped = False

    def checkpoint():
        path = ckpt.save_checkpoint(accelerator, cfg.output_dir, state, cfg.checkpoints_total_limit)
        metrics.write("checkpoint", step=completed, path=str(path))

    profiler = start_profiler(cfg.profile_dir) if cfg.profile_dir and main else None
    model.train()
    for epoch in range(first_epoch, epochs):
        state["epoch"] = epoch
        train_dl.set_epoch(epoch)
        active = accelerator.skip_first_batches(train_dl, skip_batches) if skip_batches else train_dl
        skip_batches = 0
        epoch_start = time.perf_counter()
        for batch in active:
            with accelerator.accumulate(model):
                try:
                    loss = model(**batch).loss
                    accelerator.backward(loss)
                    optimizer.step()
                    scheduler.step()
                    optimizer.zero_grad()
                except torch.cuda.OutOfMemoryError:
                    metrics.write("error", step=completed, message="CUDA out of memory")
                    raise TrainingError(
                        f"CUDA out of memory at --per_device_train_batch_size {cfg.per_device_train_batch_size} "
                        f"(source {cfg.max_source_length} / target {cfg.max_target_length} tokens). Try a smaller batch "
                        "with --gradient_accumulation_steps to keep the effective batch, fp16/bf16, or ZeRO-3 + offload "
                        "(configs/accelerate/zero3_offload.yaml)."
                    ) from None
            window_samples += batch["input_ids"].shape[0] * accelerator.num_processes
            value = loss.detach().float()
            finite = torch.isfinite(value)
            window += torch.stack([torch.where(finite, value, 0.0), finite.float()])
            if not accelerator.sync_gradients:
                continue
            completed += 1
            state["completed_steps"] = completed
            progress.update(1)
            if profiler:
                profiler.step()
            bad_run = torch.where(finite, 0.0, bad_run + 1)
            worst_bad_run = torch.maximum(worst_bad_run, bad_run)
            # The first step is logged too: it shows the run is alive (and when it got going).
            log_now = completed % cfg.logging_steps == 0 or completed == total_steps or completed == resumed_at + 1
            save_now = bool(cfg.checkpointing_steps) and completed % cfg.checkpointing_steps == 0
            # (a checkpoint is only written right after a check, so it never holds a non-finite step)
            if not (log_now or save_now or completed % CHECK_EVERY == 0 or completed >= total_steps):
                continue
            # One small collective keeps every rank's decisions (stop, give up) identical.
            flags = accelerator.reduce(torch.stack([torch.tensor(float(stop()), device=accelerator.device),
                                                    worst_bad_run]), "max").tolist()
            worst_bad_run.zero_()
            if flags[1] >= patience:
                metrics.write("error", step=completed, message="non-finite loss")
                raise TrainingError(
                    f"the loss was not finite for {int(flags[1])} step(s) up to step {completed}: lower --learning_rate, "
                    "add --num_warmup_steps, or use bf16 instead of fp16. Last good checkpoint: "
                    f"{(ckpt.list_checkpoints(cfg.output_dir) or ['none'])[-1]}"
                )
            if log_now:
                loss_sum, count = accelerator.reduce(window, "sum").tolist()
                elapsed = time.perf_counter() - window_start
                entry = dict(step=completed, epoch=round(epoch + (completed - epoch * steps_per_epoch) / steps_per_epoch, 4),
                             loss=loss_sum / max(count, 1), lr=scheduler.get_last_lr()[0],
                             samples_per_second=window_samples / elapsed)
                if torch.cuda.is_available():
                    entry["gpu_mem_gib"] = torch.cuda.max_memory_allocated() / 2**30
                metrics.write("log", **entry)
                progress.set_postfix(loss=f"{entry['loss']:.4f}")
                if cfg.with_tracking:
                    accelerator.log({"train_loss": entry["loss"], "lr": entry["lr"],
                                     "samples_per_second": entry["samples_per_second"]}, step=completed)
                window.zero_()
                window_start, window_samples = time.perf_counter(), 0
            if flags[0] > 0:
                checkpoint()
                metrics.write("stopped", step=completed)
                log.info(f"stop requested: saved a checkpoint at step {completed}; resume with --resume_from_checkpoint latest")
                stopped = True
                break
            if save_now:
                checkpoint()
            if completed >= total_steps:
                break
        if stopped:
            break
        epoch_times.append(time.perf_counter() - epoch_start)
        evaluated = evaluate(accelerator, model, eval_dl, tokenizer, cfg, zero3=zero_stage == 3, should_stop=stop)
        if evaluated is None:  # stop requested mid-evaluation: keep the trained steps, skip this eval
            checkpoint()
            metrics.write("stopped", step=completed)
            log.info(f"stop requested during evaluation: saved a checkpoint at step {completed}")
            stopped = True
            break
        results = evaluated
        eval_times.append(results["eval_seconds"])
        for sample in results["samples"][:5]:  # all of them go to metrics.jsonl
            log.info(f"prompt: {sample['prompt']!r} | prediction: {sample['prediction']!r} | reference: {sample['reference']!r}")
        metrics.write("eval", step=completed, epoch=epoch, eval_bleu=results["eval_bleu"], eval_loss=results["eval_loss"],
                      train_epoch_seconds=epoch_times[-1], eval_epoch_seconds=results["eval_seconds"],
                      samples=results["samples"][:20])
        log.info(f"epoch {epoch}: BLEU {results['eval_bleu']:.2f}, eval loss {results['eval_loss']:.4f}, "
                 f"train {epoch_times[-1]:.1f}s, eval {results['eval_seconds']:.1f}s")
        if cfg.with_tracking:
            accelerator.log({"eval_bleu": results["eval_bleu"], "eval_loss": results["eval_loss"],
                             "train_epoch_seconds": epoch_times[-1], "eval_epoch_seconds": results["eval_seconds"]}, step=completed)
        if completed < total_steps:  # the last epoch's state is the final model below
            checkpoint()
    progress.close()
    if profiler:  # a run that ends inside steps 3-5 writes the steps it recorded
        profiler.stop()
    if stopped:
        accelerator.end_training()
        return {"stopped_at": completed}

    summary = dict(eval_bleu=results["eval_bleu"], eval_loss=results["eval_loss"], eval_samples=results["eval_samples"],
                   train_samples=len(data["train"]), total_steps=completed, train_epoch_seconds=epoch_times,
                   eval_epoch_seconds=eval_times, num_processes=accelerator.num_processes, zero_stage=zero_stage)
    final = save_final(accelerator, model, tokenizer, cfg, summary) if cfg.save_model else None
    if main:
        (Path(cfg.output_dir) / RESULTS_FILE).write_text(json.dumps(summary, indent=2))
        metrics.write("done", step=completed, final=str(final) if final else None, eval_bleu=summary["eval_bleu"])
        log.info(f"final model in {final} (BLEU {summary['eval_bleu']:.2f})" if final
                 else f"done, final model not saved (--save_model false); BLEU {summary['eval_bleu']:.2f}")
    accelerator.end_training()
    if cfg.push_to_hub and main:
        try:
            url = push(final, cfg.hub_model_id, private=cfg.hub_private)
        except HubError as err:
            metrics.write("error", message=str(err))
            raise
        metrics.write("pushed", repo=cfg.hub_model_id, url=url)
        log.info(f"pushed to {url}")
    return summary


def main(argv: list[str] | None = None) -> int:
    is_main = os.environ.get("RANK", "0") == "0"
    logging.basicConfig(format="%(asctime)s %(levelname)s %(name)s: %(message)s", datefmt="%H:%M:%S",
                        level=logging.INFO if is_main else logging.ERROR, stream=sys.stderr)
    cfg = parse_args(argv)
    try:
        train(cfg)
    except (DataError, ModelLoadError, TrainingError, HubError, FileNotFoundError) as err:
        if is_main:
            logging.getLogger("finetune").error("%s", err)
        return 1
    return 0
