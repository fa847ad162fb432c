"""What a run is: the training CLI's own settings plus how to launch them.

A ``JobSpec`` holds a ``finetune.config.TrainConfig`` (the CLI's names, defaults and checks:
the run trains with exactly that config) and the launch settings the CLI does not have:
strategy, precision, number of GPUs, and an uploaded train file to split. It is checked when it
is made, with clear ``ValueError`` messages: numbers within the app's LIMITS (the CLI has no
upper bounds), a model or data file given as a local path must
resolve inside ``paths.allowed_roots()`` (and is replaced by its resolved absolute form), Hub
ids must look like ones, and the CPU refuses what needs GPUs.

``make_config`` builds a TrainConfig from loosely typed values (a form's numbers arrive as
floats); ``APP_PRESET`` is where the app's Train tab starts from other values than the CLI's.
run.json stores ``JobSpec.to_dict()``; ``JobSpec.from_dict`` also reads the flat "RunSpec"
form that run folders written before this package hold.
"""

from __future__ import annotations

import dataclasses
import math
import typing
from dataclasses import dataclass
from pathlib import Path

from chat.adapters import base_of, is_adapter_dir
from chat.layout import SAMPLE_DIR, is_hub_id
from chat.model import MODEL_PRESETS
from finetune.config import TrainConfig
from finetune.jobs.paths import data_root, local_path

STRATEGIES = ("zero2", "zero3_offload", "ddp")  # each has an accelerate config: command.CONFIG_FILES
PRECISIONS = ("auto", "bf16", "fp16", "fp32")

# The app's preset: the Train tab's starting values where they differ from the CLI's defaults,
# as TrainConfig overrides. "*" is for every base model, a model's own entry goes on top. They
# are the README's CPU recipe (a run from the tab should show learning within minutes on the
# sample) except the train batch, 'auto' (finetune/memory.py: the largest that fits the GPU, 8 on
# the CPU); the 400M model keeps the CLI's learning rate (5e-5) and logging interval (10).
APP_PRESET: dict[str, dict] = {
    "*": {
        "num_train_epochs": 3,
        "per_device_train_batch_size": "auto",
        "per_device_eval_batch_size": 32,
        "num_beams": 4,
    },
    "tiny": {"learning_rate": 1e-3},  # the tiny model learns the sample fast
}

# Set by RunManager for each launch (the run folder, resume), never part of a spec.
MANAGED = ("output_dir", "resume_from_checkpoint")
# A folder the CLI would write to outside the run folder: not for runs started by the app.
UNAVAILABLE = ("profile_dir",)

# Upper bounds of the app's runs (the CLI has none; the model's positions bound the lengths
# further, checked by the CLI): a form value far beyond any real run is a typo or an attempt to
# tie up the shared machine (allocations that fail after minutes of loading, a run that never ends).
LIMITS = {
    "num_train_epochs": 1000,
    "max_train_steps": 10**7,
    "num_warmup_steps": 10**7,
    "per_device_train_batch_size": 65536,
    "per_device_eval_batch_size": 65536,
    "gradient_accumulation_steps": 1024,
    "num_beams": 32,
    "max_source_length": 1024,
    "max_target_length": 1024,
    "val_max_target_length": 1024,
    "val_min_target_length": 1024,
    "logging_steps": 10**7,
    "checkpointing_steps": 10**7,
    "checkpoints_total_limit": 1000,
    "n_train": 10**9,
    "n_val": 10**9,
    "n_val_batch_generations": 1000,
    "dataloader_num_workers": 64,
    "learning_rate": 1.0,
    "lora_r": 1024,
    "lora_alpha": 65536,
}

# The flat spec of run folders written before finetune/jobs: its names that TrainConfig spells otherwise.
_RUN_SPEC_NAMES = {
    "model": "model_name_or_path",
    "epochs": "num_train_epochs",
    "train_batch_size": "per_device_train_batch_size",
    "eval_batch_size": "per_device_eval_batch_size",
}

_FIELDS = {f.name: f for f in dataclasses.fields(TrainConfig)}
_HINTS = typing.get_type_hints(TrainConfig)


def default(name: str):
    """The CLI's default for TrainConfig field ``name``."""
    return _FIELDS[name].default


def _typed(name: str, value, kind: type, optional: bool):
    """``value`` as ``kind``, the way a form gives it: 3.0 is 3 but 2.5 is not a whole number,
    True is no number, and empty input is None (refused unless ``optional``). Empty text stays
    text for a required text field (a source prefix may be empty)."""
    empty = value is None or (isinstance(value, str) and not value.strip() and (optional or kind is not str))
    if empty:
        if optional:
            return None
        raise ValueError(f"{name} is required")
    if kind is bool:
        if not isinstance(value, bool):
            raise ValueError(f"{name} must be true or false, got {value!r}")
        return value
    if kind in (int, float) and (isinstance(value, bool) or not isinstance(value, (int, float))):
        raise ValueError(f"{name} must be a {'whole ' if kind is int else ''}number, got {value!r}")
    if kind is int:
        if isinstance(value, float) and not value.is_integer():
            raise ValueError(f"{name} must be a whole number, got {value!r}")
        return int(value)
    if kind is float:
        if not math.isfinite(value):
            raise ValueError(f"{name} must be a finite number, got {value!r}")
        return float(value)
    if not isinstance(value, str):  # a bad value like any other, for the form's user
        raise ValueError(f"{name} must be text, got {value!r}")  # noqa: TRY004
    return value


def int_or_auto(name: str, value) -> int | str:
    """A positive whole number or 'auto' (any case), as a form gives it ("16", 16 and 16.0 are 16),
    for the batch size; ValueError naming ``name`` otherwise."""
    number = value.strip() if isinstance(value, str) else value
    if isinstance(number, str):
        if number.lower() == "auto":
            return "auto"
        number = int(number) if number.isdigit() else number
    elif isinstance(number, float) and number.is_integer():
        number = int(number)
    if isinstance(number, int) and not isinstance(number, bool) and number >= 1:
        return number
    shown = "nothing" if value is None or (isinstance(value, str) and not value.strip()) else repr(value)
    raise ValueError(f"{name} must be a positive whole number or 'auto', got {shown}")


def make_config(**values) -> TrainConfig:
    """A TrainConfig from loosely typed values (a form's, run.json's), each given its field's
    type first (see ``_typed``); then TrainConfig checks them as the CLI does.

    A max_target_length below the CLI's val_min_target_length default lowers that minimum too
    (unless it is given): the CLI refuses a minimum above the maximum, and a form sets only
    max_target_length."""
    unknown = sorted(set(values) - set(_FIELDS))
    if unknown:
        raise ValueError(f"unknown training settings: {', '.join(unknown)}")
    typed = {}
    for name, value in values.items():
        args = typing.get_args(_HINTS[name])
        if set(args) == {int, str}:  # per_device_train_batch_size: a number or 'auto'
            typed[name] = int_or_auto(name, value)
            continue
        if _HINTS[name] == tuple[str, ...]:  # lora_target_modules: a list or "a,b" (TrainConfig checks the names)
            typed[name] = tuple(value) if isinstance(value, list) else value
            continue
        kind = next((a for a in args if a is not type(None)), _HINTS[name])
        typed[name] = _typed(name, value, kind, optional=type(None) in args)
    longest = typed.get("val_max_target_length") or typed.get("max_target_length", default("max_target_length"))
    if "val_min_target_length" not in typed and longest < default("val_min_target_length"):
        typed["val_min_target_length"] = longest
    return TrainConfig(**typed)


def app_defaults(model: str) -> dict:
    """APP_PRESET's TrainConfig overrides for a run of base model ``model``."""
    return {**APP_PRESET["*"], **APP_PRESET.get(model, {})}


def app_config(model: str, **values) -> TrainConfig:
    """The config of a run of ``model`` as the app starts it: the CLI's defaults, the app's
    preset for the model, then ``values``."""
    return make_config(model_name_or_path=model, **{**app_defaults(model), **values})


def _number(value) -> str:
    return f"{value:,}" if isinstance(value, int) and abs(value) < 10**15 else f"{value:.3g}"


def check_limits(cfg: TrainConfig) -> None:
    """ValueError naming the first setting above its LIMITS bound, and the bound."""
    for name, limit in LIMITS.items():
        value = getattr(cfg, name)
        if value is not None and value != "auto" and value > limit:
            raise ValueError(f"{name} must be at most {_number(limit)} for runs of the app, got {_number(value)}")


def _data_file(value: str, what: str) -> str:
    """An allowed local data file with a loader, as its resolved absolute path."""
    from finetune.data import LOADERS  # lazy: finetune.data imports datasets

    path = local_path(value, what)
    if path is None:
        raise ValueError(f"{what} {value!r}: no such file")
    if not path.is_file():
        raise ValueError(f"{what} {str(path)!r} is not a file")
    if path.suffix.lower() not in LOADERS:
        raise ValueError(f"{what} {path.name!r}: unsupported file type (use {', '.join(LOADERS)})")
    return str(path)


# Files of the app's exports (finetune.feedback) and uploads: only under the data root; preference
# files also from the shipped sample's preference set (data/sample/preferences-*.jsonl).
EXPORTED_FILES = {
    "feedback_file": ("feedback file", False),
    "feedback_validation_file": ("feedback held-out file", False),
    "preference_file": ("preference file", True),
    "preference_validation_file": ("preference held-out file", True),
}


def _feedback(cfg: TrainConfig) -> dict:
    """The feedback and preference files checked and resolved like any data file, and only under
    the data root, where the app's exports (finetune.feedback) and uploads live (preference files
    also the shipped sample's)."""
    changes = {}
    for name, (what, sample_too) in EXPORTED_FILES.items():
        value = getattr(cfg, name)
        if value is None:
            continue
        path = Path(_data_file(value.strip(), what))
        shipped = sample_too and path.parent == SAMPLE_DIR.resolve() and path.name.startswith("preferences-")
        if not (path.is_relative_to(data_root()) or shipped):
            raise ValueError(f"{what} {value!r} must be in the data folder ({data_root()}): export or upload it")
        changes[name] = str(path)
    return changes


def checked_model(value: str) -> str:
    """A run's base model: a preset, an allowed local model folder or finished adapter run (as its
    resolved absolute path: an adapter is trained further) or a Hub id; ValueError saying why not otherwise."""
    model = value.strip()
    if not model:
        raise ValueError("model is required (a preset such as 'tiny', a Hub id, or a finished run)")
    if model in MODEL_PRESETS:
        return model
    path = local_path(model, "model")
    if path is not None:
        if is_adapter_dir(path):  # the run loads its base too: one the app may load
            base = base_of(path)[0]
            if is_adapter_dir(base) or checked_model(base) != base:
                raise ValueError(f"model {model!r}: its adapter's base {base!r} is not one the app may train on")
        elif not (path / "config.json").is_file():
            raise ValueError(f"model {model!r} is not a model folder (no config.json) nor a LoRA adapter's")
        return str(path)
    if not is_hub_id(model):
        raise ValueError(
            f"model {model!r} is not a preset ({', '.join(MODEL_PRESETS)}), a Hub id "
            "('user/name') or an allowed local folder"
        )
    return model


@dataclass
class JobSpec:
    """One training run: the CLI's config and how to launch it. Checked on creation; local paths
    in it are replaced by their resolved absolute form."""

    config: TrainConfig
    strategy: str = "zero2"  # GPUs only: "zero2" | "zero3_offload" | "ddp" (the CPU always uses ZeRO-2)
    precision: str = "auto"  # "auto" (bf16 if the GPU has it, else fp16) | "bf16" | "fp16" | "fp32"
    num_gpus: int = 0  # 0 = CPU: configs/accelerate/cpu_zero2.yaml, 2 processes (1 on a 1-core machine)
    # An uploaded train file given without a validation file: at start its last 10% of rows
    # become the validation split, in the run folder (uploads.write_split); config.train_file
    # and validation_file stay unset, the command names the split files.
    split_train_file: str | None = None

    def __post_init__(self):
        if not isinstance(self.config, TrainConfig):
            raise TypeError(f"config must be a TrainConfig, got {type(self.config).__name__}")
        self.num_gpus = _typed("num_gpus", self.num_gpus, int, optional=False)
        if self.num_gpus < 0:
            raise ValueError(f"num_gpus must be >= 0, got {self.num_gpus}")
        if self.strategy not in STRATEGIES:
            raise ValueError(f"strategy must be one of {', '.join(STRATEGIES)}, got {self.strategy!r}")
        if self.precision not in PRECISIONS:
            raise ValueError(f"precision must be one of {', '.join(PRECISIONS)}, got {self.precision!r}")
        if self.num_gpus == 0:
            if self.strategy != "zero2":
                raise ValueError(
                    f"strategy {self.strategy!r} needs GPUs; on the CPU (num_gpus 0) training "
                    "uses DeepSpeed ZeRO-2 (configs/accelerate/cpu_zero2.yaml): choose 'zero2'"
                )
            if self.precision in ("bf16", "fp16"):
                raise ValueError(f"precision {self.precision!r} needs GPUs; on the CPU use 'fp32' or 'auto'")
        cfg = self.config
        check_limits(cfg)
        for name in MANAGED:
            if getattr(cfg, name) != default(name):
                raise ValueError(f"{name} is not part of a run's spec: each launch sets it (the run folder)")
        for name in UNAVAILABLE:
            if getattr(cfg, name) != default(name):
                raise ValueError(f"{name} writes outside the run folder: not available for runs of the app")
        changes = {"model_name_or_path": checked_model(cfg.model_name_or_path), **self._data(cfg), **_feedback(cfg)}
        if cfg.context_scorer is not None:  # a local scorer must be one the app may load, as a base model is
            changes["context_scorer"] = checked_model(cfg.context_scorer)
        if cfg.hub_model_id is not None:
            changes["hub_model_id"] = cfg.hub_model_id.strip() or None
            if changes["hub_model_id"] and not is_hub_id(changes["hub_model_id"], owner=True):
                raise ValueError(f"Hub model id must look like 'user/name', got {cfg.hub_model_id!r}")
        self.config = dataclasses.replace(cfg, **changes)
        if is_adapter_dir(self.config.model_name_or_path):  # a finished adapter run: trained further, as it is
            from finetune.lora import continued_settings

            self.config = dataclasses.replace(self.config, adapter="lora", **continued_settings(self.config))

    def _data(self, cfg: TrainConfig) -> dict:
        """The config's data fields checked (and the upload to split): local files resolved."""
        if self.split_train_file is not None:
            if cfg.train_file is not None:
                raise ValueError("an upload to split replaces train_file/validation_file: give one or the other")
            self.split_train_file = _data_file(self.split_train_file.strip(), "dataset")
            return {}
        if cfg.train_file is not None:  # TrainConfig: validation_file comes with it
            return {
                "train_file": _data_file(cfg.train_file.strip(), "dataset"),
                "validation_file": _data_file(cfg.validation_file.strip(), "validation file"),
            }
        # TrainConfig refused what is not 'sample' or a Hub id, the datasets library's loader names
        # (json, csv, text...: they read local files) and folders of the working directory.
        dataset = cfg.dataset_name
        if dataset != "sample" and local_path(dataset, "dataset") is not None:  # one of the repository's
            raise ValueError(f"dataset {dataset!r} is a local path; give it as an uploaded train file")
        return {"dataset_name": dataset}

    @property
    def holds_out_validation(self) -> bool:
        """Does start() split an uploaded train file into the run folder?"""
        return self.split_train_file is not None

    def to_dict(self) -> dict:
        """run.json's "spec": the config's fields (not MANAGED: the run folder is the run's own)
        and the launch fields."""
        config = {name: value for name, value in self.config.to_dict().items() if name not in MANAGED}
        launch = {f.name: getattr(self, f.name) for f in dataclasses.fields(self) if f.name != "config"}
        return {"config": config, **launch}

    @classmethod
    def from_dict(cls, data: dict) -> JobSpec:
        """A spec from run.json: ``to_dict()``'s form, or the flat RunSpec of older run folders."""
        if "config" not in data:
            data = _from_run_spec(data)
        launch = {name: value for name, value in data.items() if name != "config"}
        unknown = sorted(set(launch) - {f.name for f in dataclasses.fields(cls)})
        if unknown:
            raise ValueError(f"unknown launch settings: {', '.join(unknown)}")
        return cls(make_config(**data["config"]), **launch)


def _from_run_spec(old: dict) -> dict:
    """The flat RunSpec of run folders written before finetune/jobs, in ``to_dict()``'s form.

    Its ``dataset`` was "sample", a Hub id, or an upload's absolute path: with its
    ``validation_file`` the two are train_file/validation_file, alone it is the upload to split."""
    old = dict(old)
    launch = {name: old.pop(name) for name in ("strategy", "precision", "num_gpus") if name in old}
    dataset, validation = old.pop("dataset", "sample"), old.pop("validation_file", None)
    config = {_RUN_SPEC_NAMES.get(name, name): value for name, value in old.items()}
    if not Path(dataset).is_absolute():
        config["dataset_name"] = dataset
    elif validation:
        config.update(train_file=dataset, validation_file=validation)
    else:
        launch["split_train_file"] = dataset
    return {"config": config, **launch}
