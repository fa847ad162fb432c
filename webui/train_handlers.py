"""What the app's Train tab does, as plain functions (``app.py`` wires them to gradio).

The tab is a view on ``finetune.runner.RunManager``: the form becomes a ``RunSpec``, the buttons
call start / stop / resume / push, and a timer redraws the latest run from its directory. So a
page reload, a second viewer or a restarted app shows the same run; nothing about a run lives
in the browser.

Every action that changes something (start, stop, resume, upload, push) first calls
``webui.auth.require``; the refusal is a ``gr.Error`` with a message meant for the user, and so is
every bad input. Uploads are size-checked and validated before they are copied into the data
root (an allowed root of the runner), and the copy's path stays in server-side session state: no
path typed or sent by a browser reaches a run unchecked.
"""

from __future__ import annotations

import contextlib
import logging
import math
import secrets
import shutil
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, fields
from pathlib import Path

import gradio as gr
import pandas as pd

from webui.auth import AuthConfig, AuthError, Session, require
from chat.layout import DEFAULT_MODEL
from finetune import runner
from finetune.runner import RunBusyError, RunManager, RunSpec, RunStatus

log = logging.getLogger(__name__)

TICK_SECONDS = 2.0  # how often an open Train tab redraws the run
SAMPLES_SHOWN = 5
DATA_SOURCES = [("Shipped sample (offline)", "sample"), ("Hub dataset", "hub"), ("Uploaded file", "upload")]
UPLOAD_TYPES = (".jsonl", ".json", ".csv", ".parquet")  # finetune.data.LOADERS
STRATEGY_CHOICES = [("DeepSpeed ZeRO-2", "zero2"), ("ZeRO-3 + CPU offload", "zero3_offload"), ("DDP", "ddp")]
PRECISION_CHOICES = [("auto (bf16 if the GPU has it, else fp16)", "auto"), ("bf16", "bf16"), ("fp16", "fp16"),
                     ("fp32", "fp32")]
# Learning rates that work: the tiny model learns the sample fast; the 400M model needs small steps.
LEARNING_RATES = {"tiny": 1e-3}
LARGE_MODEL_LR = 5e-5

# The form's inputs, in the order app.py passes them to every handler that reads the form.
FORM_FIELDS = ("model", "data_source", "hub_dataset", "n_train", "n_val", "epochs", "learning_rate",
               "train_batch_size", "eval_batch_size", "max_source_length", "max_target_length", "source_prefix",
               "strategy", "precision", "num_gpus", "checkpointing_steps", "logging_steps", "num_beams",
               "push_to_hub", "hub_model_id", "hub_private")


@dataclass
class TrainTab:
    """What the tab works with: the run manager, who may act, the hardware, the upload folders."""

    manager: RunManager
    auth: AuthConfig
    gpus: int = 0  # detected at start-up; 0 = CPU only
    data_root: Path = field(default_factory=runner.data_root)  # validated uploads are copied here
    incoming: Path | None = None  # where gradio puts uploaded files (None: gradio's upload folder)

    @classmethod
    def create(cls, auth: AuthConfig | None = None, runs_root: Path | str | None = None) -> TrainTab:
        return cls(manager=RunManager(Path(runs_root) if runs_root is not None else runner.runs_root()),
                   auth=auth or AuthConfig.from_env(), gpus=runner.detect_gpus())

    def incoming_root(self) -> Path:
        if self.incoming is not None:
            return self.incoming.resolve()
        from gradio.utils import get_upload_folder

        return Path(get_upload_folder()).resolve()


@dataclass
class Uploads:
    """This session's validated uploads (copies under the data root), kept server-side."""

    train: str | None = None
    validation: str | None = None
    names: dict[str, str] = field(default_factory=dict)  # which -> the uploaded file's own name


# --------------------------------------------------------------------------- errors


@contextlib.contextmanager
def explained(action: str):
    """Turn the runner's and the auth module's refusals into a ``gr.Error`` for the user."""
    try:
        yield
    except gr.Error:
        raise
    except (AuthError, RunBusyError, ValueError) as err:  # ValueError includes DataError
        raise gr.Error(str(err), title=f"Cannot {action}", print_exception=False) from None
    except Exception as err:  # e.g. HubError: the app keeps serving, the user gets the reason
        log.warning("%s failed: %s", action, err)
        raise gr.Error(f"{type(err).__name__}: {err}", title=f"Cannot {action}", print_exception=False) from None


# --------------------------------------------------------------------------- the form


def hardware_note(gpus: int) -> str:
    if gpus:
        return (f"🖥️ {gpus} GPU{'s' if gpus > 1 else ''} visible: runs use them with the chosen strategy "
                "(ZeRO-2 by default).")
    return ("🐢 **No GPU on this machine.** Real training (the 400M model) needs a GPU: on a Hugging Face Space, "
            "pick GPU hardware under **Settings → Space hardware**. Here, runs of the `tiny` model (or continuing a "
            "finished run) are allowed: they train on the CPU with DeepSpeed ZeRO-2 in a minute or two and show "
            "the pipeline works, not chat quality.")


def base_model_choices(tab: TrainTab) -> list[tuple[str, str]]:
    """Base models for a run: the tiny preset, the 400M model, and every finished run."""
    choices = [("tiny (a small BlenderBot built from the sample; CPU-friendly)", "tiny"),
               (f"{DEFAULT_MODEL} (400M)", DEFAULT_MODEL)]
    choices += [(f"continue from run {label}", path) for label, path in tab.manager.finished_checkpoints()]
    return choices


def default_form(tab: TrainTab) -> dict:
    """The form's starting values: RunSpec's defaults, the 400M model when there is a GPU."""
    spec = {f.name: f.default for f in fields(RunSpec)}
    model = DEFAULT_MODEL if tab.gpus else "tiny"
    return {**spec, "model": model, "data_source": "sample", "hub_dataset": "smangrul/MuDoConv",
            "n_train": None, "n_val": None, "learning_rate": learning_rate_for(model), "num_gpus": tab.gpus,
            "precision": "auto", "strategy": "zero2", "hub_model_id": ""}


def learning_rate_for(model: str | None) -> float:
    return LEARNING_RATES.get(model or "", LARGE_MODEL_LR)


def form_values(values: Sequence) -> dict:
    """The handlers' form arguments (in FORM_FIELDS order) as a dict."""
    if len(values) != len(FORM_FIELDS):
        raise ValueError(f"the form has {len(FORM_FIELDS)} fields, got {len(values)} values")
    return dict(zip(FORM_FIELDS, values))


def _count(value):
    """n_train / n_val: empty or 0 means all rows."""
    return None if value in (None, "", 0) else value


def spec_from_form(tab: TrainTab, values: dict, uploads: Uploads | None) -> RunSpec:
    """The run the form describes (``ValueError`` with a clear message otherwise)."""
    source = values.get("data_source")
    validation = None
    if source == "sample":
        dataset = "sample"
    elif source == "hub":
        dataset = (values.get("hub_dataset") or "").strip()
        if not dataset:
            raise ValueError("type a Hub dataset id (e.g. smangrul/MuDoConv) or pick another data source")
        if dataset != "sample" and runner.local_path(dataset, "Hub dataset") is not None:
            raise ValueError(f"Hub dataset {dataset!r} is a local path; upload the file instead")
    elif source == "upload":
        if uploads is None or not uploads.train:
            raise ValueError("upload a training file first (jsonl, json, csv or parquet), or pick another data source")
        dataset, validation = uploads.train, uploads.validation
    else:
        raise ValueError(f"data source must be one of {', '.join(v for _, v in DATA_SOURCES)}, got {source!r}")

    spec = RunSpec(
        model=values.get("model"), dataset=dataset, validation_file=validation,
        n_train=_count(values.get("n_train")), n_val=_count(values.get("n_val")),
        epochs=values.get("epochs"), learning_rate=values.get("learning_rate"),
        train_batch_size=values.get("train_batch_size"), eval_batch_size=values.get("eval_batch_size"),
        max_source_length=values.get("max_source_length"), max_target_length=values.get("max_target_length"),
        source_prefix=values.get("source_prefix") if values.get("source_prefix") is not None else "",
        strategy=values.get("strategy"), precision=values.get("precision"), num_gpus=values.get("num_gpus") or 0,
        checkpointing_steps=_count(values.get("checkpointing_steps")), logging_steps=values.get("logging_steps"),
        num_beams=values.get("num_beams"), push_to_hub=bool(values.get("push_to_hub")),
        hub_model_id=values.get("hub_model_id") or None, hub_private=bool(values.get("hub_private")),
    )
    if spec.num_gpus > tab.gpus:
        raise ValueError(f"{spec.num_gpus} GPU(s) asked for, {tab.gpus} visible on this machine")
    if spec.num_gpus == 0 and spec.model not in ("tiny",) and not Path(spec.model).is_absolute():
        # the 400M model on a (shared, 2-core) CPU would take hours and starve the chat
        raise ValueError(f"training {spec.model} needs a GPU (on a Space: GPU hardware). On the CPU only the "
                         "`tiny` model, or continuing a finished run, is allowed here; the README's CLI runs any.")
    return spec


def show_command(tab: TrainTab, uploads: Uploads | None, values: Sequence) -> str:
    """The exact command Start would run (with a placeholder for the new run's folder)."""
    with explained("show the command"):
        spec = spec_from_form(tab, form_values(values), uploads)
        return ("# run from the repository root; the app runs this argument list without a shell\n"
                + tab.manager.command_preview(spec))


# --------------------------------------------------------------------------- uploads


def preview_markdown(name: str, rows: int, preview: list[str]) -> str:
    lines = [f"✅ **{name}**: {rows} rows, valid. The encoder input of the first rows, exactly as the model "
             "reads it (before long dialogues are shortened to fit):"]
    lines += [f"\n```text\n{text}\n```" for text in preview]
    return "\n".join(lines)


def accept_upload(tab: TrainTab, session: Session | None, profile, uploads: Uploads | None, which: str,
                  file, source_prefix: str | None) -> tuple[Uploads, str]:
    """Validate an uploaded train or validation file and copy it into the data root.

    Returns the session's new uploads and a preview of its first rows' encoder input. A cleared
    upload box forgets that file."""
    if which not in ("train", "validation"):
        raise ValueError(f"unknown upload {which!r}")
    uploads = Uploads(uploads.train, uploads.validation, dict(uploads.names)) if uploads else Uploads()
    if not file:
        setattr(uploads, which, None)
        uploads.names.pop(which, None)
        return uploads, ""
    with explained("upload data"):
        require(tab.auth, session, profile, "upload data")
        incoming = Path(getattr(file, "path", file) if not isinstance(file, str) else file).resolve()
        # gradio only hands over files from its upload folder; checked here too, not assumed
        if not incoming.is_relative_to(tab.incoming_root()) or not incoming.is_file():
            raise ValueError("that file was not uploaded through this app")
        suffix = incoming.suffix.lower()
        if suffix not in UPLOAD_TYPES:
            raise ValueError(f"{incoming.name}: unsupported file type (use {', '.join(UPLOAD_TYPES)})")
        checked = runner.validate_upload(incoming, source_prefix or "")  # size first, then every row
        folder = tab.data_root / f"{time.strftime('%Y%m%d-%H%M%S')}-{secrets.token_hex(3)}"
        folder.mkdir(parents=True, exist_ok=False)
        copy = folder / f"{which}{suffix}"
        shutil.copyfile(incoming, copy)
        setattr(uploads, which, str(copy))
        uploads.names[which] = incoming.name
        log.info("upload %s: %d rows -> %s", which, checked["rows"], copy)
        return uploads, preview_markdown(incoming.name, checked["rows"], checked["preview"])


# --------------------------------------------------------------------------- actions


def start_run(tab: TrainTab, session: Session | None, profile, uploads: Uploads | None, values: Sequence) -> str:
    with explained("start a run"):
        user = require(tab.auth, session, profile, "start a training run")
        spec = spec_from_form(tab, form_values(values), uploads)
        status = tab.manager.start(spec)
        log.info("run %s started (%s)", status.run_id, user)
        gr.Info(f"Run {status.run_id} started")
        return f"▶️ Started run **{status.run_id}**. It keeps going if you close this page."


def stop_run(tab: TrainTab, session: Session | None, profile) -> str:
    with explained("stop the run"):
        user = require(tab.auth, session, profile, "stop a training run")
        running = tab.manager.status()
        if running.state not in ("running", "stopping"):
            raise ValueError("no run is running")
        status = tab.manager.stop(running.run_id)
        log.info("run %s stop requested (%s)", status.run_id, user)
        return (f"⏹️ Stopping run **{status.run_id}**: it saves a checkpoint and ends (Resume continues it). "
                f"If it does not end within {tab.manager.grace_seconds:g} s it is terminated.")


def resume_run(tab: TrainTab, session: Session | None, profile) -> str:
    with explained("resume the run"):
        user = require(tab.auth, session, profile, "resume a training run")
        latest = tab.manager.status()
        if latest.run_id is None:
            raise ValueError("there is no run to resume; start one")
        if latest.state in ("running", "stopping"):
            raise ValueError(f"run {latest.run_id} is still {latest.state}")
        status = tab.manager.resume(latest.run_id)
        log.info("run %s resumed (%s)", status.run_id, user)
        return f"▶️ Resumed run **{status.run_id}** from its last checkpoint."


def push_run(tab: TrainTab, session: Session | None, profile, repo_id: str | None, private: bool) -> str:
    with explained("push to the Hub"):
        user = require(tab.auth, session, profile, "push a model to the Hub")
        latest = tab.manager.status()
        if latest.state != "finished":
            raise ValueError("only a finished run can be pushed" + (
                f"; run {latest.run_id} is {latest.state}" if latest.run_id else ""))
        url = tab.manager.push(latest.run_id, (repo_id or "").strip(), private=bool(private))
        log.info("run %s pushed to %s (%s)", latest.run_id, url, user)
        gr.Info(f"Pushed to {url}")
        return f"⬆️ Pushed run **{latest.run_id}** to {url}"


# --------------------------------------------------------------------------- live view


def format_duration(seconds: float | None) -> str:
    if seconds is None or not math.isfinite(seconds):
        return "?"
    seconds = int(round(seconds))
    if seconds < 60:
        return f"{seconds} s"
    minutes, seconds = divmod(seconds, 60)
    if minutes < 60:
        return f"{minutes} min {seconds:02d} s"
    hours, minutes = divmod(minutes, 60)
    return f"{hours} h {minutes:02d} min"


def progress_bar(fraction: float, width: int = 20) -> str:
    filled = int(round(max(0.0, min(1.0, fraction)) * width))
    return "█" * filled + "░" * (width - filled)


STATE_ICONS = {"idle": "💤", "running": "🏃", "stopping": "⏳", "stopped": "⏸️", "finished": "✅",
               "failed": "❌"}


def run_markdown(status: RunStatus) -> str:
    """State, progress, ETA, speed, GPU memory, BLEU, error and result of the run."""
    if status.run_id is None:
        return "💤 No run yet. Fill in the form and press **Start** (or **Show command** to run it yourself)."
    lines = [f"{STATE_ICONS.get(status.state, '')} **Run {status.run_id}**: {status.state}"]
    if status.total_steps:
        lines.append(f"`{progress_bar(status.progress)}` step {status.step} / {status.total_steps} "
                     f"({status.progress:.0%})")
    else:
        lines.append("starting: loading the model and the data…" if status.state == "running" else "")
    facts = []
    if status.state in ("running", "stopping") and status.eta_seconds is not None:
        facts.append(f"ETA {format_duration(status.eta_seconds)}")
    if status.samples_per_second:
        facts.append(f"{status.samples_per_second:.1f} samples/s")
    if status.gpu_mem_gib is not None:
        facts.append(f"GPU memory {status.gpu_mem_gib:.1f} GiB")
    if status.eval_bleu is not None:
        facts.append(f"BLEU {status.eval_bleu:.2f}")
    if facts:
        lines.append(" · ".join(facts))
    if status.error:
        lines.append(f"⚠️ **Error:** {status.error}")
    if status.state == "finished" and status.final_dir:
        lines.append(f"The model is in `{status.final_dir}`: it is in the Chat tab's **Model** list now; "
                     "**Push** below sends it to the Hub.")
    if status.state in ("stopped", "failed") and status.has_checkpoint:
        lines.append("**Resume** continues it from its last checkpoint.")
    if status.pushed_url:
        lines.append(f"⬆️ Pushed to {status.pushed_url}")
    return "\n\n".join(line for line in lines if line)


def loss_frame(status: RunStatus) -> pd.DataFrame:
    return pd.DataFrame(status.loss_points, columns=["step", "loss"])


def bleu_frame(status: RunStatus) -> pd.DataFrame:
    return pd.DataFrame(status.bleu_points, columns=["step", "bleu"])


def samples_frame(status: RunStatus) -> pd.DataFrame:
    rows = [{k: str(s.get(k, "")) for k in ("prompt", "prediction", "reference")}
            for s in status.samples[:SAMPLES_SHOWN]]
    return pd.DataFrame(rows, columns=["prompt", "prediction", "reference"])


def _signature(value) -> str:
    return value.to_json() if isinstance(value, pd.DataFrame) else repr(value)


def live_view(tab: TrainTab, cache: dict | None, model_updates: Sequence[Callable[[], object]] = ()) -> tuple:
    """The timer's redraw: (cache, run text, loss, BLEU, samples, log tail, *model-list updates).

    Only what changed since this page's last redraw is sent (gr.skip() otherwise), so plots do
    not flicker and an open dropdown is not reset. ``model_updates`` make the updates of the
    model lists (the Train tab's base model, the Chat tab's picker) when the finished runs change."""
    status = tab.manager.status()
    values = {"run": run_markdown(status), "loss": loss_frame(status), "bleu": bleu_frame(status),
              "samples": samples_frame(status), "log": status.log_tail,
              "finals": tuple(path for _, path in tab.manager.finished_checkpoints())}
    cache = dict(cache or {})
    changed = {}
    for key, value in values.items():
        signature = _signature(value)
        changed[key] = cache.get(key) != signature
        cache[key] = signature
    out = [values[key] if changed[key] else gr.skip() for key in ("run", "loss", "bleu", "samples", "log")]
    out += [make() if changed["finals"] else gr.skip() for make in model_updates]
    return (cache, *out)


def model_list_update(tab: TrainTab):
    """The Train tab's base-model dropdown with the current finished runs (value kept)."""
    return gr.update(choices=base_model_choices(tab))
