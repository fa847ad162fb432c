"""What the app shows of a run, read from its folder: ``RunStatus``.

State comes from process liveness and the CLI's events in metrics.jsonl (finetune/train.py
writes start, log, eval, checkpoint, stopped, done, error, pushed); run.json's offsets say
where the current launch attempt's events and log lines begin. A failure's reason is the
attempt's latest error event (the CLI writes one for every failure it catches, with the
error's kind and the file at fault where there is one); only when there is none is it scraped
from the end of train.log.

The loss curve is the ``log`` events' losses by step, less the ``partial`` ones (the first step of
a resumed attempt, logged to show it is alive while its loss window, continued from the
checkpoint, is still open); those count for the speed and the ETA like any other.

``current_status`` is what viewers poll (every open page, every 2 s, logged in or not): it is
computed again only when its inputs change (a new /proc snapshot, at most one per
process.SCAN_SECONDS, or one of the run's files), so a flood of polls costs a few stat() calls
each, never a scan.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import threading
import time
from dataclasses import dataclass, field, replace
from pathlib import Path

from chat.layout import FINAL, RESULTS_FILE, ROOT
from finetune import checkpoint as ckpt
from finetune.config import DEFAULT_DATASET
from finetune.jobs import process
from finetune.jobs.command import display_command
from finetune.jobs.paths import LOG_FILE, RUN_FILE, read_info

LOG_TAIL_LINES = 40

# Error kinds whose message the CLI writes for the user (finetune.cli.KNOWN_ERRORS); any other
# kind ("internal": a bug, its message "ExcType: text") is said to be one.
USER_ERRORS = ("DataError", "ModelLoadError", "TrainingError", "HubError", "WriteError", "FileNotFoundError")

_RANK_PREFIX = re.compile(r"^\[(?:rank|default)\d+\]:\s?")  # torch elastic's tag on each line of a rank
_ERROR_LINE = re.compile(r"^\d\d:\d\d:\d\d ERROR [\w.]+: (.+)$")  # finetune.cli.main's log format
_ARGPARSE_ERROR = re.compile(r"^python -m finetune: error: (.+)$")
_EXCEPTION_LINE = re.compile(r"^(?:[A-Za-z_][\w]*\.)*[A-Za-z_]\w*(?:Error|Exception|Interrupt): .+$")
_LAUNCHER_NOISE = ("ChildFailedError", "CalledProcessError")
_ANSI = re.compile(r"\x1b(?:\[[0-?]*[ -/]*[@-~]|[@-Z\\-_])")  # terminal escape codes (colours, cursor moves)
_SAMPLE_LINE = re.compile(r"prompt: .* \| prediction: .* \| reference: ")  # a sample in finetune/train.py's log
PUBLIC_DATASETS = ("sample", DEFAULT_DATASET)  # data whose validation rows anyone may see


@dataclass
class RunStatus:
    run_id: str | None = None
    state: str = "idle"  # idle | running | stopping | stopped | finished | failed
    step: int = 0
    total_steps: int = 0
    progress: float = 0.0  # 0..1
    eta_seconds: float | None = None
    loss_points: list[dict] = field(default_factory=list)  # [{"step", "loss"}] for gr.LinePlot
    bleu_points: list[dict] = field(default_factory=list)  # [{"step", "bleu"}]
    # DPO / KTO runs: the held-out preference accuracy (a share, 0..1) of each evaluation
    pref_points: list[dict] = field(default_factory=list)  # [{"step", "pref_accuracy"}]
    samples_per_second: float | None = None
    gpu_mem_gib: float | None = None
    log_tail: str = ""
    error: str | None = None
    final_dir: str | None = None
    eval_bleu: float | None = None
    eval_pref_accuracy: float | None = None  # the latest evaluation's (DPO / KTO runs)
    # The latest evaluation's BLEU per kind and on held-out chat feedback (finetune.evaluate.scores):
    # {"persona": 31.2, ..., "feedback": 12.0}, only the parts the validation data has.
    bleu_parts: dict = field(default_factory=dict)
    samples: list[dict] = field(default_factory=list)  # prompt / prediction / reference
    command: str = ""
    has_checkpoint: bool = False  # resume() is possible once stopped or failed
    pushed_url: str | None = None  # where the final model was last pushed (by the CLI or push())
    # The run's data may be private (an upload, or a Hub dataset other than the public ones):
    # its validation rows, in ``samples`` and in the log, are for logged-in users only.
    samples_private: bool = False
    # Before the ``start`` event: what setup is doing (the CLI's latest ``phase`` event) and
    # when this launch attempt began (run.json's ``started``; None when not known).
    phase: str | None = None
    launched_at: float | None = None

    @property
    def seconds_since_launch(self) -> float | None:
        """Seconds since this attempt was launched (computed now: the status may be cached)."""
        return None if self.launched_at is None else max(0.0, time.time() - self.launched_at)

    def for_visitor(self) -> RunStatus:
        """What a visitor who is not logged in may see: without the validation rows (samples,
        and the CLI's "prompt: ..." log lines) when they may be private. A new object."""
        if not self.samples_private:
            return self
        kept = [line for line in self.log_tail.splitlines() if not _SAMPLE_LINE.search(line)]
        return replace(self, samples=[], log_tail="\n".join(kept))


# --------------------------------------------------------------------------- reading the run folder


def read_events(run_dir: Path) -> list[tuple[int, dict]]:
    """(byte offset, event) of every complete line of metrics.jsonl."""
    path = run_dir / ckpt.METRICS_FILE
    try:
        data = path.read_bytes()
    except OSError:
        return []
    out, offset = [], 0
    for line in data.splitlines(keepends=True):
        if line.endswith(b"\n"):  # a line still being written is read next time
            with contextlib.suppress(ValueError):
                event = json.loads(line)
                if isinstance(event, dict):
                    out.append((offset, event))
        offset += len(line)
    return out


def tail(path: Path, lines: int, since: int = 0) -> list[str]:
    """The last ``lines`` lines of ``path`` from byte ``since`` (reads at most ~256 KB)."""
    try:
        with open(path, "rb") as fh:
            size = fh.seek(0, os.SEEK_END)
            start = max(since, size - 256 * 1024)
            fh.seek(start)
            data = fh.read()
    except OSError:
        return []
    # progress bars redraw with \r: keep only the last state of each line, without escape codes
    text = _ANSI.sub("", data.decode(errors="replace"))
    rows = [row.rstrip("\r").rsplit("\r", 1)[-1] for row in text.split("\n")]
    if rows and rows[-1] == "":
        rows.pop()
    return rows[-lines:]


# --------------------------------------------------------------------------- failure reasons


def error_from_event(event: dict) -> str | None:
    """The reason an error event gives: its message, plus the file at fault when the message
    does not name it already; an internal error says it is one. Paths in the repository are
    shown relative to it (the message reaches visitors of the Train tab)."""
    message = str(event.get("message") or "").strip()
    if not message:
        return None
    kind, file = event.get("kind"), event.get("file")
    if kind and kind not in USER_ERRORS:
        message = f"{kind} error: {message}"
    if file and str(file) not in message:
        message = f"{message} (file: {file})"
    return message.replace(f"{ROOT}{os.sep}", "")  # runs/<id>/..., not the server's folders


def error_from_log(lines: list[str]) -> str | None:
    """The CLI's own message (its ERROR log line or argparse error), else the root exception;
    lines of any rank (``[rank1]: ...``)."""
    lines = [_RANK_PREFIX.sub("", line) for line in lines]
    for pattern in (_ERROR_LINE, _ARGPARSE_ERROR):
        found = [m.group(1) for m in map(pattern.match, lines) if m]
        if found:
            return found[-1].strip()
    for line in lines:  # the first exception is the root cause; launchers add theirs after it
        stripped = line.strip()
        if _EXCEPTION_LINE.match(stripped) and not any(n in stripped for n in _LAUNCHER_NOISE):
            return stripped
    return None


def _failure(run_dir: Path, info: dict, current: list[dict]) -> str:
    """Why the current attempt failed: killed by a stop, else its latest error event, else the
    log, else its exit code."""
    error = next((e for e in reversed(current) if e.get("event") == "error"), None)
    reason = (
        info.get("killed")
        or (error and error_from_event(error))
        or error_from_log(tail(run_dir / LOG_FILE, 400, since=info.get("log_offset", 0)))
    )
    if reason:
        return reason
    code = info.get("exit_code")
    return (
        f"the training process exited with code {code}; see the log"
        if code is not None
        else "the training process ended without a result (killed?); see the log"
    )


# --------------------------------------------------------------------------- the status


def samples_private(spec) -> bool:
    """May the data of a run with this spec (run.json's) be private? Yes for a local upload or a
    Hub dataset other than PUBLIC_DATASETS (the Space's token may read private ones), and when
    the spec cannot be read."""
    if not isinstance(spec, dict) or not spec:
        return True
    if "config" in spec:  # JobSpec.to_dict()
        config = spec["config"] if isinstance(spec["config"], dict) else {}
        return bool(
            spec.get("split_train_file")
            or config.get("train_file")
            or config.get("dataset_name") not in PUBLIC_DATASETS
        )
    return spec.get("dataset", "sample") not in PUBLIC_DATASETS  # the flat RunSpec of older run folders


def status_of(run_dir: Path, snap: process.Snapshot | None = None) -> RunStatus:
    """The status of the run in ``run_dir``, from its folder and its processes (``snap``: a
    /proc snapshot to judge liveness by, by default the shared one)."""
    # Order matters: the stop thread writes its note before it stops counting as stopping, and
    # taking a snapshot records a reaped child's exit code, so run.json is read after both.
    escalating = process.is_stopping(run_dir)
    alive = process.run_alive(run_dir, snap or process.snapshot())
    info = read_info(run_dir)
    events = read_events(run_dir)
    offset = info.get("metrics_offset", 0)
    current = [e for off, e in events if off >= offset]  # this launch attempt's events
    everything = [e for _, e in events]

    loss, bleu, pref = {}, {}, {}
    step, total, last_eval = 0, 0, None
    for e in everything:
        kind = e.get("event")
        if isinstance(e.get("step"), int):
            step = e["step"]  # the latest event's step (a resumed run restarts at its checkpoint)
        if kind == "start":
            total = e.get("total_steps", total)
            step = e.get("resumed_at", step)
        elif kind == "log" and not e.get("partial"):
            loss[e["step"]] = e["loss"]  # steps repeated after a resume: the later value wins
        elif kind == "eval":
            bleu[e["step"]] = e["eval_bleu"]
            if isinstance(e.get("eval_pref_accuracy"), (int, float)):
                pref[e["step"]] = e["eval_pref_accuracy"]
            last_eval = e
    done = next((e for e in reversed(current) if e.get("event") == "done"), None)
    terminal = done or next((e for e in reversed(current) if e.get("event") in ("stopped", "error")), None)

    status = RunStatus(
        run_id=run_dir.name,
        command=display_command(info.get("argv", [])),
        samples_private=samples_private(info.get("spec")),
    )
    status.step, status.total_steps = step, total
    status.progress = min(1.0, step / total) if total else 0.0
    status.loss_points = [{"step": s, "loss": v} for s, v in sorted(loss.items())]
    status.bleu_points = [{"step": s, "bleu": v} for s, v in sorted(bleu.items())]
    status.pref_points = [{"step": s, "pref_accuracy": v} for s, v in sorted(pref.items())]
    # speed and memory of this attempt only: after a resume they start afresh
    last_log = next((e for e in reversed(current) if e.get("event") == "log"), None)
    if last_log:
        status.samples_per_second = last_log.get("samples_per_second")
        status.gpu_mem_gib = last_log.get("gpu_mem_gib")
    if last_eval:
        status.eval_bleu = last_eval.get("eval_bleu")
        status.eval_pref_accuracy = last_eval.get("eval_pref_accuracy")
        status.bleu_parts = bleu_parts(last_eval)
        status.samples = list(last_eval.get("samples") or [])
    status.log_tail = "\n".join(tail(run_dir / LOG_FILE, LOG_TAIL_LINES))
    status.has_checkpoint = bool(ckpt.list_checkpoints(run_dir))

    if not any(e.get("event") == "start" for e in current):
        phases = [e.get("phase") for e in current if e.get("event") == "phase"]
        status.phase = str(phases[-1]) if phases else "launching the processes"
    if isinstance(info.get("started"), (int, float)):
        status.launched_at = float(info["started"])
    if alive or escalating:
        status.state = "stopping" if (run_dir / ckpt.STOP_FILE).exists() or escalating else "running"
        status.eta_seconds = _eta(current, step, total)
    elif terminal and terminal["event"] == "done":
        status.state, status.progress, status.eta_seconds = "finished", 1.0, 0.0
        status.eval_bleu = terminal.get("eval_bleu", status.eval_bleu)
        # training finished; a later error is the Hub push failing (the model is kept), until a
        # later push succeeds
        for e in current[current.index(terminal) + 1 :]:
            if e.get("event") == "error":
                status.error = error_from_event(e) or status.error
            elif e.get("event") == "pushed":
                status.error, status.pushed_url = None, e.get("url")
        final = run_dir / FINAL
        status.final_dir = str(final) if final.is_dir() else None
    elif terminal and terminal["event"] == "stopped":
        status.state = "stopped"
    else:
        status.state = "failed"
        status.error = _failure(run_dir, info, current)
    return status


def bleu_parts(results: dict) -> dict:
    """``eval_bleu_<part>`` figures of an eval event or all_results.json, as {part: bleu}."""
    prefix = "eval_bleu_"
    return {
        k[len(prefix) :]: float(v)
        for k, v in results.items()
        if k.startswith(prefix) and isinstance(v, (int, float)) and not isinstance(v, bool)
    }


def saved_results(folder: str | Path) -> dict:
    """What a model folder was saved with (its all_results.json: eval_bleu, eval_bleu_<part>…); {} if none."""
    try:
        results = json.loads((Path(folder) / RESULTS_FILE).read_text())
    except (OSError, ValueError):
        return {}
    return results if isinstance(results, dict) else {}


def bleu_parts_text(parts: dict) -> str:
    """``bleu_parts`` for people: "persona 30.5 · none 12.0 · held-out chat feedback 8.3" ("" if none)."""
    kinds = [f"{k} {v:.1f}" for k, v in parts.items() if k != "feedback"]
    held = [f"held-out chat feedback {parts['feedback']:.1f}"] if "feedback" in parts else []
    return " · ".join(kinds + held)


def _eta(current: list[dict], step: int, total: int) -> float | None:
    """Remaining seconds at this attempt's average pace so far (evaluations included)."""
    start = next((e for e in current if e.get("event") == "start"), None)
    logs = [e for e in current if e.get("event") == "log"]
    if not start or not logs or not total:
        return None
    done = logs[-1]["step"] - start.get("resumed_at", 0)
    elapsed = logs[-1]["time"] - start["time"]
    if done <= 0 or elapsed <= 0:
        return None
    return max(0.0, (total - logs[-1]["step"]) * elapsed / done - (time.time() - logs[-1]["time"]))


# --------------------------------------------------------------------------- the status viewers poll

# Files whose change changes a status (train.log, which grows all the time, is read again with
# each new /proc snapshot). checkpoints/ and final/ change with an event too, but a folder
# written by hand should show.
_WATCHED = (RUN_FILE, ckpt.METRICS_FILE, ckpt.STOP_FILE, "checkpoints", FINAL)
_CACHE: dict[str, tuple[tuple, RunStatus]] = {}  # run folder -> (inputs, status)
_COMPUTING: dict[str, threading.Lock] = {}  # run folder -> its lock: one computation at a time
_CACHE_LOCK = threading.Lock()  # a leaf lock: held only to read or write the two dicts


def _stamp(path: Path) -> tuple | None:
    try:
        st = path.stat()
    except OSError:
        return None
    return st.st_ino, st.st_size, st.st_mtime_ns, st.st_nlink


def current_status(run_dir: Path) -> RunStatus:
    """``status_of(run_dir)``, computed again only when its inputs changed: the /proc snapshot
    (at most one per process.SCAN_SECONDS; a launch or a stop here makes a new one at once),
    whether a stop is at work, and the stamps of the _WATCHED files. Concurrent callers wait
    for one computation. The object is shared by every caller: do not modify it."""
    key = str(run_dir)
    with _CACHE_LOCK:
        lock = _COMPUTING.setdefault(key, threading.Lock())
    with lock:  # never taken by a holder of process.LOCK: the lock order is this, LOCK, the scan's
        snap = process.snapshot()
        stamps = tuple(_stamp(run_dir / name) for name in _WATCHED)
        with _CACHE_LOCK:
            cached = _CACHE.get(key)
        info_changed = cached is None or cached[0][2] != stamps[0]
        if info_changed and stamps[0] and stamps[0][2] / 1e9 > snap.wall - 0.05:  # file times lag the clock
            snap = process.snapshot(0)  # run.json is newer than the scan: a launch by another app process?
        inputs = (snap.serial, process.is_stopping(run_dir), *stamps)
        if cached is not None and cached[0] == inputs:
            return cached[1]
        status = status_of(run_dir, snap)
        with _CACHE_LOCK:
            _CACHE[key] = (inputs, status)
        return status
