"""What the runs view does, as plain functions (``webui.runs_tab`` wires them to gradio).

Every run under the runs root, from ``finetune.jobs.index`` (the model picker reads the same
index): a table to sort and filter, curves of two or more runs overlaid with the settings that
differ, and per-run actions. Watching is open to every visitor (no server path is shown: a base
model that is a run's final folder is named by that run); every action checks the login
(``webui.auth.require``) and finds its run by id in the index, never by a path a browser sent.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import shutil
import time
from dataclasses import dataclass, field
from pathlib import Path

import pandas as pd

from chat.engine import ChatEngine
from chat.layout import FINAL, is_hub_id
from finetune import checkpoint as ckpt
from finetune.config import FIELD_DEFAULTS
from finetune.jobs import index, process
from finetune.jobs.manager import RunManager
from finetune.jobs.paths import RUN_FILE, RUN_ID_RE, read_info, write_info
from webui import chat_handlers
from webui.auth import AuthConfig, require
from webui.model_scores import model_label
from webui.refusals import Refusals
from webui.train_words import command_lines

log = logging.getLogger(__name__)

MAX_LABEL = 80
SORTS = {  # the sort menu: label -> (record key, newest/highest first)
    "newest": (None, False),  # the index's order: app runs by launch time (their ids), then the others
    "best BLEU": (lambda r: -1 if r.best_bleu is None else r.best_bleu, True),
    "context score": (lambda r: -1 if r.context_hits is None else r.context_hits, True),
    "name": (lambda r: r.name.lower(), False),
    "state": (lambda r: r.state, False),
}
COLUMNS = [
    "run",
    "state",
    "started",
    "duration",
    "base model",
    "data",
    "objective",
    "weights",
    "lr",
    "epochs / steps",
    "batch",
    "BLEU",
    "best BLEU",
    "BLEU by kind",
    "context",
    "pref. acc.",
    "continued from",
]
CURVES = {"loss": "Training loss", "eval_loss": "Eval loss", "bleu": "BLEU", "context_hits": "Context score"}


@dataclass
class RunsServices:
    """What the view works with, handed in by app.py: the chat's engine (to serve a run), who may
    act, the run manager (its root, a push) and the page's refusal lines."""

    engine: ChatEngine
    auth: AuthConfig
    manager: RunManager
    refusals: Refusals = field(default_factory=Refusals)

    @property
    def root(self) -> Path:
        return self.manager.root


# --------------------------------------------------------------------------- watching (open)


def _when(t: float | None) -> str:
    return time.strftime("%Y-%m-%d %H:%M", time.localtime(t)) if t else ""


def _duration(s: float | None) -> str:
    if s is None:
        return ""
    s = int(s)
    return f"{s // 3600}h{s % 3600 // 60:02d}m" if s >= 3600 else f"{s // 60}m{s % 60:02d}s"


def _num(v, digits: int = 1) -> str:
    return "" if not isinstance(v, (int, float)) else f"{v:.{digits}f}"


def base_name(record: index.RunRecord, names: dict[str, str]) -> str:
    """The base model as visitors may see it: a parent run by its name, else a label, never a path."""
    if record.parent:
        return f"run {names.get(record.parent, record.parent)}"
    return model_label(record.base) if record.base else ""


def row(record: index.RunRecord, names: dict[str, str]) -> list:
    s = record.settings
    # (a failure's message may name the server's folders: the runs root is said as "runs")
    problem = (record.problem or "").replace(str(record.folder.parent), "runs")
    state = record.state + (f": {problem}" if problem else "")
    steps = s.get("max_train_steps")
    kinds = ", ".join(f"{k} {v:.1f}" for k, v in record.bleu_parts.items() if isinstance(v, (int, float)))
    return [
        record.name,
        state,
        _when(record.started),
        _duration(record.duration_s),
        base_name(record, names),
        record.data or "",
        record.objective if record.settings else "",
        ("LoRA r" + str(s.get("lora_r", "?")) if record.adapter == "lora" else "full") if record.settings else "",
        "" if s.get("learning_rate") is None else f"{s['learning_rate']:g}",
        f"{steps} steps" if steps else ("" if s.get("num_train_epochs") is None else f"{s['num_train_epochs']} ep"),
        str(s.get("per_device_train_batch_size", "")),
        _num(record.bleu),
        _num(record.best_bleu),
        kinds,
        _num(record.context_hits, 2),
        _num(record.pref_accuracy, 2),
        names.get(record.parent, record.parent) if record.parent else "",
    ]


def records(services: RunsServices) -> list[index.RunRecord]:
    return index.list_runs(services.root)


def filtered(found: list[index.RunRecord], query: str = "", state: str = "all", sort: str = "newest") -> list:
    """The records whose name, state, base, data or objective contain ``query`` (any case), of
    ``state`` ("all": any), in the ``sort`` order (SORTS)."""
    words = (query or "").lower().split()
    names = {r.run_id: r.name for r in found}
    keep = []
    for r in found:  # (the base as shown: a search never probes server paths)
        fields = (r.name, r.run_id, r.state, base_name(r, names), r.data, r.objective, r.adapter)
        text = " ".join(str(x) for x in fields).lower()
        if all(w in text for w in words) and state in (None, "", "all", r.state):
            keep.append(r)
    key, reverse = SORTS.get(sort, SORTS["newest"])
    return keep if key is None else sorted(keep, key=key, reverse=reverse)


def table(found: list[index.RunRecord], shown: list[index.RunRecord]) -> pd.DataFrame:
    names = {r.run_id: r.name for r in found}
    return pd.DataFrame([row(r, names) for r in shown], columns=COLUMNS)


def choices(found: list[index.RunRecord]) -> list[tuple[str, str]]:
    """The selection menus' (label, run id): every run, its state beside its name."""
    return [
        (f"{r.name} ({r.state})" if r.name == r.run_id else f"{r.name} [{r.run_id}] ({r.state})", r.run_id)
        for r in found
    ]


def summary(found: list[index.RunRecord], shown: list[index.RunRecord]) -> str:
    if not found:
        return "No runs yet under the runs folder: start one above, or run `python -m finetune --output_dir` there."
    odd = [r for r in found if r.state in ("corrupt", "foreign")]
    note = (
        f" {len(odd)} folder(s) are not readable runs: "
        + "; ".join(f"**{r.run_id}** {r.state} ({r.problem})" for r in odd)
        if odd
        else ""
    )
    return f"{len(shown)} of {len(found)} runs shown.{note}"


def picked(found: list[index.RunRecord], run_ids) -> list[index.RunRecord]:
    """The records of ``run_ids`` (a browser's list, checked against the index), in that order."""
    by_id = {r.run_id: r for r in found}
    return [by_id[i] for i in (run_ids or []) if isinstance(i, str) and i in by_id]


def curves_frames(chosen: list[index.RunRecord]) -> dict[str, pd.DataFrame]:
    """One long frame per curve (step, value, run) of the chosen runs, for LinePlot's color."""
    rows: dict[str, list] = {name: [] for name in CURVES}
    for r in chosen:
        if r.state in ("corrupt", "foreign"):
            continue
        for name, points in index.curves(r.folder).items():
            if name in rows:
                rows[name] += [(p["step"], p["value"], r.name) for p in points]
    return {name: pd.DataFrame(points, columns=["step", "value", "run"]) for name, points in rows.items()}


def _shown(value) -> str:
    return "" if value is None else json.dumps(value) if isinstance(value, (list, dict, bool)) else str(value)


def differences(chosen: list[index.RunRecord]) -> pd.DataFrame:
    """The settings that differ between the chosen runs (one column per run); base and data as
    the table names them."""
    names = {r.run_id: r.name for r in chosen}
    cols = ["setting", *[r.name for r in chosen]]
    if len(chosen) < 2:
        return pd.DataFrame([], columns=cols)
    diff = index.differing_settings(chosen)
    rows = []
    for name, values in diff.items():
        if name == "model_name_or_path":
            values = [base_name(r, names) for r in chosen]
        elif name in ("train_file", "validation_file", "feedback_file", "feedback_validation_file"):
            values = [Path(v).name if v else None for v in values]
        rows.append([name, *[_shown(v) for v in values]])
    return pd.DataFrame(rows, columns=cols)


def compare_view(services: RunsServices, run_ids) -> tuple[pd.DataFrame, dict[str, pd.DataFrame], str]:
    """(settings that differ, curves, a line saying what is shown) for the selected runs."""
    chosen = picked(records(services), run_ids)
    if len(chosen) < 2:
        note = "Select two or more runs to overlay their curves and see the settings that differ."
    else:
        note = f"{len(chosen)} runs overlaid; {len(differences(chosen))} settings differ."
    return differences(chosen), curves_frames(chosen), note


# --------------------------------------------------------------------------- acting (login)


def _one(services: RunsServices, run_id) -> index.RunRecord:
    found = picked(records(services), [run_id])
    if not found:
        raise ValueError("Pick a run first (from the Run menu).")
    return found[0]


def _servable(record: index.RunRecord) -> str:
    if not record.final_dir:
        raise ValueError(f"Run {record.name} has no finished model to serve ({record.state}).")
    return record.final_dir


def serve(services: RunsServices, token, profile, run_id) -> str:
    """Serve the run's final model in the chat, through the model picker's own swap."""
    require(services.auth, token, profile, "serve a run")
    spec = _servable(_one(services, run_id))
    notes = list(chat_handlers.load_model(services.engine, spec, None, services.root, confirmed=spec))
    note = notes[-1][0]
    if not note.startswith("✅"):
        raise ValueError(note.lstrip("⚠️ "))
    return note


def to_compare(services: RunsServices, token, profile, run_id) -> tuple[str, str]:
    """(the run's model, a note): app.py puts it in Compare's B menu."""
    require(services.auth, token, profile, "choose models to compare")
    record = _one(services, run_id)
    return _servable(
        record
    ), f"✅ {record.name} is model **B** in the Compare tab: open it and press **Load** under **Models**."


def command(services: RunsServices, token, profile, run_id) -> str:
    """The run's command: the one the app launched (run.json), else its settings as CLI flags."""
    require(services.auth, token, profile, "see a run's command")
    record = _one(services, run_id)
    with contextlib.suppress(OSError, ValueError):
        argv = read_info(record.folder).get("argv")
        if isinstance(argv, list) and argv:
            return command_lines(" ".join(str(a) for a in argv))
    if not record.settings:
        raise ValueError(f"Run {record.name} records no settings ({record.state}).")
    flags = []
    for name, value in record.settings.items():
        if (
            name in FIELD_DEFAULTS
            and value != FIELD_DEFAULTS[name]
            and not (isinstance(value, list) and tuple(value) == FIELD_DEFAULTS[name])
        ):
            value = ",".join(value) if isinstance(value, list) else value
            flags += [f"--{name}", str(value)]
    return command_lines(" ".join(["python -m finetune", *flags, "--output_dir", str(record.folder)]))


def rename(services: RunsServices, token, profile, run_id, label) -> str:
    """Give a run a name (run.json's "label", replaced in one rename; "" clears it)."""
    require(services.auth, token, profile, "rename a run")
    record = _one(services, run_id)
    label = " ".join(str(label or "").split())
    if len(label) > MAX_LABEL:
        raise ValueError(f"A run's name is at most {MAX_LABEL} characters.")
    if record.state in ("corrupt", "foreign"):
        raise ValueError(f"{record.run_id} is {record.state}: not a run to rename.")
    with process.LOCK:  # a read-modify-write of run.json (the manager writes it too)
        path = record.folder / RUN_FILE
        info = read_info(record.folder) if path.is_file() else {}
        info["label"] = label
        write_info(record.folder, info)
    return f"✅ Renamed to **{label}**." if label else f"✅ {record.run_id} goes by its id again."


def deletable(services: RunsServices, record: index.RunRecord) -> None:
    """ValueError when the run may not be deleted: running, or serving in the chat."""
    if record.state in ("running", "stopping"):
        raise ValueError(f"Run {record.name} is {record.state}: stop it first.")
    serving = False
    with contextlib.suppress(OSError, ValueError):
        serving = Path(services.engine.current.name).resolve().is_relative_to(record.folder.resolve())
    if serving:
        raise ValueError(f"Run {record.name} is serving in the chat: serve another model first.")


def ask_delete(services: RunsServices, token, profile, run_id) -> tuple[str, str]:
    """The first Delete: (run id to confirm, the question)."""
    require(services.auth, token, profile, "delete a run")
    record = _one(services, run_id)
    deletable(services, record)
    return (
        record.run_id,
        f"⚠️ Delete **{record.name}** and all its files (checkpoints, final model, logs)? This cannot be undone.",
    )


def delete(services: RunsServices, token, profile, run_id, pending) -> str:
    """Delete the run confirmed by ``ask_delete``: renamed out of the list in one step, then removed."""
    require(services.auth, token, profile, "delete a run")
    if not pending or pending != run_id:
        raise ValueError("Press Delete again: the run to delete changed.")
    record = _one(services, pending)
    deletable(services, record)
    gone = record.folder.parent / f".deleting-{record.folder.name}-{os.getpid()}"
    os.replace(record.folder, gone)  # the index skips dot-folders: never listed half-deleted
    shutil.rmtree(gone, ignore_errors=True)
    return f"🗑️ Deleted {record.name}."


def push(services: RunsServices, token, profile, run_id, repo, private) -> str:
    require(services.auth, token, profile, "push a run to the Hub")
    record = _one(services, run_id)
    _servable(record)
    repo = (repo or "").strip()
    if not is_hub_id(repo, owner=True):
        raise ValueError(f"Hub repo id must look like 'user/name', got {repo!r}")
    if RUN_ID_RE.match(record.run_id) and (record.folder / RUN_FILE).is_file():
        url = services.manager.push(record.run_id, repo, bool(private))
    else:  # a run from the command line: its final folder, recorded as the CLI records a push
        from finetune.hub import push as hub_push

        url = hub_push(record.folder / FINAL, repo, private=bool(private))
        ckpt.MetricsWriter(record.folder, enabled=True).write("pushed", repo=repo, url=url)
    return f"✅ Pushed {record.name} to {url}"
