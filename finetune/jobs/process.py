"""A run's processes: launch, liveness, signals, stop escalation, reaping.

A run is all of its processes: the launcher (started here, in a new session), the ranks that
torch elastic starts (each in a session of its own, so NOT in the launcher's process group) and
whatever they start. They are found in /proc: a process is the run's when its argv has the
token ``finetune`` and, as one whole argument, the run folder (the CLI's --output_dir), or when
it descends from one that has. A command line, because pids get reused and a reload of the app
must not mistake another process for a run; a whole argument, so that a run trained from
``RUN/final`` is not taken for RUN.

/proc is scanned at most once per SCAN_SECONDS however many callers ask (every open page polls
the status); a launch, a signal, a reaped child or the end of a stop makes the next one fresh
(``changed()``), and stopping and the busy check always scan afresh.

This process's own bookkeeping is module state, shared by every RunManager in the process (a
page reload or a second viewer makes a new one):

    LOCK        one re-entrant lock for all of it, and for every read-modify-write of run.json
                (here and in manager.py)
    _CHILDREN   runs launched here and not reaped yet: their exit code goes into run.json
    _STOPPING   run folders with a stop-escalation thread: they show as "stopping" until it ends
    _SNAPSHOT   the latest scan of /proc, under _SCAN_LOCK: a leaf lock, whose holder takes no
                other lock (LOCK may be held while taking it, never the other way round)
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import subprocess
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from chat.layout import ROOT
from finetune.jobs.command import run_env
from finetune.jobs.paths import RUN_ID_RE, read_info, write_info

log = logging.getLogger(__name__)

SCAN_SECONDS = 1.0  # how old a shared /proc scan may be for liveness shown to viewers
POLL_SECONDS = 0.25  # how often a stop looks again whether the run has ended
KILL_SECONDS = 10.0  # after SIGKILL: how long to send it again while a process of the run remains

LOCK = threading.RLock()
_CHILDREN: dict[int, tuple[subprocess.Popen, Path]] = {}  # pid -> (process, run folder)
_STOPPING: set[str] = set()


# --------------------------------------------------------------------------- scanning /proc


@dataclass(frozen=True)
class Proc:
    pid: int
    ppid: int
    pgid: int
    args: tuple[str, ...]  # empty for kernel threads, and for a moment after a process exec's

    def folders(self) -> set[str]:
        """The arguments as paths ("--flag=value" read as value)."""
        return {a.split("=", 1)[1] if a.startswith("--") and "=" in a else a for a in self.args}


@dataclass(frozen=True)
class Snapshot:
    """Every live (not zombie) process at one moment; ``serial`` tells snapshots apart."""

    serial: int = 0
    taken: float = float("-inf")  # time.monotonic() when the scan began
    wall: float = float("-inf")  # time.time() then: to compare with file times
    generation: int = -1  # changed()'s count when it was taken
    procs: dict[int, Proc] = field(default_factory=dict)
    training: tuple[Proc, ...] = ()  # those whose argv has the token "finetune"
    children: dict[int, list[int]] = field(default_factory=dict)  # ppid -> pids


_SCAN_LOCK = threading.Lock()
_SNAPSHOT = Snapshot()
_GENERATION = 0


def _stat(pid: int) -> list[str] | None:
    """The fields of /proc/<pid>/stat after the command name (state first); None when it is gone."""
    try:
        text = Path(f"/proc/{pid}/stat").read_text()
    except (OSError, ValueError):
        return None
    return text[text.rindex(")") + 2 :].split()


def proc_stat(pid: int) -> tuple[str, int] | None:
    """(state letter, process group) of a live pid, from /proc; None when it is gone."""
    fields = _stat(pid)
    return None if fields is None else (fields[0], int(fields[2]))


def _have_proc() -> bool:
    return Path("/proc/self/stat").exists()


def _scan() -> dict[int, Proc]:
    """One pass over /proc: every live, not zombie, process."""
    procs = {}
    with contextlib.suppress(OSError):
        for entry in os.listdir("/proc"):
            if not entry.isdigit():
                continue
            fields = _stat(int(entry))
            if fields is None or fields[0] in "ZX":
                continue
            try:
                raw = Path(f"/proc/{entry}/cmdline").read_bytes()
            except OSError:
                continue
            args = tuple(a.decode(errors="replace") for a in raw.rstrip(b"\0").split(b"\0")) if raw else ()
            procs[int(entry)] = Proc(int(entry), int(fields[1]), int(fields[2]), args)
    return procs


def changed() -> None:
    """Processes were launched, signalled or reaped: the next snapshot() scans afresh."""
    global _GENERATION
    with _SCAN_LOCK:
        _GENERATION += 1


def snapshot(max_age: float = SCAN_SECONDS) -> Snapshot:
    """The processes now, from a scan at most ``max_age`` s old (0: a fresh one). Concurrent
    callers share one scan: the others wait for it rather than scanning too."""
    global _SNAPSHOT
    _reap(wait=False)  # before _SCAN_LOCK: it takes LOCK
    with _SCAN_LOCK:
        snap = _SNAPSHOT
        if snap.generation == _GENERATION and time.monotonic() - snap.taken < max_age:
            return snap
        taken, wall = time.monotonic(), time.time()
        procs = _scan() if _have_proc() else {}
        children: dict[int, list[int]] = {}
        for p in procs.values():
            children.setdefault(p.ppid, []).append(p.pid)
        training = tuple(p for p in procs.values() if "finetune" in p.args)
        _SNAPSHOT = Snapshot(snap.serial + 1, taken, wall, _GENERATION, procs, training, children)
        return _SNAPSHOT


# --------------------------------------------------------------------------- liveness


def _launched_here(snap: Snapshot) -> list[tuple[int, Path]]:
    """(pid, run folder) of launchers started by this process and still running: ours for sure
    (not reaped, so the pid is not reused), even in the moment after exec when /proc shows no
    command line yet. Without /proc (macOS) they are all a run can be known by."""
    children = dict(_CHILDREN)  # one copy under the GIL, not LOCK: a poll never waits for a start
    return [(pid, run_dir) for pid, (_, run_dir) in children.items() if pid in snap.procs or not _have_proc()]


def _with_descendants(snap: Snapshot, pids: set[int]) -> set[int]:
    out, todo = set(pids), list(pids)
    while todo:
        for child in snap.children.get(todo.pop(), ()):
            if child not in out:
                out.add(child)
                todo.append(child)
    return out


def run_pids(run_dir: Path, snap: Snapshot | None = None) -> set[int]:
    """Every live process of the run in ``run_dir``, whatever its process group."""
    snap = snap or snapshot()
    folder = str(run_dir)
    ours = {p.pid for p in snap.training if folder in p.folders()}
    ours |= {pid for pid, launched in _launched_here(snap) if str(launched) == folder}
    return _with_descendants(snap, ours)


def run_alive(run_dir: Path, snap: Snapshot | None = None) -> bool:
    """Does any process of this run live?"""
    return bool(run_pids(run_dir, snap))


def live_runs(root: Path, snap: Snapshot | None = None) -> dict[str, set[int]]:
    """Run id -> live processes, for every run folder directly under ``root`` that a live
    training process names (a folder without run.json too: it is still a run writing there)."""
    snap = snap or snapshot()
    found: dict[str, set[int]] = {}
    for p in snap.training:
        for folder in p.folders():
            name = os.path.basename(folder)
            if os.path.dirname(folder) == str(root) and RUN_ID_RE.match(name):
                found.setdefault(name, set()).add(p.pid)
    for pid, run_dir in _launched_here(snap):
        if run_dir.parent == Path(root):
            found.setdefault(run_dir.name, set()).add(pid)
    return {run_id: _with_descendants(snap, pids) for run_id, pids in found.items()}


# --------------------------------------------------------------------------- launch and reaping


def spawn(argv: list[str], run_dir: Path, log) -> subprocess.Popen:
    """Start ``argv`` in the repository root, in a new session, with ``run_env()``, stdout and
    stderr into the open file ``log``. A waiter thread reaps it and records its exit code in
    run.json, once run.json names its pid: call this holding LOCK until run.json is written."""
    env = {**run_env(), "PYTHONUNBUFFERED": "1"}  # live log; env is never written anywhere
    proc = subprocess.Popen(
        argv,
        cwd=ROOT,
        env=env,
        stdin=subprocess.DEVNULL,
        stdout=log,
        stderr=subprocess.STDOUT,
        start_new_session=True,
        close_fds=True,
    )
    with LOCK:
        _CHILDREN[proc.pid] = (proc, run_dir)
    changed()
    threading.Thread(target=_wait_child, args=(proc, run_dir), daemon=True, name=f"reap-{run_dir.name}").start()
    return proc


def _record_exit(proc: subprocess.Popen, run_dir: Path) -> None:
    """Note a reaped child's exit code in run.json (once; whoever notices first)."""
    with LOCK:
        if _CHILDREN.pop(proc.pid, None) is None:
            return
        with contextlib.suppress(OSError, ValueError, KeyError, IndexError):
            info = read_info(run_dir)
            if info.get("pid") == proc.pid:
                info["exit_code"] = proc.returncode
                info["attempts"][-1]["exit_code"] = proc.returncode
                write_info(run_dir, info)
        changed()


def _reap(wait: bool = True) -> None:
    """Collect exit codes of children launched by this process (no zombies left behind); runs
    before every scan, so a run that looks gone has its exit code recorded. Unless ``wait``, it
    skips while another thread holds LOCK (a start splitting a large upload): a poll must not
    wait for that, and the waiter threads reap anyway."""
    if not LOCK.acquire(blocking=wait):
        return
    try:
        for proc, run_dir in list(_CHILDREN.values()):
            if proc.poll() is not None:
                _record_exit(proc, run_dir)
    finally:
        LOCK.release()


def _wait_child(proc: subprocess.Popen, run_dir: Path) -> None:
    """Waiter thread: reaps the child as soon as it exits, even if nobody asks for status."""
    proc.wait()
    _record_exit(proc, run_dir)


# --------------------------------------------------------------------------- stopping


def _signal_run(run_dir: Path, sig: int) -> set[int]:
    """Send ``sig`` to every process of the run and to each of their process groups (a rank's
    group also holds the workers it started), never to this process or its group."""
    snap = snapshot(0)
    pids = run_pids(run_dir, snap)
    own = {os.getpid(), os.getpgrp()}
    # without /proc only launchers started here are known: each leads its group (a new session)
    groups = {snap.procs[p].pgid if p in snap.procs else p for p in pids} - own - {0, 1}
    for pgid in groups:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(pgid, sig)
    for pid in pids - own:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.kill(pid, sig)
    changed()
    log.info("%s sent to %d process(es) of run %s", signal.Signals(sig).name, len(pids), run_dir.name)
    return pids


def _gone_within(run_dir: Path, seconds: float) -> bool:
    deadline = time.monotonic() + seconds
    while run_alive(run_dir, snapshot(0)):
        if time.monotonic() >= deadline:
            return False
        time.sleep(POLL_SECONDS)
    return True


def _escalate(run_dir: Path, grace: float, term_seconds: float) -> str | None:
    """After a STOP file: wait ``grace`` s for every process of the run to exit, then SIGTERM
    them all (the CLI saves a checkpoint on it), then SIGKILL them all after ``term_seconds``
    more. Returns the last signal sent."""
    sent = None
    for sig, wait in ((signal.SIGTERM, grace), (signal.SIGKILL, term_seconds)):
        if _gone_within(run_dir, wait):
            return sent
        _signal_run(run_dir, sig)
        sent = sig.name
    # SIGKILL cannot be ignored, but a launcher may be starting a rank at that moment: again
    # while any is left
    deadline = time.monotonic() + KILL_SECONDS
    while not _gone_within(run_dir, 1.0) and time.monotonic() < deadline:
        _signal_run(run_dir, signal.SIGKILL)
    return sent


def stop_in_background(run_dir: Path, grace: float, term_seconds: float, on_kill: Callable[[], None]) -> None:
    """Escalate (see ``_escalate``) in a thread, unless one already does for this run. If it had
    to SIGKILL, ``on_kill()`` runs under LOCK before the run stops counting as stopping, so a
    viewer never sees it failed without the reason."""
    with LOCK:
        if str(run_dir) in _STOPPING:
            return
        _STOPPING.add(str(run_dir))
    changed()
    threading.Thread(
        target=_stop_worker, args=(run_dir, grace, term_seconds, on_kill), daemon=True, name=f"stop-{run_dir.name}"
    ).start()


def _stop_worker(run_dir: Path, grace: float, term_seconds: float, on_kill: Callable[[], None]) -> None:
    try:
        if _escalate(run_dir, grace, term_seconds) == "SIGKILL":
            with LOCK:
                on_kill()
    finally:
        with LOCK:
            _STOPPING.discard(str(run_dir))
        changed()


def is_stopping(run_dir: Path) -> bool:
    """Is a stop-escalation thread of this process still at work on ``run_dir``?"""
    return str(run_dir) in _STOPPING
