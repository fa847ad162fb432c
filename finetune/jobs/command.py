"""The command that runs a JobSpec: ``python -m accelerate.commands.launch --config_file ...
-m finetune ...``, the README's commands as an argument list (run with cwd = the repository
root, never through a shell), and the environment it runs with (``run_env``: no app secrets).

The training flags are generated from the run's TrainConfig, never mapped field by field:
every field whose value differs from the CLI's default becomes its flag, so
``finetune.config.parse_args`` of those flags gives back exactly that config.
"""

from __future__ import annotations

import dataclasses
import os
import re
import shlex
import socket
import sys
from collections.abc import Mapping
from pathlib import Path

from chat.layout import ROOT
from finetune.config import TrainConfig
from finetune.jobs.paths import split_files
from finetune.jobs.spec import JobSpec

ACCELERATE_DIR = Path("configs") / "accelerate"  # relative: the child runs with cwd = the repository root
CONFIG_FILES = {"zero2": "zero2.yaml", "zero3_offload": "zero3_offload.yaml", "ddp": "ddp.yaml"}  # by strategy
CPU_CONFIG = "cpu_zero2.yaml"

# Fields the CLI fills in from another one when they are not given (TrainConfig.__post_init__):
# no flag while they are equal to it.
_DERIVED = {"val_max_target_length": "max_target_length"}
# The launch's own flags go last, as in the README's commands: where the run writes, and resume.
_LAST = ("output_dir", "resume_from_checkpoint")


def detect_gpus() -> int:
    """Visible CUDA GPUs (honours CUDA_VISIBLE_DEVICES); 0 when there is no CUDA."""
    try:
        import torch

        return torch.cuda.device_count() if torch.cuda.is_available() else 0
    except Exception:  # noqa: BLE001 - a broken driver is no GPU for this purpose
        return 0


def gpu_supports_bf16() -> bool:
    try:
        import torch

        return torch.cuda.is_available() and torch.cuda.is_bf16_supported()
    except Exception:  # noqa: BLE001 - as above
        return False


def _cores() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:
        return os.cpu_count() or 1


def cpu_processes() -> int:
    """Processes for a CPU run: 2 (the tested recipe), 1 on a one-core machine."""
    return 2 if _cores() >= 2 else 1


def mixed_precision(spec: JobSpec) -> str:
    """The launcher's --mixed_precision value for this spec."""
    if spec.num_gpus == 0 or spec.precision == "fp32":
        return "no"
    if spec.precision == "auto":
        return "bf16" if gpu_supports_bf16() else "fp16"
    return spec.precision


def free_port() -> int:
    """A TCP port free on 127.0.0.1 right now (for the launcher's rendezvous)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def training_args(config: TrainConfig, full: bool = False) -> list[str]:
    """The CLI flags that give back ``config``: ``parse_args(training_args(config)) == config``.

    Every field whose value differs from its default becomes its flag (with ``full``, every field
    that has a value, defaults too: the command then says every setting, as a run's command
    does), in TrainConfig's order (output_dir and resume last); booleans as ``--flag`` / ``--flag
    false``; module names comma-separated (``--lora_target_modules q_proj,v_proj``); a value that
    starts with "-" as one token ``--name=value``, so argparse never takes it for an option (a
    source prefix may start with one). None is no flag's value: a field left unset stays unset,
    and one set to None where the default is not is a ValueError."""
    fields = sorted(dataclasses.fields(TrainConfig), key=lambda f: f.name in _LAST)  # stable: order kept
    args = []
    for f in fields:
        value = getattr(config, f.name)
        default = getattr(config, _DERIVED[f.name]) if f.name in _DERIVED else f.default
        if value == default and not (full and value is not None):
            continue
        if isinstance(f.default, bool):
            args += [f"--{f.name}"] if value else [f"--{f.name}", "false"]
        elif value is None:
            raise ValueError(f"{f.name} cannot be None on the command line (its default is {default!r})")
        else:
            text = repr(value) if isinstance(value, float) else str(value)
            text = ",".join(value) if isinstance(value, tuple) else text  # module names
            args += [f"--{f.name}={text}"] if text.startswith("-") else [f"--{f.name}", text]
    return args


def run_config(spec: JobSpec, run_dir: Path, resume: bool = False) -> TrainConfig:
    """The config the run trains with: the spec's, writing into ``run_dir``, reading the split of
    an uploaded train file from there, and continuing from the latest checkpoint on resume."""
    run_dir = Path(run_dir).resolve()
    changes = {"output_dir": str(run_dir), "resume_from_checkpoint": "latest" if resume else None}
    if spec.split_train_file is not None:
        train, validation = split_files(run_dir)
        changes.update(train_file=str(train), validation_file=str(validation))
    return dataclasses.replace(spec.config, **changes)


def build_command(spec: JobSpec, run_dir: Path, resume: bool = False) -> list[str]:
    """The argument list that runs ``spec`` into ``run_dir`` (to run with cwd = the repository
    root), with ``--resume_from_checkpoint latest`` when resuming. Every setting is a flag, the
    defaults too: Show command prints this, and a reader sees every value the run uses."""
    if spec.num_gpus == 0:
        config, processes = CPU_CONFIG, cpu_processes()
    else:
        config, processes = CONFIG_FILES[spec.strategy], spec.num_gpus
    return [
        sys.executable,
        "-m",
        "accelerate.commands.launch",
        "--config_file",
        str(ACCELERATE_DIR / config),
        "--num_processes",
        str(processes),
        "--mixed_precision",
        mixed_precision(spec),
        "--main_process_port",
        str(free_port()),
        "-m",
        "finetune",
        *training_args(run_config(spec, run_dir, resume), full=True),
    ]


def format_command(argv) -> str:
    """One shell line of exactly ``argv``; never executed through a shell here."""
    return shlex.join(str(a) for a in argv)


def _relative(value: str) -> str:
    """A path inside the repository as one relative to it ("runs/<id>"); anything else as is."""
    path = Path(value)
    if not path.is_absolute() or not path.is_relative_to(ROOT):
        return value
    relative = path.relative_to(ROOT).as_posix()
    return relative if not relative.startswith("-") else f"./{relative}"  # never read as an option


def display_command(argv) -> str:
    """The line shown to people ("Show command", a run's status, the log; visitors see them):
    ``format_command`` with the interpreter as ``python`` and paths inside the repository
    relative to it (runs/<id>, data/uploads/...), so it shows no server folder and runs from
    the repository root as the README says. Paths outside the repository stay absolute."""
    shown = []
    for i, arg in enumerate(str(a) for a in argv):
        if i == 0 and Path(arg).is_absolute() and Path(arg).name.startswith("python"):
            arg = "python"
        elif arg.startswith("--") and "=" in arg:
            flag, value = arg.split("=", 1)
            arg = f"{flag}={_relative(value)}"
        else:
            arg = _relative(arg)
        shown.append(arg)
    return format_command(shown)


# --------------------------------------------------------------------------- the environment

# A run needs the Hub token (private data, push) and the machine's settings (PATH, HOME, HF_*,
# CUDA_*, PYTHON*, NCCL_*, proxies...), never the app's own secrets: whatever the training code
# or a library prints ends up in train.log, which every visitor of the Train tab can read.
_DROP_PREFIXES = ("TRAIN_", "OAUTH_", "OPENID_", "GRADIO_")  # the app's login (webui/auth.py), gradio's settings
_SECRET_WORDS = {
    "PASSWORD",
    "PASSWD",
    "SECRET",
    "SECRETS",
    "TOKEN",
    "CREDENTIAL",
    "CREDENTIALS",
    "COOKIE",
    "AUTH",
    "APIKEY",
}
_SECRET_SUFFIXES = ("API_KEY", "PRIVATE_KEY", "ACCESS_KEY")
_KEEP = {"HUGGING_FACE_HUB_TOKEN", "WANDB_API_KEY"}  # the Hub's old token name; the wandb tracker (--report_to)


def _is_secret(name: str) -> bool:
    upper = name.upper()
    if upper.startswith("HF_") or upper in _KEEP:  # HF_TOKEN and the Hub's cache settings
        return False
    return (
        upper.startswith(_DROP_PREFIXES)
        or bool(_SECRET_WORDS & set(re.split(r"[^A-Z0-9]+", upper)))
        or upper.endswith(_SECRET_SUFFIXES)
    )


def run_env(environ: Mapping[str, str] | None = None) -> dict[str, str]:
    """The environment a run is launched with: this one's, less the app's secrets (see above)."""
    environ = os.environ if environ is None else environ
    env = {name: value for name, value in environ.items() if not _is_secret(name)}
    # Said here, the launcher and DeepSpeed need not say it: torch elastic's banner about
    # OMP_NUM_THREADS, and DeepSpeed's "Setting accelerator to CPU" warning in every process.
    env.setdefault("OMP_NUM_THREADS", str(max(1, _cores() // cpu_processes())))
    if "DS_ACCELERATOR" not in env and detect_gpus() == 0:
        env["DS_ACCELERATOR"] = "cpu"
    return env
