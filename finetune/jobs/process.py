"""A run's processes: launch, liveness, signals, stop escalation, reaping.

A run is launched in a new session, so the launcher and every rank it starts share one process
group (pgid = the launcher's pid) that can be signalled at once. Liveness is read from /proc,
and a process counts only if its command line names finetune and the run folder: pids get
reused, and a reload of the app must not mistake another process for a run.

This process's own bookkeeping is module state, shared by every RunManager in the process (a
page reload or a second viewer makes a new one):

    LOCK        one re-entrant lock for all of it, and for every read-modify-write of run.json
                (here and in manager.py): one lock, so there is no lock order to get wrong
    _CHILDREN   runs launched here and not reaped yet: their exit code goes into run.json
    _STOPPING   run folders with a stop-escalation thread: they show as "stopping" until it ends
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import threading
import time
from collections.abc import Callable
from pathlib import Path

from chat.layout import ROOT
from finetune.jobs.paths import read_info, write_info

LOCK = threading.RLock()
_CHILDREN: dict[int, tuple[subprocess.Popen, Path]] = {}  # pid -> (process, run folder)
_STOPPING: set[str] = set()


# --------------------------------------------------------------------------- liveness


def proc_stat(pid: int) -> tuple[str, int] | None:
    """(state letter, process group) of a live pid, from /proc; None when it is gone."""
    try:
        text = Path(f"/proc/{pid}/stat").read_text()
    except (OSError, ValueError):
        return None
    fields = text[text.rindex(")") + 2:].split()
    return fields[0], int(fields[2])


def _cmdline(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
    except OSError:
        return ""


def _is_ours(pid: int, run_dir: Path) -> bool:
    """A live (not zombie) training process of this run: pids get reused, so check its command."""
    for _ in range(50):
        stat = proc_stat(pid)
        if stat is None or stat[0] in "ZX":
            return False
        cmd = _cmdline(pid)
        if cmd:
            return "finetune" in cmd and str(run_dir) in cmd
        time.sleep(0.01)  # a process that has just exec'ed can show an empty cmdline for a moment
    return False


def _group_members(pgid: int) -> list[int]:
    """Live (not zombie) processes of a process group."""
    members = []
    try:
        entries = os.listdir("/proc")
    except OSError:
        return []
    for entry in entries:
        if entry.isdigit():
            stat = proc_stat(int(entry))
            if stat and stat[1] == pgid and stat[0] not in "ZX":
                members.append(int(entry))
    return members


def _have_proc() -> bool:
    return Path("/proc/self/stat").exists()


def run_alive(run_dir: Path, info: dict) -> bool:
    """Is this run's launcher, or any of its processes, still running? (``info``: its run.json)"""
    _reap()
    pid, pgid = info.get("pid"), info.get("pgid")
    if not pid:
        return False
    if not _have_proc():  # no /proc (macOS): the best we can do is "a process has this pid"
        try:
            os.kill(pid, 0)
            return True
        except (ProcessLookupError, PermissionError):
            return False
    if _is_ours(pid, run_dir):
        return True
    return bool(pgid) and any(_is_ours(p, run_dir) for p in _group_members(pgid))


def _group_gone(pgid: int, run_dir: Path) -> bool:
    _reap()
    if _have_proc():
        return not any(_is_ours(p, run_dir) for p in _group_members(pgid))
    try:
        os.killpg(pgid, 0)
        return False
    except (ProcessLookupError, PermissionError):
        return True


# --------------------------------------------------------------------------- launch and reaping


def spawn(argv: list[str], run_dir: Path, log) -> subprocess.Popen:
    """Start ``argv`` in the repository root, in a new session, stdout and stderr into the open
    file ``log``. A waiter thread reaps it and records its exit code in run.json, once run.json
    names its pid: call this holding LOCK until run.json is written."""
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}  # live log; env is never written anywhere
    proc = subprocess.Popen(argv, cwd=ROOT, env=env, stdin=subprocess.DEVNULL, stdout=log,
                            stderr=subprocess.STDOUT, start_new_session=True, close_fds=True)
    with LOCK:
        _CHILDREN[proc.pid] = (proc, run_dir)
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


def _reap() -> None:
    """Collect exit codes of children launched by this process (no zombies left behind); runs
    before every liveness check, so a run that looks gone has its exit code recorded."""
    with LOCK:
        for proc, run_dir in list(_CHILDREN.values()):
            if proc.poll() is not None:
                _record_exit(proc, run_dir)


def _wait_child(proc: subprocess.Popen, run_dir: Path) -> None:
    """Waiter thread: reaps the child as soon as it exits, even if nobody asks for status."""
    proc.wait()
    _record_exit(proc, run_dir)


# --------------------------------------------------------------------------- stopping


def _signal_group(pgid: int, sig: int) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pgid, sig)


def _escalate(run_dir: Path, pgid: int, grace: float, term_seconds: float) -> str | None:
    """After a STOP file: wait ``grace`` s for the group to exit, then SIGTERM (the CLI saves a
    checkpoint on it), then SIGKILL after ``term_seconds`` more. Returns the last signal sent."""
    sent = None
    for sig, wait in ((signal.SIGTERM, grace), (signal.SIGKILL, term_seconds)):
        deadline = time.monotonic() + wait
        while time.monotonic() < deadline:
            if _group_gone(pgid, run_dir):
                return sent
            time.sleep(0.25)
        if _group_gone(pgid, run_dir):
            return sent
        _signal_group(pgid, sig)
        sent = sig.name
    deadline = time.monotonic() + 5
    while time.monotonic() < deadline and not _group_gone(pgid, run_dir):
        time.sleep(0.1)
    return sent


def stop_in_background(run_dir: Path, pgid: int, grace: float, term_seconds: float,
                       on_kill: Callable[[], None]) -> None:
    """Escalate (see ``_escalate``) in a thread, unless one already does for this run. If it had
    to SIGKILL, ``on_kill()`` runs under LOCK before the run stops counting as stopping, so a
    viewer never sees it failed without the reason."""
    with LOCK:
        if str(run_dir) in _STOPPING:
            return
        _STOPPING.add(str(run_dir))
    threading.Thread(target=_stop_worker, args=(run_dir, pgid, grace, term_seconds, on_kill), daemon=True,
                     name=f"stop-{run_dir.name}").start()


def _stop_worker(run_dir: Path, pgid: int, grace: float, term_seconds: float, on_kill: Callable[[], None]) -> None:
    try:
        if _escalate(run_dir, pgid, grace, term_seconds) == "SIGKILL":
            with LOCK:
                on_kill()
    finally:
        with LOCK:
            _STOPPING.discard(str(run_dir))


def is_stopping(run_dir: Path) -> bool:
    """Is a stop-escalation thread of this process still at work on ``run_dir``?"""
    return str(run_dir) in _STOPPING
