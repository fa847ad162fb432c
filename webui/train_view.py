"""The Train tab's live view: what a redraw shows of the latest run (text, plots, samples, log).

Plain functions of a ``finetune.jobs.status.RunStatus``; ``live_view`` is the timer's redraw that
app.py wires to every open page (only changes are sent). The form and the actions are in
``webui.train_handlers``.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence

import gradio as gr
import pandas as pd

from finetune.jobs.status import RunStatus, bleu_parts_text
from webui.train_handlers import TrainTab, server_paths_hidden

SAMPLES_SHOWN = 5
# The log box shows this many lines, newest at the bottom: exactly its height, so the newest line
# is in view whatever the box's scroll position (the whole log is train.log in the run folder).
LOG_LINES = 12
STATE_ICONS = {"idle": "💤", "running": "🏃", "stopping": "⏳", "stopped": "⏸️", "finished": "✅", "failed": "❌"}


def format_duration(seconds: float | None) -> str:
    if seconds is None or not math.isfinite(seconds):
        return "?"
    seconds = round(seconds)
    if seconds < 60:
        return f"{seconds} s"
    minutes, seconds = divmod(seconds, 60)
    if minutes < 60:
        return f"{minutes} min {seconds:02d} s"
    hours, minutes = divmod(minutes, 60)
    return f"{hours} h {minutes:02d} min"


def progress_bar(fraction: float, width: int = 20) -> str:
    filled = round(max(0.0, min(1.0, fraction)) * width)
    return "█" * filled + "░" * (width - filled)


def run_markdown(status: RunStatus) -> str:
    """State, progress, ETA, speed, GPU memory, BLEU, error and result of the run."""
    if status.run_id is None:
        return "💤 No run yet. Fill in the form and press **Start** (or **Show command** to run it yourself)."
    lines = [f"{STATE_ICONS.get(status.state, '')} **Run {status.run_id}**: {status.state}"]
    if status.total_steps:
        lines.append(
            f"`{progress_bar(status.progress)}` step {status.step} / {status.total_steps} ({status.progress:.0%})"
        )
    if status.state == "running" and (status.phase or not status.total_steps):  # before this attempt's start
        since = status.seconds_since_launch
        lines.append(
            f"starting{f' ({format_duration(since)})' if since is not None else ''}: {status.phase or 'launching'}…"
        )
    facts = []
    if status.state == "running" and status.eta_seconds is not None:  # no countdown while it stops
        facts.append(f"ETA {format_duration(status.eta_seconds)}")
    if status.samples_per_second:
        facts.append(f"{status.samples_per_second:.1f} samples/s")
    if status.gpu_mem_gib is not None:
        facts.append(f"GPU memory {status.gpu_mem_gib:.1f} GiB")
    if status.eval_bleu is not None:
        facts.append(f"BLEU {status.eval_bleu:.2f}")
    if facts:
        lines.append(" · ".join(facts))
    if status.bleu_parts:
        lines.append(f"BLEU by kind: {bleu_parts_text(status.bleu_parts)}")
    if status.error:
        lines.append(f"⚠️ **Error:** {status.error}")
    if status.state == "finished" and status.final_dir:
        lines.append(
            f"The model is in `{status.final_dir}`: it is in the Chat tab's **Model** list now; "
            "**Push** below sends it to the Hub."
        )
    if status.state in ("stopped", "failed") and status.has_checkpoint:
        lines.append("**Resume** continues it from its last checkpoint.")
    if status.pushed_url:
        lines.append(f"⬆️ Pushed to {status.pushed_url}")
    return "\n\n".join(line for line in lines if line)


def _points(points: list[dict], y: str) -> pd.DataFrame:
    """A numeric frame even when empty: an empty frame of object columns makes gradio pick
    category axes, which it keeps for the live updates (a falling loss drawn rising)."""
    return pd.DataFrame(points, columns=["step", y]).astype({"step": "int64", y: "float64"})


def loss_frame(status: RunStatus) -> pd.DataFrame:
    return _points(status.loss_points, "loss")


def bleu_frame(status: RunStatus) -> pd.DataFrame:
    return _points(status.bleu_points, "bleu")


def samples_frame(status: RunStatus) -> pd.DataFrame:
    rows = [
        {k: str(s.get(k, "")) for k in ("prompt", "prediction", "reference")} for s in status.samples[:SAMPLES_SHOWN]
    ]
    return pd.DataFrame(rows, columns=["prompt", "prediction", "reference"])


def _signature(value) -> str:
    return value.to_json() if isinstance(value, pd.DataFrame) else repr(value)


def live_view(
    tab: TrainTab, cache: dict | None, model_updates: Sequence[Callable[[], object]] = (), visitor: bool = True
) -> tuple:
    """The timer's redraw: (cache, run text, loss, BLEU, samples, log tail, *model-list updates).

    Only what changed since this page's last redraw is sent (gr.skip() otherwise), so plots do
    not flicker and an open dropdown is not reset. ``model_updates`` make the updates of the
    model lists (the Train tab's base model, the Chat tab's picker) when the finished runs change.
    A ``visitor`` (not logged in) sees no validation rows of runs on possibly private data, and
    nobody sees the server's absolute folders."""
    status = tab.manager.status()
    if visitor:
        status = status.for_visitor()
    values = {
        "run": server_paths_hidden(run_markdown(status), tab),
        "loss": loss_frame(status),
        "bleu": bleu_frame(status),
        "samples": samples_frame(status),
        "log": server_paths_hidden("\n".join(status.log_tail.splitlines()[-LOG_LINES:]), tab),
        "finals": tuple(path for _, path in tab.manager.finished_runs()),
    }
    cache = dict(cache or {})
    changed = {}
    for key, value in values.items():
        signature = _signature(value)
        changed[key] = cache.get(key) != signature
        cache[key] = signature
    out = [values[key] if changed[key] else gr.skip() for key in ("run", "loss", "bleu", "samples", "log")]
    out += [make() if changed["finals"] else gr.skip() for make in model_updates]
    return (cache, *out)
