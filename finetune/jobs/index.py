"""Every run under the runs root, in one list: what the runs view and the model picker read.

A ``RunRecord`` says what a run folder is (state, when, on what base and data, how it trained,
what it scored, what it was trained on top of) from its files alone:

- run.json (runs the app launched): the spec, so the settings are known before the run ends;
- metrics.jsonl: start, eval and done events (BLEU per evaluation, context score, preference
  accuracy, train/eval rows, times);
- final/: training_args.json (runs from the command line), all_results.json, an adapter or a model.

The state of an app run is ``status.current_status``'s (one source of truth, liveness included); a
folder from the command line has none of the app's process records, so its state comes from its
events. A folder that is neither is listed as ``foreign``; one whose files cannot be read as
``corrupt``, with the reason: the view shows them, it never fails on them.

Reading is cheap enough for every open page: a record is computed again only when one of the
files it was read from changed (a few ``stat()`` calls per run).
"""

from __future__ import annotations

import contextlib
import json
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

from chat.adapters import is_adapter_dir
from chat.layout import FINAL, RESULTS_FILE, TRAINING_ARGS_FILE
from finetune import checkpoint as ckpt
from finetune.jobs import process
from finetune.jobs.paths import RUN_FILE, RUN_ID_RE, read_info
from finetune.jobs.status import bleu_parts, current_status, read_events

# The settings a runs table shows as columns and compares between runs (the rest differ too,
# and "settings that differ" lists them all).
KEY_SETTINGS = (
    "learning_rate",
    "num_train_epochs",
    "max_train_steps",
    "per_device_train_batch_size",
    "adapter",
    "lora_r",
    "objective",
    "beta",
)
# Settings that differ between any two runs without saying anything about how they trained.
NOT_SETTINGS = {"output_dir", "resume_from_checkpoint", "push_to_hub", "hub_model_id", "hub_private", "report_name"}
STATES = ("running", "stopping", "stopped", "finished", "failed", "incomplete", "corrupt", "foreign")


@dataclass(frozen=True)
class RunRecord:
    run_id: str  # the folder's name
    folder: Path
    state: str  # one of STATES
    label: str = ""  # the name a user gave it (run.json "label"), else the run id
    problem: str | None = None  # why it is failed / corrupt / foreign
    started: float | None = None  # wall time of its first start
    duration_s: float | None = None  # first start to its last event (to now while running)
    base: str | None = None  # the model it trained from (a Hub id, preset or folder)
    parent: str | None = None  # the run whose final model that base is (lineage)
    data: str | None = None  # "sample", a Hub id, an upload's name (+ feedback)
    train_rows: int | None = None
    eval_rows: int | None = None
    settings: dict = field(default_factory=dict)  # the training config's fields, as far as known
    bleu: float | None = None  # the last evaluation's
    best_bleu: float | None = None
    bleu_parts: dict = field(default_factory=dict)  # the last evaluation's per kind / feedback
    context_hits: float | None = None
    pref_accuracy: float | None = None
    final_dir: str | None = None  # a finished model or adapter, ready to serve
    adapter_final: bool = False
    pushed_url: str | None = None

    @property
    def objective(self) -> str:
        return str(self.settings.get("objective") or "sft")

    @property
    def adapter(self) -> str:
        return str(self.settings.get("adapter") or "none")

    @property
    def name(self) -> str:
        return self.label or self.run_id


# --------------------------------------------------------------------------- reading one folder


def _json(path: Path):
    return json.loads(path.read_text())


def _config(run_dir: Path, info: dict | None) -> dict:
    """The run's training config: run.json's spec (app runs), else final/training_args.json."""
    spec = (info or {}).get("spec")
    if isinstance(spec, dict) and isinstance(spec.get("config"), dict):
        return dict(spec["config"])
    with contextlib.suppress(OSError, ValueError):
        args = _json(run_dir / FINAL / TRAINING_ARGS_FILE)
        if isinstance(args, dict):
            return args
    return {}


def _data(config: dict, info: dict | None) -> str | None:
    spec = (info or {}).get("spec") or {}
    source = config.get("train_file") or spec.get("split_train_file") or config.get("dataset_name")
    if not source:
        return None
    name = Path(source).name if ("/" in str(source) and Path(str(source)).suffix) else str(source)
    return f"{name} + feedback" if config.get("feedback_file") else name


def _parent(base: str | None, root: Path) -> str | None:
    """The run under ``root`` whose final/ ``base`` is (a path to it, resolved), else None."""
    if not base:
        return None
    path = Path(base)
    with contextlib.suppress(OSError, ValueError):
        path = path.resolve()
        root = root.resolve()
        if path.name == FINAL and path.parent.parent == root:
            return path.parent.name
        if path.parent == root:  # a run folder given whole
            return path.name
    return None


def has_weights(final: Path) -> bool:
    """A complete model folder (as the model picker has always required: config and weights)."""
    weights = (final / "model.safetensors").is_file() or (final / "model.safetensors.index.json").is_file()
    return (final / "config.json").is_file() and weights


def _figures(events: list[dict]) -> dict:
    evals = [e for e in events if e.get("event") == "eval" and isinstance(e.get("eval_bleu"), (int, float))]
    start = next((e for e in events if e.get("event") == "start"), {})
    last = evals[-1] if evals else {}
    return {
        "bleu": last.get("eval_bleu"),
        "best_bleu": max((e["eval_bleu"] for e in evals), default=None),
        "bleu_parts": bleu_parts(last),
        "context_hits": last.get("eval_context_hits"),
        "pref_accuracy": last.get("eval_pref_accuracy"),
        "train_rows": start.get("train_samples"),
        "eval_rows": start.get("eval_samples"),
    }


def _done(events: list[dict], state: str) -> bool:
    return state not in ("running", "stopping") and any(e.get("event") == "done" for e in events)


def _state_from_events(events: list[dict]) -> tuple[str, str | None]:
    """A command-line run's state: its last terminal event (no process records to go by)."""
    for e in reversed(events):
        kind = e.get("event")
        if kind == "done":
            return "finished", None
        if kind == "stopped":
            return "stopped", None
        if kind == "error":
            return "failed", str(e.get("message") or "failed")
    return "incomplete", "no end event: still running elsewhere, or killed"


def read_record(run_dir: Path, root: Path) -> RunRecord:
    """The record of one folder under the runs root (never raises for what the folder holds)."""
    run_dir = Path(run_dir)
    info: dict | None = None
    has_info = (run_dir / RUN_FILE).is_file()
    if has_info:
        try:
            info = read_info(run_dir)
            if not isinstance(info, dict):
                raise ValueError("not a JSON object")
        except (OSError, ValueError) as err:
            return RunRecord(run_dir.name, run_dir, "corrupt", problem=f"{RUN_FILE} unreadable ({err})")
    # A run.json with neither spec nor command is a command-line run's name alone (the runs view's rename).
    launched = has_info and ("spec" in info or "argv" in info)
    has_metrics = (run_dir / ckpt.METRICS_FILE).is_file()
    final = run_dir / FINAL
    if not has_info and not has_metrics and not final.is_dir():
        return RunRecord(run_dir.name, run_dir, "foreign", problem="not a training run (no run.json or metrics.jsonl)")
    events = [e for _, e in read_events(run_dir)]
    config = _config(run_dir, info)
    pushed = next((e.get("url") for e in reversed(events) if e.get("event") == "pushed"), None)
    finished_model = final.is_dir() and (has_weights(final) or is_adapter_dir(final))
    if launched:
        try:
            status = current_status(run_dir)
        except (OSError, ValueError, KeyError, TypeError) as err:  # run.json of the wrong shape
            return RunRecord(run_dir.name, run_dir, "corrupt", problem=f"{RUN_FILE}: {type(err).__name__}: {err}")
        state, problem = status.state, status.error
        pushed = status.pushed_url or pushed
    elif not events and finished_model:  # a finished model copied in, without its run's files
        state, problem = "finished", None
    else:
        state, problem = _state_from_events(events)
    starts = [
        e["time"] for e in events if e.get("event") in ("start", "phase") and isinstance(e.get("time"), (int, float))
    ]
    started = min(starts) if starts else (info or {}).get("created")
    times = [e["time"] for e in events if isinstance(e.get("time"), (int, float))]
    end = time.time() if state in ("running", "stopping") else (max(times) if times else None)
    figures = _figures(events)
    if figures["bleu"] is None:  # a run from elsewhere may have only its results file
        with contextlib.suppress(OSError, ValueError, AttributeError):
            results = _json(final / RESULTS_FILE)
            figures.update(
                bleu=results.get("eval_bleu"),
                bleu_parts=bleu_parts(results),
                context_hits=results.get("eval_context_hits"),
            )
    base = config.get("model_name_or_path")
    return RunRecord(
        run_dir.name,
        run_dir,
        state,
        label=str((info or {}).get("label") or ""),
        problem=problem if state in ("failed", "incomplete") else None,
        started=started if isinstance(started, (int, float)) else None,
        duration_s=(end - started) if isinstance(started, (int, float)) and end else None,
        base=base,
        parent=_parent(base, root),
        data=_data(config, info),
        settings={k: v for k, v in config.items() if k not in NOT_SETTINGS},
        # (a model whose push failed after its done event is still a finished model)
        final_dir=str(final) if finished_model and (state == "finished" or _done(events, state)) else None,
        adapter_final=finished_model and is_adapter_dir(final),
        pushed_url=pushed,
        **figures,
    )


# --------------------------------------------------------------------------- the whole root

_WATCHED = (RUN_FILE, ckpt.METRICS_FILE, ckpt.STOP_FILE, FINAL, f"{FINAL}/{RESULTS_FILE}")
_CACHE: dict[str, tuple[tuple, RunRecord]] = {}
_LOCK = threading.Lock()


def _stamp(path: Path) -> tuple | None:
    try:
        st = path.stat()
    except OSError:
        return None
    return st.st_ino, st.st_size, st.st_mtime_ns


def list_runs(root: str | Path) -> list[RunRecord]:
    """Every run folder under ``root``, newest first (by folder name for the app's ids, which
    start with the launch time, then by modification time). A record is read again only when its
    files changed, or with each new process snapshot while it may be running."""
    root = Path(root)
    try:
        folders = [p for p in root.iterdir() if p.is_dir() and not p.name.startswith(".")]
    except OSError:
        return []
    serial = process.snapshot().serial
    out = []
    for folder in folders:
        stamps = tuple(_stamp(folder / name) for name in _WATCHED)
        with _LOCK:
            cached = _CACHE.get(str(folder))
        live = cached is None or cached[1].state in ("running", "stopping", "incomplete")
        key = (stamps, serial if live else None)
        if cached is not None and cached[0] == key:
            out.append(cached[1])
            continue
        record = read_record(folder, root)
        with _LOCK:
            _CACHE[str(folder)] = (
                (stamps, serial if record.state in ("running", "stopping", "incomplete") else None),
                record,
            )
        out.append(record)
    app_ids = sorted((r for r in out if RUN_ID_RE.match(r.run_id)), key=lambda r: r.run_id, reverse=True)
    others = sorted((r for r in out if not RUN_ID_RE.match(r.run_id)), key=lambda r: -(r.started or 0))
    return app_ids + others


def curves(run_dir: str | Path) -> dict[str, list[dict]]:
    """A run's curves by step, for overlaying runs: train loss, eval loss, BLEU, context score and
    preference accuracy (each a list of {"step", "value"})."""
    series: dict[str, dict[int, float]] = {
        k: {} for k in ("loss", "eval_loss", "bleu", "context_hits", "pref_accuracy")
    }
    for _, e in read_events(Path(run_dir)):
        step = e.get("step")
        if not isinstance(step, int):
            continue
        if e.get("event") == "log" and not e.get("partial") and isinstance(e.get("loss"), (int, float)):
            series["loss"][step] = e["loss"]
        elif e.get("event") == "eval":
            for name, key in (
                ("eval_loss", "eval_loss"),
                ("bleu", "eval_bleu"),
                ("context_hits", "eval_context_hits"),
                ("pref_accuracy", "eval_pref_accuracy"),
            ):
                if isinstance(e.get(key), (int, float)):
                    series[name][step] = e[key]
    return {name: [{"step": s, "value": v} for s, v in sorted(points.items())] for name, points in series.items()}


def differing_settings(records: list[RunRecord]) -> dict[str, list]:
    """The settings whose values are not the same in every one of ``records`` (for comparing runs):
    {name: [value per record]}."""
    names = sorted({name for r in records for name in r.settings})
    out = {}
    for name in names:
        values = [r.settings.get(name) for r in records]
        if any(v != values[0] for v in values[1:]):
            out[name] = values
    return out
