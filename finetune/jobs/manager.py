"""RunManager: start, watch, stop, resume and push training runs, one at a time per runs root.

A manager keeps nothing about a run in memory: every answer is read from the run folder and
the processes, so any number of managers (a page reload, a second viewer, a restarted app, two
app processes) see the same runs. Starting is exclusive across all of them: under a file lock
in the runs root, a start or resume is refused while any process of any run under the root
lives (a rank that outlived its launcher too: see process.py).
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import secrets
import shutil
import time
from pathlib import Path

from chat.adapters import is_adapter_dir
from chat.layout import FINAL, RESULTS_FILE, is_hub_id
from finetune import checkpoint as ckpt
from finetune.cpu_ops import clear_stale_locks
from finetune.jobs import paths, process
from finetune.jobs.command import build_command, detect_gpus, display_command
from finetune.jobs.index import has_weights
from finetune.jobs.paths import LOG_FILE, RUN_FILE, RUN_ID_RE, read_info, split_files, write_info
from finetune.jobs.spec import JobSpec
from finetune.jobs.status import RunStatus, current_status, read_events, status_of
from finetune.jobs.uploads import write_split
from finetune.writes import writing

log = logging.getLogger(__name__)


MERGED = "merged"  # RUN/merged/: an adapter run's full model, made for a push of the merged model


class RunBusyError(RuntimeError):
    """Another run is still running; only one runs at a time."""


def _file_size(path: Path) -> int:
    try:
        return path.stat().st_size
    except OSError:
        return 0


class RunManager:
    """Start, watch, stop, resume and push training runs under ``root`` (one at a time).
    ``root`` defaults to ``paths.runs_root()``; it becomes an allowed root for local models."""

    def __init__(self, root: Path | str | None = None, grace_seconds: float = 60.0, term_seconds: float = 15.0):
        self.root = Path(root if root is not None else paths.runs_root()).expanduser().resolve()
        self.grace_seconds = grace_seconds
        self.term_seconds = term_seconds
        paths.allow_root(self.root)

    # ---- helpers

    def _dir(self, run_id: str) -> Path:
        if not isinstance(run_id, str) or not RUN_ID_RE.match(run_id):
            raise ValueError(f"invalid run id {run_id!r}")
        run_dir = self.root / run_id
        if not (run_dir / RUN_FILE).is_file():
            raise ValueError(f"no run {run_id!r} in {self.root}")
        return run_dir

    @contextlib.contextmanager
    def _exclusive(self):
        """Serialise start/resume across threads, RunManager instances and processes."""
        with writing(self.root / ".lock"):  # e.g. a read-only runs folder: named, with the cause
            self.root.mkdir(parents=True, exist_ok=True)
            fh = open(self.root / ".lock", "a")  # noqa: SIM115 - closed by the with below
        with process.LOCK, fh:
            try:
                import fcntl

                fcntl.flock(fh, fcntl.LOCK_EX)
            except ImportError:  # not POSIX: the in-process lock is all there is
                pass
            yield

    def _ids(self) -> list[str]:
        """Names under the root that look like run ids, newest first (no run.json check)."""
        try:
            return sorted((name for name in os.listdir(self.root) if RUN_ID_RE.match(name)), reverse=True)
        except OSError:
            return []

    def _latest(self) -> str | None:
        """The newest run this app launched whose run.json reads: a corrupt one, or a command-line
        run's name alone (the runs view's rename), is the runs view's to show, not the live view's."""
        for run_id in self._ids():
            with contextlib.suppress(OSError, ValueError):
                info = read_info(self.root / run_id)
                if isinstance(info, dict) and ("spec" in info or "argv" in info):
                    return run_id
        return None

    def _running(self, snap: process.Snapshot | None = None) -> str | None:
        """The newest run with a live process (and a run.json), if any."""
        live = process.live_runs(self.root, snap)
        return next((i for i in sorted(live, reverse=True) if (self.root / i / RUN_FILE).is_file()), None)

    def _refuse_if_busy(self) -> None:
        """RunBusyError while any process of any run under the root lives (a fresh scan)."""
        live = process.live_runs(self.root, process.snapshot(0))
        if live:
            run_id, pids = max(live.items())
            log.warning("refused to launch: run %s has live processes %s", run_id, sorted(pids))
            raise RunBusyError(
                f"run {run_id} is still running ({len(pids)} process(es)); stop it or wait "
                "for it to finish (one training run at a time)"
            )

    def _launch(self, run_dir: Path, spec: JobSpec, info: dict, resume: bool) -> None:
        """Launch an attempt and record it in run.json (caller holds ``_exclusive``)."""
        argv = build_command(spec, run_dir, resume=resume)
        log_path = run_dir / LOG_FILE
        log_offset = _file_size(log_path)
        metrics_offset = _file_size(run_dir / ckpt.METRICS_FILE)
        with writing(log_path):
            log = open(log_path, "ab")  # noqa: SIM115 - closed by the with below
        with log, process.LOCK:  # the reaper writes run.json only after this one
            with writing(log_path):
                log.write(
                    f"=== {'resume' if resume else 'start'} {time.strftime('%Y-%m-%d %H:%M:%S')}: "
                    f"{display_command(argv)}\n".encode()
                )  # the log is shown to visitors
                log.flush()
            # A run stopped while DeepSpeed built its CPU op left torch's lock file, and this run would
            # wait on it forever; no process of this run exists yet to be building it.
            if clear_stale_locks():
                with writing(log_path):
                    log.write(b"=== deleted the lock file a killed build of a DeepSpeed op left behind\n")
            proc = process.spawn(argv, run_dir, log)
            attempt = {
                "argv": argv,
                "pid": proc.pid,
                "pgid": proc.pid,
                "started": time.time(),
                "resume": resume,
                "metrics_offset": metrics_offset,
                "log_offset": log_offset,
            }
            info.update(attempt)
            info.pop("exit_code", None)
            info.pop("killed", None)
            info.setdefault("attempts", []).append(attempt)
            write_info(run_dir, info)

    def _note_kill(self, run_dir: Path, pgid: int) -> None:
        """After a SIGKILL: say why in run.json, unless the run had ended by itself after all."""
        events = [e.get("event") for _, e in read_events(run_dir)]
        if events[-1:] in (["stopped"], ["done"]):
            return
        with contextlib.suppress(OSError, ValueError):
            info = read_info(run_dir)
            if info.get("pgid") == pgid:  # not a later attempt's
                info["killed"] = (
                    f"the run did not stop within {self.grace_seconds:g} s of the stop "
                    f"request nor {self.term_seconds:g} s after SIGTERM, and was killed"
                )
                write_info(run_dir, info)

    # ---- API

    def runs(self) -> list[str]:
        """Run ids under the root, newest first."""
        return [i for i in self._ids() if (self.root / i / RUN_FILE).is_file()]  # ids start with the launch time

    def command_preview(self, spec: JobSpec) -> str:
        """What start(spec) would run ("Show command"; paths relative to the repository root
        where they are in it), with a placeholder run folder."""
        return display_command(build_command(spec, self.root / "<run_id>"))

    def start(self, spec: JobSpec) -> RunStatus:
        if spec.num_gpus > 0:
            available = detect_gpus()
            if spec.num_gpus > available:
                raise ValueError(f"num_gpus is {spec.num_gpus} but {available} GPU(s) are visible")
        with self._exclusive():
            self._refuse_if_busy()
            run_id = f"{time.strftime('%Y%m%d-%H%M%S')}-{secrets.token_hex(3)}"
            run_dir = self.root / run_id
            with writing(run_dir):  # e.g. a read-only runs folder: named, with the cause
                run_dir.mkdir(parents=True)
            try:
                if spec.holds_out_validation:
                    write_split(spec.split_train_file, run_dir)  # DataError: nothing launched
                info = {"run_id": run_id, "spec": spec.to_dict(), "created": time.time()}
                self._launch(run_dir, spec, info, resume=False)
            except BaseException:
                if not (run_dir / RUN_FILE).exists():
                    shutil.rmtree(run_dir, ignore_errors=True)
                raise
        return self.status(run_id)

    def status(self, run_id: str | None = None) -> RunStatus:
        """A run's state; by default the running run, else the most recent one (else idle).
        Cheap enough for every open page to poll (status.current_status); shared: do not modify."""
        if run_id is None:
            run_id = self._running() or self._latest()
            if run_id is None:
                return RunStatus()
        return current_status(self._dir(run_id))

    def stop(self, run_id: str | None = None) -> RunStatus:
        """Ask a run to checkpoint and stop (STOP file); a background thread SIGTERMs every
        process of the run (and their groups) after grace_seconds, and SIGKILLs them
        term_seconds after that."""
        snap = process.snapshot(0)
        run_id = run_id or self._running(snap)
        if run_id is None:
            return self.status()
        run_dir = self._dir(run_id)
        if not process.run_alive(run_dir, snap):
            return self.status(run_id)
        with writing(run_dir / ckpt.STOP_FILE):
            (run_dir / ckpt.STOP_FILE).touch()
        pgid = read_info(run_dir).get("pgid")  # the attempt the note of a kill is about
        process.stop_in_background(
            run_dir, self.grace_seconds, self.term_seconds, on_kill=lambda: self._note_kill(run_dir, pgid)
        )
        return self.status(run_id)

    def resume(self, run_id: str) -> RunStatus:
        """Continue a stopped or failed run from its latest checkpoint, in the same folder."""
        run_dir = self._dir(run_id)
        with self._exclusive():
            self._refuse_if_busy()
            if status_of(run_dir).state == "finished":
                raise ValueError(f"run {run_id} has already finished")
            if not ckpt.list_checkpoints(run_dir):
                raise ValueError(f"run {run_id} has no checkpoint to resume from; start a new run")
            info = read_info(run_dir)
            spec = JobSpec.from_dict(info["spec"])  # checked again: roots or files may have changed
            if spec.holds_out_validation and not all(p.is_file() for p in split_files(run_dir)):
                write_split(spec.split_train_file, run_dir)
            with contextlib.suppress(FileNotFoundError):
                (run_dir / ckpt.STOP_FILE).unlink()  # or the run would stop again at once
            self._launch(run_dir, spec, info, resume=True)
        return self.status(run_id)

    def finished_runs(self) -> list[tuple[str, str]]:
        """(label, final folder) of every finished run, newest first: "<run_id> (BLEU 12.3)", and
        "<run_id> (BLEU 12.3, LoRA adapter)" for an adapter run."""
        out = []
        for run_id in self.runs():
            final = self.root / run_id / FINAL
            adapter = is_adapter_dir(final)
            if not adapter and not has_weights(final):  # as the runs index (and so the model picker) says
                continue
            notes = []
            with contextlib.suppress(OSError, ValueError, TypeError, KeyError):
                notes.append(f"BLEU {json.loads((final / RESULTS_FILE).read_text())['eval_bleu']:.1f}")
            if adapter:
                notes.append("LoRA adapter")
            out.append((f"{run_id} ({', '.join(notes)})" if notes else run_id, str(final)))
        return out

    def push(self, run_id: str, repo_id: str, private: bool = False, merged: bool = False) -> str:
        """Upload a finished run's final/ folder to the Hub (an adapter run's: the adapter, or with
        ``merged`` the full model merged from it, kept in RUN/merged/); returns the repo URL.
        ``finetune.hub.HubError`` (clear message, token scrubbed) propagates."""
        run_dir = self._dir(run_id)
        final = run_dir / FINAL
        adapter = is_adapter_dir(final)
        if not adapter and not (final / "config.json").is_file():
            raise ValueError(f"run {run_id} has no final model to push (it has not finished)")
        if merged and not adapter:
            raise ValueError(f"run {run_id} trained a full model: there is no adapter to merge (push it as it is)")
        repo_id = (repo_id or "").strip()
        if not is_hub_id(repo_id, owner=True):
            raise ValueError(f"Hub repo id must look like 'user/name', got {repo_id!r}")
        from finetune.hub import push

        folder = self.merged(run_id) if merged else final
        url = push(folder, repo_id, private=private)
        # recorded like the CLI's own push, so every viewer (and a restarted app) sees it
        extra = {"merged": True} if merged else {}
        ckpt.MetricsWriter(run_dir, enabled=True).write("pushed", repo=repo_id, url=url, **extra)
        return url

    def merged(self, run_id: str) -> Path:
        """RUN/merged/: the run's adapter merged into its base (``finetune.merge``), made once."""
        from finetune.merge import MergeError, merge

        folder = self._dir(run_id) / MERGED
        if (folder / "config.json").is_file():
            return folder
        try:
            return merge(self._dir(run_id) / FINAL, folder)
        except MergeError as err:
            raise ValueError(f"cannot merge run {run_id}'s adapter: {err}") from None
