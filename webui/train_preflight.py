"""The Train tab's pre-flight line: before Start, the estimated peak memory per GPU and time per
epoch of the run the form describes (``finetune.memory``), and the refusal of a batch that will
not fit.

Cheap enough to recompute at every change of the form: the model's shape comes from its
config.json alone (``memory.ModelShape.local``: a preset, a local folder or the Hugging Face
cache; nothing is downloaded or loaded), the GPU's memory was read once at start-up
(``TrainTab.gpu``). On the CPU there is no memory estimate: host memory is not the limit, and
'auto' is the CLI's CPU default (``memory.CPU_BATCH``).
"""

from __future__ import annotations

import functools
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

from chat.layout import SAMPLE_DIR
from finetune import lora, memory
from finetune.jobs.command import CONFIG_FILES, gpu_supports_bf16
from finetune.jobs.spec import JobSpec, int_or_auto, make_config
from webui import train_lora

BATCH_LABEL = "Train batch (per device)"
# The form's fields the line depends on (the tab recomputes it when one changes).
FIELDS = (
    "model_name_or_path",
    *train_lora.FIELDS,
    "data_source",
    "n_train",
    "per_device_train_batch_size",
    "max_source_length",
    "max_target_length",
    "strategy",
    "precision",
    "num_gpus",
)


@dataclass(frozen=True)
class Preflight:
    text: str  # the line the tab shows (markdown)
    refusal: str | None = None  # why Start is refused (the batch will not fit), None when it may start


def parse_batch(value) -> int | str:
    """The form's train batch: a positive whole number or 'auto' (any case); ValueError naming the
    box otherwise. Numbers from API clients (16, 16.0) are taken too."""
    return int_or_auto(BATCH_LABEL, value)


@functools.cache
def sample_rows() -> int:
    """Rows of the shipped sample's train split (for the time per epoch)."""
    with open(SAMPLE_DIR / "train.jsonl", "rb") as fh:
        return sum(1 for line in fh if line.strip())


def _setup(spec: JobSpec) -> memory.Setup:
    """How the run holds the model, as the memory model knows it (finetune.memory.resolve_batch
    works it out the same way inside the run)."""
    cfg = spec.config
    if spec.precision == "fp32":
        precision = "no"
    elif spec.precision == "auto":
        precision = "bf16" if gpu_supports_bf16() else "fp16"
    else:
        precision = spec.precision
    return memory.Setup(
        strategy=memory.strategy_of(CONFIG_FILES[spec.strategy], spec.num_gpus),
        precision=precision,
        processes=spec.num_gpus,
        source_len=cfg.max_source_length,
        target_len=cfg.max_target_length,
        attention="eager" if cfg.attention == "eager" else "sdpa",
        **memory.lora_setup(cfg),
    )


def assess(spec: JobSpec, gpu: tuple[str, float] | None, train_rows: int | None = None) -> Preflight:
    """The pre-flight line of ``spec`` on GPUs described by ``gpu`` ((name, total GiB) of one;
    None: not known), and the refusal of a batch that will not fit."""
    batch = spec.config.per_device_train_batch_size
    model = lora.base_model(spec.config) if spec.config.adapter == "lora" else spec.config.model_name_or_path
    shape = memory.ModelShape.local(model)
    trained = adapter_note(spec, shape)
    if spec.num_gpus == 0:
        text = (
            f"CPU run: `auto` means the CPU default, {memory.CPU_BATCH} rows per process, and no GPU memory "
            "estimate applies"
        )
        return Preflight(
            f"🧮 **Pre-flight:** {trained}{text}"
            + (f"; this run: {batch} rows per process." if batch != "auto" else ".")
        )
    if shape is None:  # (a local folder has a config.json: JobSpec checked; named here only as "this model")
        shown = "this model" if Path(model).is_absolute() else f"`{model}`"
        return Preflight(
            f"🧮 **Pre-flight:** memory estimate unavailable: the config of {shown} is not on this machine "
            "(nothing is downloaded for an estimate); the run reads it when it starts"
            + (" and works out `auto` then." if batch == "auto" else ".")
        )
    if gpu is None:
        return Preflight("🧮 **Pre-flight:** memory estimate unavailable: this GPU's memory is not known.")
    name, capacity = gpu
    setup = _setup(spec)
    try:
        picked = memory.pick_batch(shape, setup, capacity) if batch == "auto" else batch
        memory.check_fits(shape, picked, setup, capacity)
    except memory.BatchTooLarge as err:
        return Preflight(f"⛔ **Pre-flight:** {err}. Start is refused until it fits.", refusal=str(err))
    est = memory.estimate(shape, picked, setup, capacity, gpu_name=name, train_rows=train_rows)
    what = f"`auto` picks {picked:,} rows per GPU" if batch == "auto" else f"batch {picked:,} per GPU"
    line = f"{trained}{what}: {memory.preflight_line(est)} ({name}, {setup.precision})."
    return Preflight(f"🧮 **Pre-flight:** {line}")


def adapter_note(spec: JobSpec, shape: memory.ModelShape | None) -> str:
    """For a LoRA run, what trains: "LoRA trains 3.6M of 365M weights (0.98%); " (the base is frozen:
    no gradients or optimizer state for it, in the memory estimate too)."""
    cfg = spec.config
    if cfg.adapter != "lora":
        return ""
    if shape is None:
        return f"LoRA r {cfg.lora_r} on {', '.join(cfg.lora_target_modules)}; "
    trained = shape.lora_params(cfg.lora_r, tuple(cfg.lora_target_modules))
    share = 100 * trained / shape.params
    return f"LoRA trains {_millions(trained)} of {_millions(shape.params)} weights ({share:.2f}%); "


def _millions(n: int) -> str:
    return f"{n / 1e6:.1f}M" if n >= 1e5 else f"{n:,}"


def preflight(gpus: int, gpu: tuple[str, float] | None, values: Mapping) -> Preflight:
    """The pre-flight line of the form's ``values`` (FIELDS name -> value), checked as Start
    checks them; a value Start would refuse shows its reason instead."""
    try:
        spec = JobSpec(
            make_config(
                model_name_or_path=values["model_name_or_path"] or "",
                dataset_name="sample",  # the data does not change the memory; its rows are counted below
                n_train=values["n_train"] or None,
                per_device_train_batch_size=parse_batch(values["per_device_train_batch_size"]),
                max_source_length=values["max_source_length"],
                max_target_length=values["max_target_length"],
                **train_lora.settings(values),
            ),
            strategy=values["strategy"],
            precision=values["precision"],
            num_gpus=values["num_gpus"] or 0,
        )
        if spec.num_gpus > gpus:
            raise ValueError(f"{spec.num_gpus} GPU(s) asked for, {gpus} visible on this machine")
    except ValueError as err:
        return Preflight(f"⚠️ **Pre-flight:** {err}")
    rows = spec.config.n_train  # another dataset's size is not known before the run loads it
    if values["data_source"] == "sample":
        rows = min(rows or sample_rows(), sample_rows())
    return assess(spec, gpu, train_rows=rows)


def check_start(spec: JobSpec, gpu: tuple[str, float] | None) -> None:
    """BatchTooLarge (naming the batch that fits) when the run's batch will not fit its GPUs."""
    refusal = assess(spec, gpu).refusal
    if refusal:
        raise memory.BatchTooLarge(refusal)


# --------------------------------------------------------------------------- the feedback share

TRAINED_RATINGS = ("like", "correction")  # the accepted rows an export trains on (FeedbackStore.export)
HOLDOUT_EVERY = 10  # and every tenth of them held out once there are twice as many


def feedback_mix(accepted: int, base_rows: int | None, ratio: float) -> str:
    """The line under the feedback share: what the share makes of the accepted rows in an epoch,
    as finetune.data.mix draws them (the smaller part repeated until both are seen once). Three
    accepted rows at the default share became ~1,400 of ~2,800 rows, each repeated ~470 times, and
    nothing said so. ``base_rows``: the other data's train rows, None when not known here (a Hub
    dataset, an upload)."""
    if accepted <= 0:
        return "No accepted chat feedback yet: accept liked or corrected replies under **Feedback from the chat**."
    held = accepted // HOLDOUT_EVERY if accepted >= 2 * HOLDOUT_EVERY else 0
    rows = accepted - held
    what = f"{rows:,} accepted row{'s' if rows != 1 else ''}" + (f" (+{held} held out to evaluate)" if held else "")
    if ratio >= 1:
        return f"🧮 {what}, trained on alone: each once an epoch."
    if not base_rows:
        return (
            f"🧮 {what} at a share of {ratio:g}: repeated until they are {ratio:.0%} of each epoch's rows "
            "(how often depends on the dataset's size)."
        )
    epoch = max(base_rows / (1 - ratio), rows / ratio)
    feedback = ratio * epoch
    line = (
        f"🧮 {what} at a share of {ratio:g}: each epoch ≈ {epoch:,.0f} rows, {feedback:,.0f} of them "
        f"feedback: each accepted row ≈ {feedback / rows:,.0f}× an epoch."
    )
    if feedback / rows >= 3:
        own = rows / (rows + base_rows)
        line += f" A share near {own:.2g} (the rows' own) trains on each about once."
    return line


def accepted_rows(store) -> int:
    """How many accepted rows of ``store`` (a finetune.feedback.FeedbackStore) a run trains on."""
    count, offset = 0, 0
    while page := store.rows("accepted", limit=1000, offset=offset):
        count += sum(row.rating in TRAINED_RATINGS for row in page)
        offset += len(page)
    return count


def feedback_line(store, source: str | None, n_train, ratio) -> str:
    """``feedback_mix`` for the form's values: the store's accepted rows and the sample's train rows
    (the first ``n_train`` of them when that is set); other data sources' sizes are not known here."""
    base = None
    if source == "sample":
        base = sample_rows() if not n_train or n_train <= 0 else min(int(n_train), sample_rows())
    try:
        share = float(ratio)
    except (TypeError, ValueError):
        return ""
    return feedback_mix(accepted_rows(store), base, share) if 0 < share <= 1 else ""
