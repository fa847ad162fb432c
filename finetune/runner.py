"""The logic behind the app's Train tab, as plain Python: describe a run, launch it in the
background with the same command a user would type, watch it, stop it, resume it, push it.

A run lives in one directory, ``RUNS_ROOT/<run_id>/``::

    run.json        the spec, the command (argv), pid/pgid, start time, and every launch attempt
    train.log       stdout + stderr of the launcher and all its processes (appended on resume)
    data/           train/validation split of an uploaded train file given without a validation file
    metrics.jsonl   written by the training CLI (see finetune/train.py), read here for status
    checkpoints/    final/    all_results.json    STOP     (written by the CLI / by stop())

Everything the app shows is derived from that directory plus process liveness, so a page
reload, a second viewer or a restarted app re-attaches to a run: nothing important lives only
in memory. One run at a time per runs root, across RunManager instances and processes (the
check reads run.json pids, under a file lock).

Data given as a local file: ``dataset`` is the uploaded train file; with ``validation_file``
both are used as they are. Without one, ``start()`` validates the upload and holds out its
last 10% of rows (at least one) as the validation split: both parts are written to the run's
own ``data/`` folder (not next to the upload), so the upload is never modified, a run is
self-contained, resume sees the same split, and no validation row is also trained on.

Security: run ids must match ``RUN_ID_RE``; a model or dataset given as a local path must
resolve (symlinks followed) inside an allowed root (``allowed_roots()``); commands are
argument lists, never a shell; the environment (and so ``HF_TOKEN``) is passed to the child
but never written anywhere.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import math
import os
import re
import secrets
import shlex
import signal
import socket
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

from chat.layout import FINAL, RESULTS_FILE, ROOT, SAMPLE_DIR, is_hub_id
from chat.model import MODEL_PRESETS
from finetune import checkpoint as ckpt

ACCELERATE_DIR = Path("configs") / "accelerate"  # relative: the child runs with cwd=ROOT

RUNS_ROOT = Path(os.environ.get("PERSONA_CHAT_RUNS", "runs"))
DATA_ROOT = Path(os.environ.get("PERSONA_CHAT_DATA", "data/uploads"))

MAX_UPLOAD_BYTES = 50 * 1024 * 1024  # 50 MB, checked before a file is parsed
VALIDATION_FRACTION = 0.1  # held out of an uploaded train file that comes without a validation file

RUN_ID_RE = re.compile(r"^\d{8}-\d{6}-[0-9a-f]{6}$")
RUN_FILE = "run.json"
LOG_FILE = "train.log"
SPLIT_DIR = "data"

STRATEGIES = {"zero2": "zero2.yaml", "zero3_offload": "zero3_offload.yaml", "ddp": "ddp.yaml"}
CPU_CONFIG = "cpu_zero2.yaml"
PRECISIONS = ("auto", "bf16", "fp16", "fp32")
STATES = ("idle", "running", "stopping", "stopped", "finished", "failed")
DEFAULT_VAL_MIN_TARGET = 20  # the CLI's --val_min_target_length default
LOG_TAIL_LINES = 40

_ERROR_LINE = re.compile(r"^\d\d:\d\d:\d\d ERROR [\w.]+: (.+)$")  # finetune.train.main's log format
_ARGPARSE_ERROR = re.compile(r"^python -m finetune: error: (.+)$")
_EXCEPTION_LINE = re.compile(r"^(?:[A-Za-z_][\w]*\.)*[A-Za-z_]\w*(?:Error|Exception|Interrupt): .+$")
_LAUNCHER_NOISE = ("ChildFailedError", "CalledProcessError")

# Every RunManager root is an allowed root for local model paths (its runs' final/ folders).
_MANAGER_ROOTS: set[Path] = set()
_LOCK = threading.RLock()  # run.json read-modify-write and start/resume inside this process
_CHILDREN: dict[int, tuple[subprocess.Popen, Path]] = {}  # launched here, not yet reaped
_STOPPING: set[str] = set()  # run dirs with a stop-escalation thread


class RunBusyError(RuntimeError):
    """Another run is still running; only one runs at a time."""


# --------------------------------------------------------------------------- paths


def runs_root() -> Path:
    """Where the Train tab writes runs and the model picker finds finished ones (PERSONA_CHAT_RUNS)."""
    return Path(os.environ.get("PERSONA_CHAT_RUNS", "runs"))


def data_root() -> Path:
    """Where the app keeps validated uploads (PERSONA_CHAT_DATA, read at call time); an allowed root."""
    return Path(os.environ.get("PERSONA_CHAT_DATA", DATA_ROOT)).expanduser().resolve()


def allowed_roots() -> list[Path]:
    """Folders a local model or dataset path may resolve into (read at call time)."""
    roots = [Path(os.environ.get("PERSONA_CHAT_RUNS", RUNS_ROOT)), data_root(), SAMPLE_DIR, *_MANAGER_ROOTS]
    out = []
    for root in roots:
        resolved = root.expanduser().resolve()
        if resolved not in out:
            out.append(resolved)
    return out


def _looks_like_path(value: str) -> bool:
    return (value.startswith(("/", ".", "~")) or "\\" in value or value.count("/") > 1
            or ".." in Path(value).parts)


def local_path(value: str, what: str) -> Path | None:
    """``value`` as a resolved local path if it is one (else None: a Hub id or keyword).

    A value is a local path when it looks like one (absolute, ``./``, ``~``, ``..``, more than
    one ``/``) or exists relative to the working directory or the repository root (the CLI
    would load an existing ``user/name`` folder instead of the Hub repo). A local path must
    resolve inside ``allowed_roots()``; containment is checked before existence, so an
    outside path is refused the same way whether or not it exists."""
    raw = Path(value).expanduser()
    candidates = [raw] if raw.is_absolute() else [Path.cwd() / raw, ROOT / raw]
    existing = [c for c in candidates if c.exists()]
    if not existing and not _looks_like_path(value):
        return None
    path = (existing or candidates)[0].resolve()
    roots = allowed_roots()
    if not any(path.is_relative_to(root) for root in roots):
        raise ValueError(
            f"{what} {value!r} is a local path outside the allowed folders "
            f"({', '.join(str(r) for r in roots)}); upload the file or pick a finished run"
        )
    if not path.exists():
        raise ValueError(f"{what} {value!r}: no such file or folder")
    return path


# --------------------------------------------------------------------------- the form


def _int(name: str, value, minimum: int | None = 1, optional: bool = False) -> int | None:
    """Form numbers arrive as floats (gr.Number) or empty: accept 3.0, refuse 2.5, True, 'x'."""
    if value is None or value == "":
        if optional:
            return None
        raise ValueError(f"{name} is required")
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ValueError(f"{name} must be a whole number, got {value!r}")
    if isinstance(value, float) and not value.is_integer():
        raise ValueError(f"{name} must be a whole number, got {value!r}")
    value = int(value)
    if minimum is not None and value < minimum:
        raise ValueError(f"{name} must be >= {minimum}, got {value}")
    return value


def _optional_str(value) -> str | None:
    if value is None:
        return None
    if not isinstance(value, str):
        raise ValueError(f"expected text, got {value!r}")
    return value.strip() or None


@dataclass
class RunSpec:
    """One field per Train-tab input. Validated on creation (clear ``ValueError`` messages);
    local paths are replaced by their resolved absolute form."""

    model: str = "tiny"  # preset ("tiny", "random-400M"), Hub id, or a local checkpoint folder
    dataset: str = "sample"  # "sample", a Hub dataset id, or an uploaded train file
    validation_file: str | None = None  # uploaded validation file (only with an uploaded train file)
    n_train: int | None = None
    n_val: int | None = None
    epochs: int = 3
    learning_rate: float = 1e-3  # suits the tiny preset; the 400M model wants ~1e-6..5e-5
    train_batch_size: int = 16
    eval_batch_size: int = 32
    max_source_length: int = 128
    max_target_length: int = 64
    source_prefix: str = "chatbot: "
    strategy: str = "zero2"  # "zero2" | "zero3_offload" | "ddp" (GPUs; the CPU always uses ZeRO-2)
    precision: str = "auto"  # "auto" | "bf16" | "fp16" | "fp32"
    num_gpus: int = 0  # 0 = CPU: configs/accelerate/cpu_zero2.yaml, 2 processes (1 on a 1-core machine)
    checkpointing_steps: int | None = None
    num_beams: int = 4
    push_to_hub: bool = False
    hub_model_id: str | None = None
    hub_private: bool = False
    logging_steps: int = 10  # loss / progress points every N optimizer steps

    def __post_init__(self):
        for name in ("n_train", "n_val", "checkpointing_steps"):
            setattr(self, name, _int(name, getattr(self, name), optional=True))
        for name in ("epochs", "train_batch_size", "eval_batch_size", "max_source_length",
                     "max_target_length", "num_beams", "logging_steps"):
            setattr(self, name, _int(name, getattr(self, name)))
        self.num_gpus = _int("num_gpus", self.num_gpus, minimum=0)
        if isinstance(self.learning_rate, bool) or not isinstance(self.learning_rate, (int, float)):
            raise ValueError(f"learning_rate must be a number, got {self.learning_rate!r}")
        self.learning_rate = float(self.learning_rate)
        if not (math.isfinite(self.learning_rate) and self.learning_rate > 0):
            raise ValueError(f"learning_rate must be > 0, got {self.learning_rate}")
        if not isinstance(self.source_prefix, str):
            raise ValueError("source_prefix must be text")
        for name in ("push_to_hub", "hub_private"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{name} must be true or false, got {getattr(self, name)!r}")

        if self.strategy not in STRATEGIES:
            raise ValueError(f"strategy must be one of {', '.join(STRATEGIES)}, got {self.strategy!r}")
        if self.precision not in PRECISIONS:
            raise ValueError(f"precision must be one of {', '.join(PRECISIONS)}, got {self.precision!r}")
        if self.num_gpus == 0:
            if self.strategy != "zero2":
                raise ValueError(f"strategy {self.strategy!r} needs GPUs; on the CPU (num_gpus 0) training "
                                 "uses DeepSpeed ZeRO-2 (configs/accelerate/cpu_zero2.yaml): choose 'zero2'")
            if self.precision in ("bf16", "fp16"):
                raise ValueError(f"precision {self.precision!r} needs GPUs; on the CPU use 'fp32' or 'auto'")

        self.hub_model_id = _optional_str(self.hub_model_id)
        if self.push_to_hub and not self.hub_model_id:
            raise ValueError("push to Hub needs a Hub model id 'user/name'")
        if self.hub_model_id and not is_hub_id(self.hub_model_id, owner=True):
            raise ValueError(f"Hub model id must look like 'user/name', got {self.hub_model_id!r}")

        self.model = _optional_str(self.model) or ""
        if not self.model:
            raise ValueError("model is required (a preset such as 'tiny', a Hub id, or a finished run)")
        if self.model not in MODEL_PRESETS:
            path = local_path(self.model, "model")
            if path is not None:
                if not (path / "config.json").is_file():
                    raise ValueError(f"model {self.model!r} is not a model folder (no config.json)")
                self.model = str(path)
            elif not is_hub_id(self.model):
                raise ValueError(f"model {self.model!r} is not a preset ({', '.join(MODEL_PRESETS)}), a Hub id "
                                 "('user/name') or an allowed local folder")

        self.dataset = _optional_str(self.dataset) or ""
        self.validation_file = _optional_str(self.validation_file)
        if not self.dataset:
            raise ValueError("dataset is required ('sample', a Hub dataset id, or an uploaded file)")
        if self.dataset != "sample":
            path = local_path(self.dataset, "dataset")
            if path is not None:
                self.dataset = str(_data_file(path, "dataset"))
            elif not is_hub_id(self.dataset):
                raise ValueError(f"dataset {self.dataset!r} is not 'sample', a Hub dataset id or an uploaded file")
        if self.validation_file is not None:
            if not self.is_local_dataset:
                raise ValueError("a validation file goes with an uploaded train file; "
                                 f"dataset {self.dataset!r} brings its own validation split")
            path = local_path(self.validation_file, "validation file")
            if path is None:
                raise ValueError(f"validation file {self.validation_file!r}: no such file")
            self.validation_file = str(_data_file(path, "validation file"))

    @property
    def is_local_dataset(self) -> bool:
        return Path(self.dataset).is_absolute()

    @property
    def holds_out_validation(self) -> bool:
        """An uploaded train file without a validation file: start() splits it."""
        return self.is_local_dataset and self.validation_file is None

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)


def _data_file(path: Path, what: str) -> Path:
    from finetune.data import LOADERS  # lazy: finetune.data imports datasets

    if not path.is_file():
        raise ValueError(f"{what} {str(path)!r} is not a file")
    if path.suffix.lower() not in LOADERS:
        raise ValueError(f"{what} {path.name!r}: unsupported file type (use {', '.join(LOADERS)})")
    return path


# --------------------------------------------------------------------------- commands


def detect_gpus() -> int:
    """Visible CUDA GPUs (honours CUDA_VISIBLE_DEVICES); 0 when there is no CUDA."""
    try:
        import torch

        return torch.cuda.device_count() if torch.cuda.is_available() else 0
    except Exception:  # a broken driver is no GPU for this purpose
        return 0


def gpu_supports_bf16() -> bool:
    try:
        import torch

        return torch.cuda.is_available() and torch.cuda.is_bf16_supported()
    except Exception:
        return False


def cpu_processes() -> int:
    """Processes for a CPU run: 2 (the tested recipe), 1 on a one-core machine."""
    try:
        cores = len(os.sched_getaffinity(0))
    except AttributeError:
        cores = os.cpu_count() or 1
    return 2 if cores >= 2 else 1


def mixed_precision(spec: RunSpec) -> str:
    """The launcher's --mixed_precision value for this spec."""
    if spec.num_gpus == 0 or spec.precision == "fp32":
        return "no"
    if spec.precision == "auto":
        return "bf16" if gpu_supports_bf16() else "fp16"
    return spec.precision


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def split_files(run_dir: Path) -> tuple[Path, Path]:
    return run_dir / SPLIT_DIR / "train.jsonl", run_dir / SPLIT_DIR / "validation.jsonl"


def build_command(spec: RunSpec, run_dir: Path, resume: bool = False) -> list[str]:
    """The argument list that runs ``spec`` into ``run_dir`` (to run with cwd = repository root):
    ``python -m accelerate.commands.launch --config_file ... -m finetune ...``, exactly as the
    README's commands, with ``--resume_from_checkpoint latest`` when resuming."""
    run_dir = Path(run_dir).resolve()
    if spec.num_gpus == 0:
        config, processes = CPU_CONFIG, cpu_processes()
    else:
        config, processes = STRATEGIES[spec.strategy], spec.num_gpus
    argv = [sys.executable, "-m", "accelerate.commands.launch",
            "--config_file", str(ACCELERATE_DIR / config),
            "--num_processes", str(processes),
            "--mixed_precision", mixed_precision(spec),
            "--main_process_port", str(free_port()),
            "-m", "finetune",
            "--model_name_or_path", spec.model]
    if spec.holds_out_validation:
        train, val = split_files(run_dir)
        argv += ["--train_file", str(train), "--validation_file", str(val)]
    elif spec.is_local_dataset:
        argv += ["--train_file", spec.dataset, "--validation_file", spec.validation_file]
    else:
        argv += ["--dataset_name", spec.dataset]
    if spec.n_train is not None:
        argv += ["--n_train", str(spec.n_train)]
    if spec.n_val is not None:
        argv += ["--n_val", str(spec.n_val)]
    argv += ["--num_train_epochs", str(spec.epochs),
             "--learning_rate", repr(spec.learning_rate),
             "--per_device_train_batch_size", str(spec.train_batch_size),
             "--per_device_eval_batch_size", str(spec.eval_batch_size),
             "--max_source_length", str(spec.max_source_length),
             "--max_target_length", str(spec.max_target_length),
             f"--source_prefix={spec.source_prefix}",  # one token: a prefix may start with "-"
             "--num_beams", str(spec.num_beams),
             "--logging_steps", str(spec.logging_steps)]
    if spec.max_target_length < DEFAULT_VAL_MIN_TARGET:  # the CLI refuses min > max generation length
        argv += ["--val_min_target_length", str(spec.max_target_length)]
    if spec.checkpointing_steps is not None:
        argv += ["--checkpointing_steps", str(spec.checkpointing_steps)]
    if spec.push_to_hub:
        argv += ["--push_to_hub", "--hub_model_id", spec.hub_model_id]
        if spec.hub_private:
            argv += ["--hub_private"]
    argv += ["--output_dir", str(run_dir)]
    if resume:
        argv += ["--resume_from_checkpoint", "latest"]
    return argv


def format_command(argv) -> str:
    """One shell line for display ("Show command"); never executed through a shell here."""
    return shlex.join(str(a) for a in argv)


# --------------------------------------------------------------------------- uploads


def _check_size(path: Path) -> None:
    from finetune.data import DataError

    try:
        size = path.stat().st_size
    except OSError:
        raise DataError(f"{path}: no such file") from None
    if size > MAX_UPLOAD_BYTES:
        raise DataError(f"{path}: the file is {size / 2**20:.1f} MB; the limit is {MAX_UPLOAD_BYTES / 2**20:g} MB")


def _load_upload(path) -> "datasets.Dataset":  # noqa: F821
    from finetune.data import _read_file, validate

    file = Path(path)
    _check_size(file)
    return validate(_read_file(str(file)), str(file))


def validate_upload(path, source_prefix: str = "chatbot: ") -> dict:
    """Check an uploaded .jsonl/.json/.csv/.parquet file as training would.

    Returns ``{"rows": n, "preview": [...]}`` with the first 3 encoder inputs exactly as built
    for the model (``source_prefix`` + the MuDoConv source, before long dialogues are fitted);
    raises ``finetune.data.DataError`` naming the file, row and problem (size checked first)."""
    ds = _load_upload(path)
    return {"rows": len(ds), "preview": [source_prefix + text for text in ds[: 3]["texts"]]}


def write_split(train_file: str, run_dir: Path) -> tuple[int, int]:
    """Hold out the last VALIDATION_FRACTION of ``train_file``'s rows (at least one) into the
    run's data/ folder; returns (train rows, validation rows)."""
    from finetune.data import DataError

    ds = _load_upload(train_file)
    n = len(ds)
    if n < 2:
        raise DataError(f"{train_file}: {n} row; at least 2 are needed to hold out a validation split "
                        "(or upload a validation file)")
    n_val = max(1, int(n * VALIDATION_FRACTION))
    train_path, val_path = split_files(run_dir)
    train_path.parent.mkdir(parents=True, exist_ok=True)
    for path, rows in ((train_path, range(0, n - n_val)), (val_path, range(n - n_val, n))):
        part = ds.select(rows)
        tmp = path.with_name(f".{path.name}.tmp")
        with open(tmp, "w", encoding="utf-8") as fh:
            for text, label in zip(part["texts"], part["labels"]):
                fh.write(json.dumps({"texts": text, "labels": label}, ensure_ascii=False) + "\n")
        os.replace(tmp, path)
    return n - n_val, n_val


# --------------------------------------------------------------------------- processes


def _proc_stat(pid: int) -> tuple[str, int] | None:
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
        stat = _proc_stat(pid)
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
            stat = _proc_stat(int(entry))
            if stat and stat[1] == pgid and stat[0] not in "ZX":
                members.append(int(entry))
    return members


def _have_proc() -> bool:
    return Path("/proc/self/stat").exists()


def _run_alive(run_dir: Path, info: dict) -> bool:
    """Is this run's launcher, or any of its processes, still running?"""
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


def _record_exit(proc: subprocess.Popen, run_dir: Path) -> None:
    """Note a reaped child's exit code in run.json (once; whoever notices first)."""
    with _LOCK:
        if _CHILDREN.pop(proc.pid, None) is None:
            return
        with contextlib.suppress(OSError, ValueError, KeyError, IndexError):
            info = _read_info(run_dir)
            if info.get("pid") == proc.pid:
                info["exit_code"] = proc.returncode
                info["attempts"][-1]["exit_code"] = proc.returncode
                _write_info(run_dir, info)


def _reap() -> None:
    """Collect exit codes of children launched by this process (no zombies left behind); runs
    before every liveness check, so a run that looks gone has its exit code recorded."""
    with _LOCK:
        for proc, run_dir in list(_CHILDREN.values()):
            if proc.poll() is not None:
                _record_exit(proc, run_dir)


def _wait_child(proc: subprocess.Popen, run_dir: Path) -> None:
    """Waiter thread: reaps the child as soon as it exits, even if nobody asks for status."""
    proc.wait()
    _record_exit(proc, run_dir)


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


# --------------------------------------------------------------------------- run files


def _read_info(run_dir: Path) -> dict:
    return json.loads((run_dir / RUN_FILE).read_text())


def _write_info(run_dir: Path, info: dict) -> None:
    tmp = run_dir / f".{RUN_FILE}.tmp"
    tmp.write_text(json.dumps(info, indent=2))
    os.replace(tmp, run_dir / RUN_FILE)


def _read_events(run_dir: Path) -> list[tuple[int, dict]]:
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


def _file_size(path: Path) -> int:
    try:
        return path.stat().st_size
    except OSError:
        return 0


def _tail(path: Path, lines: int, since: int = 0) -> list[str]:
    """The last ``lines`` lines of ``path`` from byte ``since`` (reads at most ~256 KB)."""
    try:
        with open(path, "rb") as fh:
            size = fh.seek(0, os.SEEK_END)
            start = max(since, size - 256 * 1024)
            fh.seek(start)
            data = fh.read()
    except OSError:
        return []
    # progress bars redraw with \r: keep only the last state of each line
    text = data.decode(errors="replace")
    rows = [row.rstrip("\r").rsplit("\r", 1)[-1] for row in text.split("\n")]
    if rows and rows[-1] == "":
        rows.pop()
    return rows[-lines:]


def _error_from_log(lines: list[str]) -> str | None:
    """The CLI's own message (its ERROR log line or argparse error), else the root exception."""
    for pattern in (_ERROR_LINE, _ARGPARSE_ERROR):
        found = [m.group(1) for m in map(pattern.match, lines) if m]
        if found:
            return found[-1].strip()
    for line in lines:  # the first exception is the root cause; launchers add theirs after it
        stripped = line.strip()
        if _EXCEPTION_LINE.match(stripped) and not any(n in stripped for n in _LAUNCHER_NOISE):
            return stripped
    return None


# --------------------------------------------------------------------------- status


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
    samples_per_second: float | None = None
    gpu_mem_gib: float | None = None
    log_tail: str = ""
    error: str | None = None
    final_dir: str | None = None
    eval_bleu: float | None = None
    samples: list[dict] = field(default_factory=list)  # prompt / prediction / reference
    command: str = ""
    has_checkpoint: bool = False  # resume() is possible once stopped or failed
    pushed_url: str | None = None  # where the final model was last pushed (by the CLI or push())

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)


def _status_of(run_dir: Path) -> RunStatus:
    # Order matters: the stop thread writes its note before leaving _STOPPING, and the liveness
    # check records a reaped child's exit code, so run.json is read again after both.
    escalating = str(run_dir) in _STOPPING
    alive = _run_alive(run_dir, _read_info(run_dir))
    info = _read_info(run_dir)
    events = _read_events(run_dir)
    offset = info.get("metrics_offset", 0)
    current = [e for off, e in events if off >= offset]  # this launch attempt's events
    everything = [e for _, e in events]

    loss, bleu = {}, {}
    step, total, last_log, last_eval = 0, 0, None, None
    for e in everything:
        kind = e.get("event")
        if isinstance(e.get("step"), int):
            step = e["step"]  # the latest event's step (a resumed run restarts at its checkpoint)
        if kind == "start":
            total = e.get("total_steps", total)
            step = e.get("resumed_at", step)
        elif kind == "log":
            loss[e["step"]] = e["loss"]  # steps repeated after a resume: the later value wins
            last_log = e
        elif kind == "eval":
            bleu[e["step"]] = e["eval_bleu"]
            last_eval = e
    done = next((e for e in reversed(current) if e.get("event") == "done"), None)
    terminal = done or next((e for e in reversed(current) if e.get("event") in ("stopped", "error")), None)

    status = RunStatus(run_id=run_dir.name, command=format_command(info.get("argv", [])))
    status.step, status.total_steps = step, total
    status.progress = min(1.0, step / total) if total else 0.0
    status.loss_points = [{"step": s, "loss": v} for s, v in sorted(loss.items())]
    status.bleu_points = [{"step": s, "bleu": v} for s, v in sorted(bleu.items())]
    if last_log:
        status.samples_per_second = last_log.get("samples_per_second")
        status.gpu_mem_gib = last_log.get("gpu_mem_gib")
    if last_eval:
        status.eval_bleu = last_eval.get("eval_bleu")
        status.samples = list(last_eval.get("samples") or [])
    status.log_tail = "\n".join(_tail(run_dir / LOG_FILE, LOG_TAIL_LINES))
    status.has_checkpoint = bool(ckpt.list_checkpoints(run_dir))

    if alive or escalating:
        status.state = "stopping" if (run_dir / ckpt.STOP_FILE).exists() or escalating else "running"
        status.eta_seconds = _eta(current, step, total)
    elif terminal and terminal["event"] == "done":
        status.state, status.progress, status.eta_seconds = "finished", 1.0, 0.0
        status.eval_bleu = terminal.get("eval_bleu", status.eval_bleu)
        # training finished; a later error is the Hub push failing (the model is kept), until a
        # later push succeeds
        for e in current[current.index(terminal) + 1:]:
            if e.get("event") == "error":
                status.error = e.get("message")
            elif e.get("event") == "pushed":
                status.error, status.pushed_url = None, e.get("url")
        final = run_dir / FINAL
        status.final_dir = str(final) if final.is_dir() else None
    elif terminal and terminal["event"] == "stopped":
        status.state = "stopped"
    else:
        status.state = "failed"
        status.error = info.get("killed") or (terminal or {}).get("message") or _error_from_log(
            _tail(run_dir / LOG_FILE, 400, since=info.get("log_offset", 0)))
        if status.error is None:
            code = info.get("exit_code")
            status.error = (f"the training process exited with code {code}; see the log" if code is not None
                            else "the training process ended without a result (killed?); see the log")
    return status


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


# --------------------------------------------------------------------------- the manager


class RunManager:
    """Start, watch, stop, resume and push training runs under ``root`` (one at a time)."""

    def __init__(self, root: Path = RUNS_ROOT, grace_seconds: float = 60.0, term_seconds: float = 15.0):
        self.root = Path(root).expanduser().resolve()
        self.grace_seconds = grace_seconds
        self.term_seconds = term_seconds
        with _LOCK:
            _MANAGER_ROOTS.add(self.root)

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
        self.root.mkdir(parents=True, exist_ok=True)
        with _LOCK, open(self.root / ".lock", "a") as fh:
            try:
                import fcntl

                fcntl.flock(fh, fcntl.LOCK_EX)
            except ImportError:  # not POSIX: the in-process lock is all there is
                pass
            yield

    def _running(self) -> str | None:
        for run_id in self.runs():
            run_dir = self.root / run_id
            with contextlib.suppress(OSError, ValueError):
                if _run_alive(run_dir, _read_info(run_dir)):
                    return run_id
        return None

    def _refuse_if_busy(self) -> None:
        busy = self._running()
        if busy:
            raise RunBusyError(f"run {busy} is still running; stop it or wait for it to finish "
                               "(one training run at a time)")

    def _launch(self, run_dir: Path, spec: RunSpec, info: dict, resume: bool) -> None:
        argv = build_command(spec, run_dir, resume=resume)
        log_path = run_dir / LOG_FILE
        log_offset = _file_size(log_path)
        metrics_offset = _file_size(run_dir / ckpt.METRICS_FILE)
        with open(log_path, "ab") as log:
            log.write(f"=== {'resume' if resume else 'start'} {time.strftime('%Y-%m-%d %H:%M:%S')}: "
                      f"{format_command(argv)}\n".encode())
            log.flush()
            env = {**os.environ, "PYTHONUNBUFFERED": "1"}  # live log; env is never written anywhere
            proc = subprocess.Popen(argv, cwd=ROOT, env=env, stdin=subprocess.DEVNULL, stdout=log,
                                    stderr=subprocess.STDOUT, start_new_session=True, close_fds=True)
        _CHILDREN[proc.pid] = (proc, run_dir)
        attempt = {"argv": argv, "pid": proc.pid, "pgid": proc.pid, "started": time.time(), "resume": resume,
                   "metrics_offset": metrics_offset, "log_offset": log_offset}
        info.update(attempt)
        info.pop("exit_code", None)
        info.pop("killed", None)
        info.setdefault("attempts", []).append(attempt)
        _write_info(run_dir, info)
        threading.Thread(target=_wait_child, args=(proc, run_dir), daemon=True,
                         name=f"reap-{run_dir.name}").start()

    # ---- API

    def runs(self) -> list[str]:
        """Run ids under the root, newest first."""
        found = []
        with contextlib.suppress(OSError):
            for entry in self.root.iterdir():
                if RUN_ID_RE.match(entry.name) and (entry / RUN_FILE).is_file():
                    found.append(entry.name)
        return sorted(found, reverse=True)  # ids start with the launch time

    def command_preview(self, spec: RunSpec) -> str:
        """What start(spec) would run ("Show command"), with a placeholder run folder."""
        return format_command(build_command(spec, self.root / "<run_id>"))

    def start(self, spec: RunSpec) -> RunStatus:
        if spec.num_gpus > 0:
            available = detect_gpus()
            if spec.num_gpus > available:
                raise ValueError(f"num_gpus is {spec.num_gpus} but {available} GPU(s) are visible")
        with self._exclusive():
            self._refuse_if_busy()
            run_id = f"{time.strftime('%Y%m%d-%H%M%S')}-{secrets.token_hex(3)}"
            run_dir = self.root / run_id
            run_dir.mkdir(parents=True)
            try:
                if spec.holds_out_validation:
                    write_split(spec.dataset, run_dir)  # DataError: nothing launched
                info = {"run_id": run_id, "spec": spec.to_dict(), "created": time.time()}
                self._launch(run_dir, spec, info, resume=False)
            except BaseException:
                if not (run_dir / RUN_FILE).exists():
                    import shutil

                    shutil.rmtree(run_dir, ignore_errors=True)
                raise
        return self.status(run_id)

    def status(self, run_id: str | None = None) -> RunStatus:
        """A run's state; by default the running run, else the most recent one (else idle)."""
        if run_id is None:
            run_id = self._running() or next(iter(self.runs()), None)
            if run_id is None:
                return RunStatus()
        run_dir = self._dir(run_id)
        return _status_of(run_dir)

    def stop(self, run_id: str | None = None) -> RunStatus:
        """Ask a run to checkpoint and stop (STOP file); a background thread SIGTERMs its
        process group after grace_seconds, and SIGKILLs it term_seconds after that."""
        run_id = run_id or self._running()
        if run_id is None:
            return self.status()
        run_dir = self._dir(run_id)
        info = _read_info(run_dir)
        if not _run_alive(run_dir, info):
            return self.status(run_id)
        (run_dir / ckpt.STOP_FILE).touch()
        with _LOCK:
            if str(run_dir) not in _STOPPING:
                _STOPPING.add(str(run_dir))
                threading.Thread(target=self._stop_worker, args=(run_dir, info["pgid"]), daemon=True,
                                 name=f"stop-{run_id}").start()
        return self.status(run_id)

    def _stop_worker(self, run_dir: Path, pgid: int) -> None:
        try:
            sent = _escalate(run_dir, pgid, self.grace_seconds, self.term_seconds)
            events = [e.get("event") for _, e in _read_events(run_dir)]
            if sent == "SIGKILL" and events[-1:] not in (["stopped"], ["done"]):
                with _LOCK, contextlib.suppress(OSError, ValueError):
                    info = _read_info(run_dir)
                    if info.get("pgid") == pgid:
                        info["killed"] = (f"the run did not stop within {self.grace_seconds:g} s of the stop "
                                          f"request nor {self.term_seconds:g} s after SIGTERM, and was killed")
                        _write_info(run_dir, info)
        finally:
            with _LOCK:  # until here the run shows as "stopping", so "killed" is never missed
                _STOPPING.discard(str(run_dir))

    def resume(self, run_id: str) -> RunStatus:
        """Continue a stopped or failed run from its latest checkpoint, in the same folder."""
        run_dir = self._dir(run_id)
        with self._exclusive():
            self._refuse_if_busy()
            current = _status_of(run_dir)
            info = _read_info(run_dir)
            if current.state == "finished":
                raise ValueError(f"run {run_id} has already finished")
            if not ckpt.list_checkpoints(run_dir):
                raise ValueError(f"run {run_id} has no checkpoint to resume from; start a new run")
            spec = RunSpec(**info["spec"])
            if spec.holds_out_validation and not all(p.is_file() for p in split_files(run_dir)):
                write_split(spec.dataset, run_dir)
            with contextlib.suppress(FileNotFoundError):
                (run_dir / ckpt.STOP_FILE).unlink()  # or the run would stop again at once
            self._launch(run_dir, spec, info, resume=True)
        return self.status(run_id)

    def finished_checkpoints(self) -> list[tuple[str, str]]:
        """(label, final folder) of every finished run, newest first: "<run_id> (BLEU 12.3)"."""
        out = []
        for run_id in self.runs():
            final = self.root / run_id / FINAL
            if not (final / "config.json").is_file():
                continue
            label = run_id
            with contextlib.suppress(OSError, ValueError, TypeError, KeyError):
                bleu = json.loads((final / RESULTS_FILE).read_text())["eval_bleu"]
                label = f"{run_id} (BLEU {bleu:.1f})"
            out.append((label, str(final)))
        return out

    def push(self, run_id: str, repo_id: str, private: bool = False) -> str:
        """Upload a finished run's final/ folder to the Hub; returns the repo URL.
        ``finetune.hub.HubError`` (clear message, token scrubbed) propagates."""
        run_dir = self._dir(run_id)
        final = run_dir / FINAL
        if not (final / "config.json").is_file():
            raise ValueError(f"run {run_id} has no final model to push (it has not finished)")
        repo_id = (repo_id or "").strip()
        if not is_hub_id(repo_id, owner=True):
            raise ValueError(f"Hub repo id must look like 'user/name', got {repo_id!r}")
        from finetune.hub import push

        url = push(final, repo_id, private=private)
        # recorded like the CLI's own push, so every viewer (and a restarted app) sees it
        ckpt.MetricsWriter(run_dir, enabled=True).write("pushed", repo=repo_id, url=url)
        return url
