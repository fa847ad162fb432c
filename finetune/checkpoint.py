"""Training-state checkpoints and the final model folder, both written so a crash never
leaves a half-written folder where a good one was: write under a temporary name, then rename.

Layout of an output directory::

    metrics.jsonl             one JSON object per event (the app reads it live)
    checkpoints/step_<N>/     full training state (accelerate + DeepSpeed) + trainer_state.json
    final/                    save_pretrained model, tokenizer, training_args.json, model card
    all_results.json          eval BLEU and epoch times of the last evaluation
"""

from __future__ import annotations

import json
import shutil
import time
from pathlib import Path

CHECKPOINTS = "checkpoints"
STATE_FILE = "trainer_state.json"
METRICS_FILE = "metrics.jsonl"
STOP_FILE = "STOP"  # created by the app (or a user) to ask a run to checkpoint and stop


def list_checkpoints(output_dir: str | Path) -> list[Path]:
    """Completed step checkpoints, oldest first (temporary folders are not listed)."""
    root = Path(output_dir) / CHECKPOINTS
    found = [p for p in root.glob("step_*") if (p / STATE_FILE).is_file()]
    return sorted(found, key=lambda p: int(p.name.split("_")[1]))


class CheckpointNotFound(FileNotFoundError):
    """``--resume_from_checkpoint`` names no complete checkpoint; ``file`` is where it looked."""

    def __init__(self, message: str, file: str):
        super().__init__(message)  # (not OSError's filename: that would change the message)
        self.file = file


def find_checkpoint(output_dir: str | Path, spec: str) -> Path:
    """Resolve ``--resume_from_checkpoint``: 'latest' in output_dir, or a checkpoint path."""
    if spec == "latest":
        found = list_checkpoints(output_dir)
        if not found:
            root = Path(output_dir) / CHECKPOINTS
            raise CheckpointNotFound(f"no checkpoint to resume from in {root}", file=str(root))
        return found[-1]
    path = Path(spec)
    if not (path / STATE_FILE).is_file():
        raise CheckpointNotFound(f"{spec} is not a complete checkpoint (no {STATE_FILE})", file=spec)
    return path


def run_started(output_dir: str | Path) -> bool:
    """Did a training run start in ``output_dir``: a ``start`` event in metrics.jsonl, or a
    checkpoint? A run that failed before its start (bad data, unknown model) leaves only its
    ``error`` event, and does not count."""
    if list_checkpoints(output_dir):
        return True
    try:
        with open(Path(output_dir) / METRICS_FILE, encoding="utf-8", errors="replace") as fh:
            for line in fh:
                try:
                    event = json.loads(line)
                except ValueError:  # a line cut short by a crash
                    continue
                if isinstance(event, dict) and event.get("event") == "start":
                    return True
    except FileNotFoundError:
        pass
    return False


def save_checkpoint(accelerator, output_dir: str | Path, state: dict, keep: int) -> Path:
    """Save the full training state on every rank, then publish it with one rename."""
    root = Path(output_dir) / CHECKPOINTS
    final = root / f"step_{state['completed_steps']}"
    tmp = root / f".{final.name}.tmp"
    if accelerator.is_main_process:
        shutil.rmtree(tmp, ignore_errors=True)  # left over from a crash
        tmp.mkdir(parents=True)
    accelerator.wait_for_everyone()
    accelerator.save_state(str(tmp))
    accelerator.wait_for_everyone()
    if accelerator.is_main_process:
        (tmp / STATE_FILE).write_text(json.dumps({**state, "time": time.time()}, indent=2))
        if final.exists():  # a resumed run reaching the same step again
            shutil.rmtree(final)
        tmp.rename(final)
        for old in list_checkpoints(output_dir)[:-keep]:
            shutil.rmtree(old, ignore_errors=True)
    accelerator.wait_for_everyone()
    return final


def publish_dir(tmp: Path, dest: Path) -> None:
    """Replace ``dest`` by ``tmp``; the old folder is removed only after the new one is in place."""
    old = dest.with_name(f".{dest.name}.old")
    shutil.rmtree(old, ignore_errors=True)
    if dest.exists():
        dest.rename(old)
    tmp.rename(dest)
    shutil.rmtree(old, ignore_errors=True)


class MetricsWriter:
    """Appends one JSON line per event to metrics.jsonl (main process only), flushed at once."""

    def __init__(self, output_dir: str | Path, enabled: bool):
        self.path = Path(output_dir) / METRICS_FILE
        self.enabled = enabled

    def write(self, event: str, **fields) -> None:
        if not self.enabled:
            return
        self.path.parent.mkdir(parents=True, exist_ok=True)
        with open(self.path, "a") as fh:
            fh.write(json.dumps({"event": event, "time": round(time.time(), 3), **fields}) + "\n")
