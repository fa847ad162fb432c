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

from finetune.jobs.index import list_runs
from finetune.jobs.status import RunStatus, bleu_parts_text
from webui.train_handlers import TrainTab, server_paths_hidden

SAMPLES_SHOWN = 5
# The log box shows this many lines, newest at the bottom: exactly its height, so the newest line
# is in view whatever the box's scroll position (the whole log is train.log in the run folder).
LOG_LINES = 12
ENDED = ("stopped", "finished", "failed")
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
    if status.eval_pref_accuracy is not None:  # DPO / KTO: held-out rows where the model prefers the chosen
        facts.append(f"preference accuracy {100 * status.eval_pref_accuracy:.0f}%")
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


def pref_frame(status: RunStatus) -> pd.DataFrame:
    """The held-out preference accuracy of each evaluation, in percent (DPO / KTO runs; empty otherwise)."""
    points = [{"step": p["step"], "accuracy": 100 * p["pref_accuracy"]} for p in status.pref_points]
    return _points(points, "accuracy")


def pref_plot(height: int) -> gr.ScatterPlot:
    """The plot of held-out preference accuracy (points, like BLEU's), hidden until a run reports one."""
    return gr.ScatterPlot(
        pref_frame(RunStatus()),
        x="step",
        y="accuracy",
        y_lim=values_axis(pref_frame(RunStatus()), "accuracy"),
        title="Preference accuracy (%, held out)",
        height=height,
        visible=False,
        elem_id="train-pref",
    )


def samples_frame(status: RunStatus) -> pd.DataFrame:
    rows = [
        {k: str(s.get(k, "")) for k in ("prompt", "prediction", "reference")} for s in status.samples[:SAMPLES_SHOWN]
    ]
    return pd.DataFrame(rows, columns=["prompt", "prediction", "reference"])


FIT = (None, None)  # a plot's range fitted to its points (an update's None would leave the last range in place)
HEADROOM = 1.15  # above a range's highest point, so that point is drawn whole, not cut by the plot's edge


def steps_axis(status: RunStatus) -> list[float | None]:
    """Both plots' x range: the whole run, 0 to its last step and a little more, so a curve grows
    towards the run's end, the two plots line up step for step, and an evaluation's point (at an
    epoch's end, the last at the last step) is drawn whole; fitted to the points before the run
    knows its steps."""
    if not status.total_steps:
        return list(FIT)
    return [0, status.total_steps + max(1, status.total_steps // 40)]


def values_axis(frame: pd.DataFrame, y: str) -> list[float | None]:
    """A plot's y range: BLEU (a score from 0) from 0 to a little above its best; a curve of a
    single value so far the same (vega would make an axis of that one value, labelled with all its
    digits, "7.5975885391"); otherwise fitted to the curve. Preference accuracy, a percentage: 0 to 100."""
    if y == "accuracy":
        return [0, 100]
    if y != "bleu" and frame[y].nunique() >= 2:
        return list(FIT)
    top = frame[y].max() if len(frame) else 0.0
    return [0, round(top * HEADROOM, 2) if top > 0 else 1]


def _signature(value) -> str:
    return value.to_json() if isinstance(value, pd.DataFrame) else repr(value)


def live_view(
    tab: TrainTab, cache: dict | None, model_updates: Sequence[Callable[[], object]] = (), visitor: bool = True
) -> tuple:
    """The timer's redraw: (cache, run text, loss, BLEU, preference accuracy, samples, log tail,
    action line, *model-list updates).

    Only what changed since this page's last redraw is sent (gr.skip() otherwise), so plots do
    not flicker and an open dropdown is not reset. The action line (what the last Start / Stop /
    Resume / Push said: "Stopping run ...") is cleared when the run comes to an end, so it never
    contradicts the run text. ``model_updates`` make the updates of the
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
        "pref": pref_frame(status),  # DPO / KTO runs only: the plot shows when a run reports the figure
        "samples": samples_frame(status),
        "log": server_paths_hidden("\n".join(status.log_tail.splitlines()[-LOG_LINES:]), tab),
        # The model lists follow the runs index (what the picker reads): a run is listed once its
        # final model and its end are both written, and the lists redraw when that set changes.
        "finals": tuple(r.final_dir for r in list_runs(tab.manager.root) if r.final_dir),
    }
    cache = dict(cache or {})
    state = f"{status.run_id}:{status.state}"
    ended = cache.get("state") not in (None, state) and status.state in ENDED
    cache["state"] = state
    changed = {}
    for key, value in values.items():
        signature = _signature(value)
        changed[key] = cache.get(key) != signature
        cache[key] = signature
    plots = {}
    for key in ("loss", "bleu", "pref"):
        limits = {"x_lim": steps_axis(status), "y_lim": values_axis(values[key], values[key].columns[-1])}
        shown = {"visible": not values[key].empty} if key == "pref" else {}
        if cache.get(f"{key} limits") != repr(limits):
            # gradio (6.31) draws a plot whose limits change anew, asynchronously, and points sent with
            # the change can go to the drawing being replaced (a finished run's only BLEU point was never
            # drawn): the points are sent again with the next redraw, to the new drawing.
            plots[key] = gr.update(value=values[key], **limits, **shown)
            cache[f"{key} limits"], cache[key] = repr(limits), "sent with new limits"
        elif changed[key]:
            plots[key] = gr.update(value=values[key], **shown) if shown else values[key]
    keys = ("run", "loss", "bleu", "pref", "samples", "log")
    out = [plots.get(key, values[key] if changed[key] else gr.skip()) for key in keys]
    out.append("" if ended else gr.skip())
    out += [make() if changed["finals"] else gr.skip() for make in model_updates]
    return (cache, *out)
