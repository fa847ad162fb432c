"""Training-state checkpoints and the final model folder, both written so a crash never
leaves a half-written folder where a good one was: write under a temporary name, then rename.

Layout of an output directory::

    metrics.jsonl             one JSON object per event (the app reads it live)
    checkpoints/step_<N>/     full training state (accelerate + DeepSpeed), trainer_state.json, manifest.json
    final/                    save_pretrained model, tokenizer, training_args.json, model card
    all_results.json          eval BLEU and epoch times of the last evaluation

A checkpoint's manifest.json (written last, right before the rename) lists every file's size and
sha256. A resume checks the checkpoint against it before loading anything: ``latest`` skips a
corrupt checkpoint for the next newest intact one (a ``checkpoint_skipped`` event says what was
wrong), while a checkpoint named by path must be intact. A failed save (a full disk, a file-size
limit, a quota, a read-only folder) is a TrainingError naming the file and the cause
(``finetune.writes``), recorded by the rank it happened on (see ``saving``).
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import logging
import math
import os
import re
import shutil
import time
import zipfile
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

from finetune.writes import free_space, human_bytes, is_disk_full, write_error, writing

# The standard logger: resume checks run before the accelerator (and accelerate's logger) exists.
log = logging.getLogger(__name__)

CHECKPOINTS = "checkpoints"
STATE_FILE = "trainer_state.json"
MANIFEST_FILE = "manifest.json"
RNG_FILE = re.compile(r"random_states_(\d+)\.pkl")  # accelerate's RNG states of process N
METRICS_FILE = "metrics.jsonl"
STOP_FILE = "STOP"  # created by the app (or a user) to ask a run to checkpoint and stop
# trainer_state.json's open loss window: {"loss_sum", "count"} of the losses since the last log
# step, over all processes. A resume continues it, so its loss curve is the uninterrupted run's.
WINDOW = "loss_window"


class TrainingError(RuntimeError):
    """A run cannot go on (out of memory, non-finite loss, full disk, corrupt checkpoint); the
    message says why. ``file`` is the file or folder it is about and ``step`` the step it stopped
    at, when known. ``recorded``: its error event is already in metrics.jsonl (a failed save
    records its own, see ``saving``)."""

    def __init__(self, message: str, *, file: str | None = None, step: int | None = None):
        super().__init__(message)
        self.file, self.step = file, step
        self.recorded = False


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


def saved_window(state: dict) -> tuple[float, float] | None:
    """(loss sum, count) of the loss window open when the checkpoint with this trainer_state was
    saved; None when it has none (saved before checkpoints kept it) or not a usable one."""
    window = state.get(WINDOW)
    try:
        loss_sum, count = float(window["loss_sum"]), float(window["count"])
    except (TypeError, KeyError, ValueError):
        return None
    if not (math.isfinite(loss_sum) and math.isfinite(count) and count >= 0):
        return None
    return loss_sum, count


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


# --------------------------------------------------------------------------- saving


def save_checkpoint(accelerator, output_dir: str | Path, state: dict, keep: int, **save_kwargs) -> Path:
    """Save the full training state on every rank, add trainer_state.json and the manifest,
    then publish it with one rename. ``save_kwargs`` go to ``accelerator.save_state``."""
    root = Path(output_dir) / CHECKPOINTS
    final = root / f"step_{state['completed_steps']}"
    tmp = root / f".{final.name}.tmp"
    with saving(final, output_dir, tmp=tmp, step=state["completed_steps"]):
        if accelerator.is_main_process:
            shutil.rmtree(tmp, ignore_errors=True)  # left over from a crash
            tmp.mkdir(parents=True)
        accelerator.wait_for_everyone()
        accelerator.save_state(str(tmp), **save_kwargs)
        accelerator.wait_for_everyone()
        if accelerator.is_main_process:
            state = {**state, "num_processes": accelerator.num_processes, "time": time.time()}
            (tmp / STATE_FILE).write_text(json.dumps(state, indent=2))
            write_manifest(tmp)  # last: a folder with a manifest was written completely
            publish_dir(tmp, final)  # (replaces the same step saved by an earlier attempt)
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


def sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as fh:
        while chunk := fh.read(1 << 20):
            digest.update(chunk)
    return digest.hexdigest()


def write_manifest(folder: Path) -> None:
    """manifest.json: every file's relative path, size and sha256 (the manifest itself excepted)."""
    files = sorted(p for p in folder.rglob("*") if p.is_file() and p.name != MANIFEST_FILE)
    entries = {p.relative_to(folder).as_posix(): {"size": p.stat().st_size, "sha256": sha256(p)} for p in files}
    (folder / MANIFEST_FILE).write_text(json.dumps({"version": 1, "files": entries}, indent=1))


# --------------------------------------------------------------------------- a failed save


@contextmanager
def saving(target: Path, output_dir: str | Path, *, tmp: Path | None = None, step: int | None = None):
    """Around a save, on every rank: a full disk becomes TrainingError "disk full while saving
    <target>: <free> free on <mount>", any other failed write "saving <target> failed: cannot write
    <file>: <cause>" (``finetune.writes``: a file-size limit, a quota, a read-only folder...), and
    the half-written ``tmp`` folder is removed.

    The rank the disk filled up on writes the error event itself, before it removes ``tmp``: a
    save can fail on one rank only, and then the other ranks fail too, in DeepSpeed's barrier
    ("Connection closed by peer") or on the folder removed under them, and only this rank knows
    why. Those ranks see the event and end with "failed on another process"; two ranks that fill
    the disk at once record one event (a lock on metrics.jsonl)."""
    try:
        yield
    except Exception as err:
        failure = None
        if is_disk_full(err, target.parent):
            free, mount = free_space(target.parent)
            failure = TrainingError(
                f"disk full while saving {target}: {human_bytes(free)} free on {mount}", file=str(target), step=step
            )
        elif (written := write_error(err, tmp or target)) is not None:  # a file-size limit, a quota, no permission...
            failure = TrainingError(f"saving {target} failed: {written}", file=str(target), step=step)
        recorded = record_save_failure(output_dir, target, failure, tmp)
        if tmp is not None:
            shutil.rmtree(tmp, ignore_errors=True)
        if failure is None and recorded:  # this rank's part broke because another's failed
            reason = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
            failure = TrainingError(
                f"saving {target} failed on another process ({reason})", file=str(target), step=step
            )
        if failure is None:
            raise  # no failed write: cli.main() reports it as any other failure
        failure.recorded = recorded
        raise failure from err


def record_save_failure(output_dir, target: Path, failure: TrainingError | None, tmp: Path | None) -> bool:
    """Append ``failure``'s error event unless another rank recorded one about ``target``.
    True if the failure of this save is in metrics.jsonl now (whoever wrote it)."""
    path = Path(output_dir) / METRICS_FILE
    try:
        with open(path, "a+b") as fh:
            fcntl.flock(fh, fcntl.LOCK_EX)
            last = last_event(fh)
            if last.get("event") == "error" and last.get("file") == str(target):
                return True
            if failure is None:
                return False
            fields = {"kind": "TrainingError", "message": str(failure), "file": failure.file}
            if failure.step is not None:
                fields["step"] = failure.step
            line = (json.dumps({"event": "error", "time": round(time.time(), 3), **fields}) + "\n").encode()
            try:
                fh.write(line)
                fh.flush()
            except OSError:  # the disk is still full: free what this save wrote, then try again
                if tmp is not None:
                    shutil.rmtree(tmp, ignore_errors=True)
                fh.write(line)
                fh.flush()
            return True
    except OSError as err:
        log.warning(f"could not record the failed save in {path}: {err}")
        return False


def last_event(fh) -> dict:
    """The last complete event of an open metrics.jsonl ({} if none)."""
    size = fh.seek(0, os.SEEK_END)
    fh.seek(max(0, size - 65536))
    lines = [line for line in fh.read().splitlines() if line.strip()]
    try:
        event = json.loads(lines[-1]) if lines else {}
    except ValueError:  # a line cut short by a crash
        return {}
    return event if isinstance(event, dict) else {}


# --------------------------------------------------------------------------- verifying before a resume


@dataclass
class Verdict:
    """What checking one checkpoint found: ``problems`` as (file relative to it, what is wrong)."""

    path: Path
    problems: list[tuple[str, str]] = field(default_factory=list)
    verified: bool = False  # checked against a manifest (False: a checkpoint from before manifests)
    saved_processes: int | None = None

    def add(self, rel: str, what: str) -> None:
        rng = RNG_FILE.fullmatch(rel)
        if rng:  # accelerate would skip it with an INFO line, and the run would silently differ
            what += f" (the RNG state of process {rng[1]}: a resume from it would not be bit-identical)"
        self.problems.append((rel, what))

    @property
    def intact(self) -> bool:
        return not self.problems

    @property
    def first_file(self) -> str:
        return str(self.path / self.problems[0][0])

    def describe(self) -> str:
        return "; ".join(f"{self.path / rel}: {what}" for rel, what in self.problems)


def check_checkpoint(path: Path, processes: int) -> Verdict:
    """Check a checkpoint without loading it: trainer_state.json, then every file against the
    manifest (sizes first; the sha256 of each only when all sizes match). A checkpoint without a
    manifest (saved before there were any) can only get its RNG state files checked, for the
    ``processes`` that will resume it."""
    verdict = Verdict(path)
    try:
        state = json.loads((path / STATE_FILE).read_text())
        if not isinstance(state, dict) or not isinstance(state.get("completed_steps"), int):
            verdict.add(STATE_FILE, "has no completed_steps")
        else:
            verdict.saved_processes = state.get("num_processes")
    except FileNotFoundError:
        verdict.add(STATE_FILE, "missing")
    except (ValueError, UnicodeDecodeError) as err:
        verdict.add(STATE_FILE, f"not valid JSON ({err})")
    if (path / MANIFEST_FILE).is_file():
        verdict.verified = True
        check_manifest(path, verdict)
    else:
        for rank in range(processes):
            rel = f"random_states_{rank}.pkl"
            if not (path / rel).is_file():
                verdict.add(rel, "missing")
            elif not zip_intact(path / rel):
                verdict.add(rel, "unreadable (not an intact torch.save file)")
    return verdict


def check_manifest(path: Path, verdict: Verdict) -> None:
    try:
        entries = json.loads((path / MANIFEST_FILE).read_text())["files"]
        assert isinstance(entries, dict)
    except (ValueError, UnicodeDecodeError, KeyError, TypeError, AssertionError):
        verdict.add(MANIFEST_FILE, "not a valid manifest")
        return
    seen = {rel for rel, _ in verdict.problems}
    same_size = []
    for rel, want in entries.items():
        if rel in seen:
            continue
        try:
            size = (path / rel).stat().st_size
        except FileNotFoundError:
            verdict.add(rel, "missing")
            continue
        if size == want["size"]:
            same_size.append((rel, want))
        elif size == 0:
            verdict.add(rel, f"empty (0 of {want['size']} bytes)")
        else:
            verdict.add(rel, f"{'truncated: ' if size < want['size'] else ''}{size} bytes, {want['size']} when saved")
    if verdict.problems:
        return  # corrupt already: no need to read gigabytes to confirm it
    for rel, want in same_size:
        if sha256(path / rel) != want["sha256"]:
            verdict.add(rel, "contents changed since it was saved (sha256 mismatch)")


def zip_intact(path: Path) -> bool:
    """torch.save files are zip archives with CRCs: check them without unpickling anything."""
    try:
        with zipfile.ZipFile(path) as archive:
            return archive.testzip() is None
    except (zipfile.BadZipFile, OSError, EOFError, ValueError):
        return False


def choose_checkpoint(output_dir: str | Path, spec: str, processes: int, metrics: MetricsWriter) -> Path:
    """The checkpoint ``--resume_from_checkpoint`` resumes from, checked before anything loads.

    'latest': the newest intact checkpoint; each corrupt newer one is skipped with a warning and a
    ``checkpoint_skipped`` event {path, file, problems, resuming_from}. A path: that checkpoint,
    which must be intact (a TrainingError naming the bad file; no silent fallback). A missing or
    unreadable RNG state file makes a checkpoint corrupt too: resuming from it would quietly give
    other results than the uninterrupted run (README promise), so it is refused; deleting that
    checkpoint makes ``latest`` use the previous one. A checkpoint without manifest still loads
    (``checkpoint_unverified`` event), as does one saved by another number of processes
    (``resume_not_identical`` event: the data order and RNG streams differ anyway)."""
    named = find_checkpoint(output_dir, spec)  # CheckpointNotFound when there is none
    candidates = list_checkpoints(output_dir)[::-1] if spec == "latest" else [named]
    skipped: list[Verdict] = []
    for path in candidates:
        verdict = check_checkpoint(path, processes)
        if verdict.intact:
            break
        if spec != "latest":
            raise TrainingError(
                f"checkpoint {path} is corrupt: {verdict.describe()}. Resume from another "
                "checkpoint, or delete this one and resume from the newest intact one with "
                "--resume_from_checkpoint latest",
                file=verdict.first_file,
            )
        skipped.append(verdict)
    else:
        root = Path(output_dir) / CHECKPOINTS
        raise TrainingError(
            f"no intact checkpoint to resume from in {root}: " + "; ".join(v.describe() for v in skipped),
            file=str(root),
        )
    for bad in skipped:
        log.warning(f"skipping corrupt checkpoint {bad.path}: {bad.describe()}; resuming from {path} instead")
        metrics.write(
            "checkpoint_skipped",
            path=str(bad.path),
            file=bad.first_file,
            problems=[f"{rel}: {what}" for rel, what in bad.problems],
            resuming_from=str(path),
        )
    if not verdict.verified:
        log.warning(
            f"{path} has no {MANIFEST_FILE} (saved before checkpoints had one): its files cannot be "
            "verified before loading"
        )
        metrics.write("checkpoint_unverified", path=str(path))
    if verdict.saved_processes not in (None, processes):
        reason = (
            f"saved by {verdict.saved_processes} processes, resumed on {processes}: the data order and "
            "RNG streams differ from the uninterrupted run"
        )
        log.warning(f"the resume from {path} will not be bit-identical: {reason}")
        metrics.write("resume_not_identical", path=str(path), reason=reason)
    return path


class MetricsWriter:
    """Appends one JSON line per event to metrics.jsonl (main process only), flushed at once."""

    def __init__(self, output_dir: str | Path, enabled: bool):
        self.path = Path(output_dir) / METRICS_FILE
        self.enabled = enabled

    def write(self, event: str, **fields) -> None:
        """Append one event; a failed write is a WriteError naming metrics.jsonl and the cause."""
        if not self.enabled:
            return
        with writing(self.path):
            self.path.parent.mkdir(parents=True, exist_ok=True)
            with open(self.path, "a") as fh:
                fh.write(json.dumps({"event": event, "time": round(time.time(), 3), **fields}) + "\n")
