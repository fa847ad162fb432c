"""DeepSpeed's CPU ops: the C++ torch extensions a DeepSpeed run on a machine without CUDA compiles
the first time (about a minute on 2 cores) into torch's extension cache: the shared-memory
communication op when the processes connect, CPU Adam when the engine is made (only with a DeepSpeed
optimizer; the CPU recipe uses torch's AdamW).

torch guards a build with a lock file in the op's folder (``torch.utils.file_baton``): the building
process creates and holds it, and every other process waits until it is gone, forever. A build that
is killed (a stopped run, a test's time limit) leaves the file, and every later run on the machine
hangs while "connecting the processes". The launchers call :func:`clear_stale_locks` before they start
a run's processes, and ``python -m finetune.cpu_ops`` builds the ops ahead (setup does), so that no run
builds them mid-way.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
import time
from pathlib import Path

import torch

log = logging.getLogger(__name__)

CPU_OPS = {"connect": "ShareMemCommBuilder", "prepare": "CPUAdamBuilder"}
CPU_OPS_NAMES = {"connect": "deepspeed_shm_comm", "prepare": "cpu_adam"}  # their folders in the cache
LOCK = "lock"  # torch's lock file in an op's build folder
MIN_STALE_AGE = 10.0  # s: a lock younger than this may be one a process is creating right now


def deepspeed_on_cpu() -> bool:
    """Launched with DeepSpeed (accelerate's environment says so) on a machine without CUDA."""
    return os.environ.get("ACCELERATE_USE_DEEPSPEED") == "true" and not torch.cuda.is_available()


def extension_root() -> Path:
    """torch's extension cache for this Python and this build of torch (torch.utils.cpp_extension's
    own rule, without its side effect of making the folder)."""
    from torch.utils.cpp_extension import get_default_build_root

    root = os.environ.get("TORCH_EXTENSIONS_DIR")
    if root is not None:
        return Path(root)
    accelerator = "cpu"
    if torch.version.hip is not None:
        accelerator = f"rocm{torch.version.hip.replace('.', '')}"
    elif torch.version.cuda is not None:
        accelerator = f"cu{torch.version.cuda.replace('.', '')}"
    version = f"py{sys.version_info.major}{sys.version_info.minor}{getattr(sys, 'abiflags', '')}"
    return Path(get_default_build_root()) / f"{version}_{accelerator}"


def extension_dir(name: str) -> Path:
    """Where torch builds and keeps the op ``name``."""
    return extension_root() / name


def cpu_op_state(step: str) -> str | None:
    """The state of DeepSpeed's CPU op of ``step`` ("connect" or "prepare") on a CPU run: "built"
    (or installed prebuilt), "unbuilt" (this run builds it), "locked" (its build folder holds torch's
    lock file: another process is building it, or a killed build left the file), or None (not a
    DeepSpeed CPU run, or not known)."""
    if not deepspeed_on_cpu():
        return None
    try:
        from deepspeed.accelerator import get_accelerator
        from deepspeed.git_version_info import installed_ops

        builder = get_accelerator().create_op_builder(CPU_OPS[step])
        if builder is None or installed_ops.get(builder.NAME):
            return "built"
        folder = extension_dir(builder.name)
    except Exception:  # noqa: BLE001 - only the wording of a phase line depends on it
        return None
    if (folder / LOCK).exists():
        return "locked"
    return "built" if (folder / f"{builder.name}.so").is_file() else "unbuilt"


def open_paths() -> set[str] | None:
    """Every file some process this user can see holds open (Linux's /proc), or None where that
    cannot be read (another system): then no lock is called stale. Processes of other users are
    not readable and not counted; the extension cache is per user."""
    proc = Path("/proc")
    if not (proc / "self" / "fd").is_dir():
        return None
    paths = set()
    for pid in os.listdir(proc):
        if not pid.isdigit():
            continue
        try:
            fds = os.listdir(proc / pid / "fd")
        except OSError:  # gone, or another user's
            continue
        for fd in fds:
            try:
                paths.add(os.readlink(proc / pid / "fd" / fd))
            except OSError:
                continue
    return paths


def stale_locks(root: Path | None = None, min_age: float = MIN_STALE_AGE) -> list[Path]:
    """The lock files in the extension cache that no process holds open and that are older than
    ``min_age`` seconds: left by a killed build."""
    root = extension_root() if root is None else root
    locks = sorted(root.glob(f"*/{LOCK}")) if root.is_dir() else []
    now = time.time()
    old = []
    for lock in locks:
        try:
            if now - lock.stat().st_mtime >= min_age:
                old.append(lock)
        except OSError:  # released while we looked
            continue
    if not old:
        return []
    held = open_paths()
    if held is None:
        return []
    return [lock for lock in old if str(lock.resolve()) not in held]


def clear_stale_locks(root: Path | None = None) -> list[Path]:
    """Delete the stale lock files (see :func:`stale_locks`) and say so; the ones deleted. Call it
    where no process of the run about to start exists yet: in a launcher."""
    cleared = []
    for lock in stale_locks(root):
        try:
            lock.unlink()
        except FileNotFoundError:
            continue
        log.warning("deleted %s: a killed build of a torch extension left it, and every run would wait on it", lock)
        cleared.append(lock)
    return cleared


def unbuilt() -> list[str]:
    """The CPU ops the extension cache lacks, or whose folder holds a lock (being built, or a build
    was killed); found without importing DeepSpeed."""
    return [
        name
        for name in CPU_OPS_NAMES.values()
        if not (extension_dir(name) / f"{name}.so").is_file() or (extension_dir(name) / LOCK).exists()
    ]


def build() -> list[str]:
    """Build DeepSpeed's CPU ops now (each a no-op when built already); their names. Only on a
    machine without CUDA, where DeepSpeed runs use them."""
    if torch.cuda.is_available():
        return []
    from deepspeed.accelerator import get_accelerator

    clear_stale_locks()
    built = []
    for name in CPU_OPS.values():
        builder = get_accelerator().create_op_builder(name)
        if builder is None:  # not this accelerator's op
            continue
        builder.load(verbose=False)
        built.append(builder.name)
    return built


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m finetune.cpu_ops",
        description="Build DeepSpeed's CPU ops into torch's extension cache now, so that no run builds them "
        "(and no stopped run leaves a build half done); first deletes lock files a killed build left.",
    )
    parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    names = build()
    log.info("DeepSpeed's CPU ops built in %s: %s", extension_root(), ", ".join(names) or "none (CUDA machine)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
