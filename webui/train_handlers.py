"""What the app's Train tab does, as plain functions (``app.py`` wires them to gradio).

The tab is a view on ``finetune.jobs.manager.RunManager``: the form becomes a
``finetune.jobs.spec.JobSpec`` (the CLI's own TrainConfig plus how to launch it), the buttons call
start / stop / resume / push, and a timer redraws the latest run from its directory
(``webui.train_view``). So a page reload, a second viewer or a restarted app shows the same run;
nothing about a run lives in the browser. The form's inputs are named after TrainConfig's fields
and JobSpec's launch fields (``FORM_FIELDS``); the handlers receive them as a dict by those names.

Every action that changes something (start, stop, resume, upload, push) first calls
``webui.auth.require``; the refusal is a ``gr.Error`` with a message meant for the user, and so is
every bad input. Uploads are size-checked and validated before they are copied into the data
root (an allowed root of finetune.jobs), and the copy's path stays in server-side session state:
no path typed or sent by a browser reaches a run unchecked.
"""

from __future__ import annotations

import contextlib
import hashlib
import logging
import secrets
import shutil
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, fields
from pathlib import Path

import gradio as gr

from chat.layout import DEFAULT_MODEL, DEMO_DIR, ROOT
from finetune.config import DEFAULT_DATASET, dataset_name_problem
from finetune.feedback import FeedbackExport, FeedbackStore, feedback_path
from finetune.jobs import paths
from finetune.jobs.command import detect_gpus
from finetune.jobs.manager import RunBusyError, RunManager
from finetune.jobs.spec import JobSpec, app_config, make_config
from finetune.jobs.uploads import ensure_room, validate_upload
from finetune.memory import gpu as gpu_info
from finetune.writes import WriteError, writing
from webui import train_lora, train_objective, train_preflight
from webui.auth import AuthConfig, AuthError, require, who
from webui.refusals import Refusals
from webui.train_words import command_lines, in_form_words, preview_markdown

log = logging.getLogger(__name__)

TICK_SECONDS = 2.0  # how often an open Train tab redraws the run
DATA_SOURCES = [("Shipped sample (offline)", "sample"), ("Hub dataset", "hub"), ("Uploaded file", "upload")]
UPLOAD_TYPES = (".jsonl", ".json", ".csv", ".parquet")  # finetune.data.LOADERS
STRATEGY_CHOICES = [("DeepSpeed ZeRO-2", "zero2"), ("ZeRO-3 + CPU offload", "zero3_offload"), ("DDP", "ddp")]
PRECISION_CHOICES = [
    ("auto (bf16 if the GPU has it, else fp16)", "auto"),
    ("bf16", "bf16"),
    ("fp16", "fp16"),
    ("fp32", "fp32"),
]

# The form's inputs: TrainConfig's and JobSpec's names, plus where the data comes from. The one list of them: the
# tab passes its components to the handlers by these names, and API clients send the values in this order.
# use_feedback / feedback_ratio: accepted chat feedback mixed into any of the data sources.
DATA_FIELDS = ("data_source", "hub_dataset", "use_feedback", "feedback_ratio")
FORM_FIELDS = (
    "model_name_or_path",
    *train_lora.FIELDS,
    *train_objective.FIELDS,
    *DATA_FIELDS,
    "n_train",
    "n_val",
    "num_train_epochs",
    "learning_rate",
    "per_device_train_batch_size",
    "per_device_eval_batch_size",
    "max_source_length",
    "max_target_length",
    "source_prefix",
    "strategy",
    "precision",
    "num_gpus",
    "checkpointing_steps",
    "logging_steps",
    "num_beams",
    "push_to_hub",
    "hub_model_id",
    "hub_private",
)
LAUNCH_FIELDS = tuple(f.name for f in fields(JobSpec) if f.name in FORM_FIELDS)
# Numbers where the form's 0 (or empty) means the CLI's None: all rows, a checkpoint each epoch.
ZERO_IS_NONE = ("n_train", "n_val", "checkpointing_steps")


@dataclass
class TrainTab:
    """What the tab works with: the run manager, who may act, the hardware, the upload folders."""

    manager: RunManager
    auth: AuthConfig
    gpus: int = 0  # detected at start-up; 0 = CPU only
    gpu: tuple[str, float] | None = None  # (name, total GiB) of a GPU, read at start-up: the pre-flight line
    data_root: Path = field(default_factory=paths.data_root)  # validated uploads are copied here
    incoming: Path | None = None  # where gradio puts uploaded files (None: gradio's upload folder)
    serving: Callable[[], str] | None = None  # the chat's served model (app.py sets it), to continue from
    feedback: FeedbackStore | None = None  # the chat's feedback store (opened on first use)
    refusals: Refusals = field(default_factory=Refusals)  # each page's last refusal, for the line it shows in
    form_labels: dict[str, str] = field(default_factory=dict)  # FORM_FIELDS name -> its label on the form

    @classmethod
    def create(cls, auth: AuthConfig | None = None, runs_root: Path | str | None = None) -> TrainTab:
        gpus = detect_gpus()
        return cls(
            manager=RunManager(runs_root),
            auth=auth or AuthConfig.from_env(),
            gpus=gpus,
            gpu=gpu_info() if gpus else None,
        )

    def incoming_root(self) -> Path:
        if self.incoming is not None:
            return self.incoming.resolve()
        from gradio.utils import get_upload_folder

        return Path(get_upload_folder()).resolve()

    def feedback_store(self) -> FeedbackStore:
        """The app's one feedback store, under this data root: the Chat tab's ratings and corrections,
        the Compare tab's votes, the review panel and the exports all use it."""
        if self.feedback is None:
            self.feedback = FeedbackStore(feedback_path(self.data_root))
        return self.feedback

    def served_run(self) -> str | None:
        """The served model's folder when it is a finished run of this tab or the demo model (else None)."""
        if self.serving is None:
            return None
        served = Path(self.serving()).resolve()
        if served == DEMO_DIR.resolve():
            return str(DEMO_DIR)
        return next((path for _, path in self.manager.finished_runs() if Path(path).resolve() == served), None)


@dataclass
class Uploads:
    """This session's validated uploads (copies under the data root), kept server-side."""

    train: str | None = None
    validation: str | None = None
    names: dict[str, str] = field(default_factory=dict)  # which -> the uploaded file's own name


# --------------------------------------------------------------------------- errors


@contextlib.contextmanager
def explained(action: str):
    """Turn the run manager's and the auth module's refusals into a ``gr.Error`` for the user."""
    try:
        yield
    except gr.Error:
        raise
    except (AuthError, RunBusyError, ValueError, WriteError) as err:  # ValueError includes DataError
        raise gr.Error(str(err), title=f"Cannot {action}", print_exception=False) from None
    except Exception as err:  # noqa: BLE001 - e.g. HubError: the app keeps serving, the user gets the reason
        log.warning("%s failed: %s", action, err)
        raise gr.Error(f"{type(err).__name__}: {err}", title=f"Cannot {action}", print_exception=False) from None


# --------------------------------------------------------------------------- the form


def hardware_note(gpus: int) -> str:
    if gpus:
        return (
            f"🖥️ {gpus} GPU{'s' if gpus > 1 else ''} visible: runs use them with the chosen strategy "
            "(ZeRO-2 by default)."
        )
    return (
        "🐢 **No GPU on this machine.** Real training (the 400M model) needs a GPU: on a Hugging Face Space, "
        "pick GPU hardware under **Settings → Space hardware**. Here, runs of the `tiny` model, LoRA adapters on "
        "any base (or continuing a finished run) are allowed: they train on the CPU with DeepSpeed ZeRO-2, `tiny` "
        "in a minute or two (it shows the pipeline works, not chat quality)."
    )


def base_model_choices(tab: TrainTab) -> list[tuple[str, str]]:
    """Base models for a run: the tiny preset, the 400M model, and every finished run."""
    choices = [
        ("tiny (a small BlenderBot built from the sample; CPU-friendly)", "tiny"),
        (f"{DEFAULT_MODEL} (400M)", DEFAULT_MODEL),
    ]
    choices += [(f"continue from run {label}", path) for label, path in tab.manager.finished_runs()]
    choices.append(("demo model (bundled; what the chat serves offline)", str(DEMO_DIR)))
    return choices


def default_form(tab: TrainTab) -> dict:
    """The form's starting values, by FORM_FIELDS name: the app's preset for the base model (the
    400M model when there is a GPU, else tiny) on the sample, JobSpec's launch defaults, every GPU."""
    model = DEFAULT_MODEL if tab.gpus else "tiny"
    config = app_config(model, dataset_name="sample")
    values = {name: getattr(config, name) for name in FORM_FIELDS if hasattr(config, name)}
    launch = {f.name: f.default for f in fields(JobSpec) if f.name in LAUNCH_FIELDS}
    return {
        **values,
        **launch,
        "num_gpus": tab.gpus,
        "data_source": "sample",
        "hub_dataset": DEFAULT_DATASET,
        "use_feedback": False,
        "feedback_ratio": config.feedback_ratio,
        "hub_model_id": config.hub_model_id or "",
    }


def controls_state(tab: TrainTab, token: str | None, profile) -> tuple[bool, str]:
    """(may this page use the form and Start / Stop / Resume / Push, the line that says why not).
    Only what the page shows: every handler checks the login again."""
    if not tab.auth.enabled:
        return False, "🔒 Training from this tab is off (see above); **Show command** still prints the command."
    if who(tab.auth, token, profile, touch=False) is None:
        return False, "🔒 The form and Start, Stop, Resume and Push unlock when you log in (above)."
    return True, ""


def feedback_toggled(tab: TrainTab, checked: bool, model: str | None) -> tuple:
    """(the ratio slider, the base model, its learning rate, what to train) when "Add accepted chat
    feedback" is (un)ticked: retraining on feedback starts from the served model when it is a
    finished run, and on a CPU trains a LoRA adapter (minutes, within a CPU Space's memory)."""
    served = tab.served_run() if checked else None
    adapter = gr.update(value="lora") if checked and not tab.gpus else gr.skip()
    if served is None or served == model:
        return gr.update(visible=bool(checked)), gr.skip(), gr.skip(), adapter
    return gr.update(visible=True), gr.update(value=served), learning_rate_for(served), adapter


def learning_rate_for(model: str | None) -> float:
    """The preset's learning rate for a base model (the form follows the Base model choice)."""
    return app_config(model or "").learning_rate


def export_feedback(tab: TrainTab, holdout_every: int = 10) -> FeedbackExport:
    """The accepted feedback rows exported under the data root, in a folder named after their
    content: exporting the same rows again (each Show command, each Start) reuses that folder, so
    the exports grow only when a trainer accepts or edits rows. FeedbackError when none are accepted.
    ``holdout_every``: FeedbackStore.export's (0: every row in train.jsonl, none held out)."""
    exports = tab.feedback_store().path.parent / "exports"
    tmp = exports / f".tmp-{secrets.token_hex(4)}"
    try:
        done = tab.feedback_store().export(tmp, holdout_every=holdout_every)
        digest = hashlib.sha256(done.train.read_bytes() + b"\0" + (done.heldout.read_bytes() if done.heldout else b""))
        final = exports / f"accepted-{digest.hexdigest()[:16]}"
        try:
            tmp.rename(final)
        except OSError:  # the same rows were exported before (or just now, by another page)
            if not (final / done.train.name).is_file():
                raise
        heldout = final / done.heldout.name if done.heldout else None
        return FeedbackExport(final / done.train.name, heldout, done.rows, done.heldout_rows)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def _feedback(tab: TrainTab, values: Mapping) -> dict:
    """The TrainConfig feedback fields of the form: the accepted rows exported (see export_feedback)."""
    if not values["use_feedback"]:
        return {}
    exported = export_feedback(tab)
    return {
        "feedback_file": str(exported.train),
        "feedback_validation_file": str(exported.heldout) if exported.heldout else None,
        "feedback_ratio": values["feedback_ratio"],
    }


def _data(values: Mapping, uploads: Uploads | None) -> tuple[dict, str | None]:
    """(the TrainConfig data fields, an upload to split) of the form's data choice."""
    source = values["data_source"]
    if source == "sample":
        return {"dataset_name": "sample"}, None
    if source == "hub":
        dataset = (values["hub_dataset"] or "").strip()
        if not dataset:
            raise ValueError("type a Hub dataset id (e.g. smangrul/MuDoConv) or pick another data source")
        problem = dataset_name_problem(dataset)  # e.g. 'json' would read the server's files
        if problem:
            raise ValueError(f"Hub dataset {problem}; to train on a file of yours, upload it (Uploaded file)")
        if dataset != "sample" and paths.local_path(dataset, "Hub dataset") is not None:
            raise ValueError(f"Hub dataset {dataset!r} is a local path; upload the file instead")
        return {"dataset_name": dataset}, None
    if source == "upload":
        if uploads is None or not uploads.train:
            raise ValueError("upload a training file first (jsonl, json, csv or parquet), or pick another data source")
        if uploads.validation is None:  # the run holds out the train file's last rows
            return {}, uploads.train
        return {"train_file": uploads.train, "validation_file": uploads.validation}, None
    raise ValueError(f"data source must be one of {', '.join(v for _, v in DATA_SOURCES)}, got {source!r}")


def spec_from_form(tab: TrainTab, values: Mapping, uploads: Uploads | None) -> JobSpec:
    """The run the form describes (``values``: FORM_FIELDS name -> value); ``ValueError`` with a
    clear message otherwise, naming each setting as the form labels it. Settings the form does not
    show keep the CLI's defaults."""
    try:
        return _spec_from_form(tab, values, uploads)
    except ValueError as err:  # (includes DataError)
        raise ValueError(in_form_words(str(err), tab.form_labels)) from None


def _spec_from_form(tab: TrainTab, values: Mapping, uploads: Uploads | None) -> JobSpec:
    if set(values) != set(FORM_FIELDS):
        missing, unknown = sorted(set(FORM_FIELDS) - set(values)), sorted(set(values) - set(FORM_FIELDS))
        raise ValueError(
            f"the form's fields are {', '.join(FORM_FIELDS)}; missing: {', '.join(missing) or '-'}, "
            f"unknown: {', '.join(unknown) or '-'}"
        )
    data, split_train_file = _data(values, uploads)
    data.update(_feedback(tab, values), **train_objective.settings(tab.feedback_store(), values))  # SFT: none
    form_only = (*DATA_FIELDS, *LAUNCH_FIELDS, *train_lora.FIELDS, *train_objective.FIELDS)
    settings = {k: v for k, v in values.items() if k not in form_only}
    settings.update(train_lora.settings(values))  # (none for full fine-tuning or a finished adapter as base)
    settings.update({name: None for name in ZERO_IS_NONE if settings[name] in (None, "", 0)})
    settings["per_device_train_batch_size"] = train_preflight.parse_batch(settings["per_device_train_batch_size"])
    spec = JobSpec(
        make_config(**settings, **data),
        split_train_file=split_train_file,
        **{name: values[name] for name in LAUNCH_FIELDS},
    )
    model = spec.config.model_name_or_path
    if spec.num_gpus > tab.gpus:
        raise ValueError(f"{spec.num_gpus} GPU(s) asked for, {tab.gpus} visible on this machine")
    if spec.num_gpus == 0 and model != "tiny" and not Path(model).is_absolute() and spec.config.adapter != "lora":
        # fully fine-tuning the 400M model on a (shared, 2-core) CPU would take hours and starve the chat
        raise ValueError(
            f"fully fine-tuning {model} needs a GPU (on a Space: GPU hardware). On the CPU choose a LoRA adapter, "
            "the `tiny` model, or continuing a finished run; the README's CLI runs any."
        )
    return spec


def preflight_markdown(tab: TrainTab, values: Mapping) -> str:
    """The pre-flight line of the form's ``train_preflight.FIELDS`` values (no login needed: it
    changes nothing)."""
    return train_preflight.preflight(tab.gpus, tab.gpu, values).text


def form_inputs(components: Mapping) -> dict:
    """The form's components by FORM_FIELDS name and in its order (gradio's ``inputs_kwargs``);
    a missing or unknown name is a bug in the tab."""
    if set(components) != set(FORM_FIELDS):
        raise ValueError(f"the form's components must be named {', '.join(FORM_FIELDS)}; got {', '.join(components)}")
    return {name: components[name] for name in FORM_FIELDS}


def show_command(tab: TrainTab, uploads: Uploads | None, values: Mapping) -> str:
    """The exact, full command Start would run (every setting given, defaults too; a placeholder
    for the new run's folder), or, when the form describes no valid run, why not: in the command
    box, where the user looks."""
    try:
        spec = spec_from_form(tab, values, uploads)
    except ValueError as err:  # includes DataError
        return f"# no command: {err}"
    unset = [f.name for f in fields(spec.config) if getattr(spec.config, f.name) is None]
    unset = [name for name in unset if name != "resume_from_checkpoint"]
    return (
        "# run from the repository root; the app runs this argument list without a shell\n"
        + (f"# left unset (no value, as the CLI's help says): {', '.join(unset)}\n" if unset else "")
        + command_lines(tab.manager.command_preview(spec))
    )


# --------------------------------------------------------------------------- uploads


def upload_name(file, incoming: Path) -> str:
    """What the user calls an uploaded file, for messages: gradio's ``orig_name`` when it gives one,
    else the name of its copy (gradio keeps the file's name), never the server's temporary path."""
    name = str(getattr(file, "orig_name", None) or incoming.name).replace("\\", "/").rsplit("/", 1)[-1]
    return "".join(c for c in name if c.isprintable())[:120] or "the uploaded file"


def accept_upload(
    tab: TrainTab, token: str | None, profile, uploads: Uploads | None, which: str, file, source_prefix: str | None
) -> tuple[Uploads, str, object]:
    """Validate an uploaded train or validation file and copy it into the data root.

    Returns the session's new uploads, a preview of its first rows' encoder input, and the upload
    box's new value (unchanged: ``gr.skip()``). A refused file is not kept: the box is cleared
    (None) and the reason shown instead of the preview, so nothing looks attached that is not. A
    cleared upload box forgets that file. Messages name the file as the user knows it
    (``upload_name``); the copy is refused when the data root is full (``ensure_room``)."""
    if which not in ("train", "validation"):
        raise ValueError(f"unknown upload {which!r}")
    uploads = Uploads(uploads.train, uploads.validation, dict(uploads.names)) if uploads else Uploads()
    if not file:
        setattr(uploads, which, None)
        uploads.names.pop(which, None)
        return uploads, "", gr.skip()
    try:
        kept, name, preview = _copy_upload(tab, token, profile, which, file, source_prefix)
    except gr.Error as err:
        setattr(uploads, which, None)
        uploads.names.pop(which, None)
        return uploads, f"⚠️ **{err.title}:** {err.message}", None
    setattr(uploads, which, kept)
    uploads.names[which] = name
    return uploads, preview, gr.skip()


def _copy_upload(tab: TrainTab, token, profile, which: str, file, source_prefix: str | None) -> tuple[str, str, str]:
    """(the checked copy's path, the file's name, its preview), or a gr.Error saying why not."""
    with explained("upload data"):
        require(tab.auth, token, profile, "upload data")
        incoming = Path(getattr(file, "path", file) if not isinstance(file, str) else file).resolve()
        # gradio only hands over files from its upload folder; checked here too, not assumed
        if not incoming.is_relative_to(tab.incoming_root()) or not incoming.is_file():
            raise ValueError("that file was not uploaded through this app")
        name, suffix = upload_name(file, incoming), incoming.suffix.lower()
        if suffix not in UPLOAD_TYPES:
            raise ValueError(f"{name}: unsupported file type (use {', '.join(UPLOAD_TYPES)})")
        # size first, then every row, within limits, in a child process
        checked = validate_upload(incoming, source_prefix or "", name=name)
        ensure_room(incoming.stat().st_size, tab.data_root)  # ValueError when the data root is full
        folder = tab.data_root / f"{time.strftime('%Y%m%d-%H%M%S')}-{secrets.token_hex(3)}"
        copy = folder / f"{which}{suffix}"
        try:
            with writing(copy):  # a failed copy names the file and the cause, and leaves nothing behind
                folder.mkdir(parents=True, exist_ok=False)
                shutil.copyfile(incoming, copy)
        except WriteError:
            shutil.rmtree(folder, ignore_errors=True)
            raise
        log.info("upload %s (%s): %d rows -> %s", which, name, checked["rows"], copy)
        return str(copy), name, preview_markdown(name, checked["rows"], checked["preview"])


# --------------------------------------------------------------------------- actions


def start_run(tab: TrainTab, token: str | None, profile, uploads: Uploads | None, values: Mapping) -> str:
    with explained("start a run"):
        user = require(tab.auth, token, profile, "start a training run")
        spec = spec_from_form(tab, values, uploads)
        train_preflight.check_start(spec, tab.gpu)  # BatchTooLarge: the batch that fits, before minutes of loading
        status = tab.manager.start(spec)
        log.info("run %s started (%s)", status.run_id, user)
        gr.Info(f"Run {status.run_id} started")
        return f"▶️ Started run **{status.run_id}**. It keeps going if you close this page."


def stop_run(tab: TrainTab, token: str | None, profile) -> str:
    with explained("stop the run"):
        user = require(tab.auth, token, profile, "stop a training run")
        running = tab.manager.status()
        if running.state not in ("running", "stopping"):
            raise ValueError("no run is running")
        status = tab.manager.stop(running.run_id)
        log.info("run %s stop requested (%s)", status.run_id, user)
        return (
            f"⏹️ Stopping run **{status.run_id}**: it saves a checkpoint and ends (Resume continues it). "
            f"If it does not end within {tab.manager.grace_seconds:g} s it is terminated."
        )


def resume_run(tab: TrainTab, token: str | None, profile) -> str:
    with explained("resume the run"):
        user = require(tab.auth, token, profile, "resume a training run")
        latest = tab.manager.status()
        if latest.run_id is None:
            raise ValueError("there is no run to resume; start one")
        if latest.state in ("running", "stopping"):
            raise ValueError(f"run {latest.run_id} is still {latest.state}")
        status = tab.manager.resume(latest.run_id)
        log.info("run %s resumed (%s)", status.run_id, user)
        return f"▶️ Resumed run **{status.run_id}** from its last checkpoint."


def push_run(tab: TrainTab, token: str | None, profile, repo_id: str | None, private: bool, merged=False) -> str:
    """Push the latest (finished) run: its final/ folder, or with ``merged`` an adapter run's merged model."""
    with explained("push to the Hub"):
        user = require(tab.auth, token, profile, "push a model to the Hub")
        latest = tab.manager.status()
        if latest.state != "finished":
            state = f"; run {latest.run_id} is {latest.state}" if latest.run_id else ""
            raise ValueError(f"only a finished run can be pushed{state}")
        url = tab.manager.push(latest.run_id, (repo_id or "").strip(), private=bool(private), merged=bool(merged))
        log.info("run %s pushed to %s (%s)", latest.run_id, url, user)
        gr.Info(f"Pushed to {url}")
        return f"⬆️ Pushed run **{latest.run_id}**{' (merged into its base)' if merged else ''} to {url}"


def server_paths_hidden(text: str, tab: TrainTab) -> str:
    """``text`` with the server's absolute folders shown as the short names users know (the
    repository's own paths relative to it, ``runs/...``, ``data/uploads/...``)."""
    for folder, shown in ((tab.manager.root, "runs"), (tab.data_root, "data/uploads"), (ROOT, ".")):
        text = text.replace(f"{Path(folder).resolve()}/", f"{shown}/").replace(str(Path(folder).resolve()), shown)
    return text


def model_list_update(tab: TrainTab):
    """The Train tab's base-model dropdown with the current finished runs (value kept)."""
    return gr.update(choices=base_model_choices(tab))
