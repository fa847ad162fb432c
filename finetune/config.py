"""Training configuration: one typed dataclass, filled from a YAML file and/or CLI flags.

Every field is a flag of the same name (``--learning_rate 1e-5``); ``--config run.yaml`` reads
defaults from a YAML mapping of the same names first, so the CLI wins. Unknown keys are an
error, never silently ignored. The seed's flags keep their names and meanings.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import pkgutil
import typing
from dataclasses import dataclass, field
from pathlib import Path

import yaml

from chat.adapters import ADAPTER_KINDS, LORA_TARGETS
from chat.layout import DEFAULT_MODEL, is_hub_id
from chat.model import ATTENTION, MODEL_PRESETS
from finetune.preference import OBJECTIVES

DEFAULT_DATASET = "smangrul/MuDoConv"
TRACKERS = ("tensorboard", "wandb", "trackio", "all")

EVAL_ATTENTION = ("eager", "grouped", "sdpa")  # evaluation decoding; see TrainConfig.eval_attention


def _doc(text: str, **kw):
    return field(metadata={"help": text}, **kw)


@functools.cache
def builder_names() -> frozenset[str]:
    """The names ``datasets.load_dataset`` takes for one of its built-in loaders (json, csv, text,
    parquet, imagefolder, ...), lower-cased: every module of ``datasets.packaged_modules``. Such a
    name reads data files from the working directory, not a Hub dataset."""
    from datasets import packaged_modules  # lazy: importing datasets takes a second

    names = {module.name for module in pkgutil.iter_modules(packaged_modules.__path__)}
    names |= set(getattr(packaged_modules, "_PACKAGED_DATASETS_MODULES", {}))  # what load_dataset checks
    return frozenset(name.lower() for name in names)


def dataset_name_problem(name: str) -> str | None:
    """Why ``name`` cannot be a dataset name, or None: 'sample' or a Hub dataset id only.

    ``datasets.load_dataset(name)`` also takes a built-in loader's name (then it reads files of the
    working directory: ``json`` found source files and the sample) and a local folder (read instead
    of the Hub dataset of the same name); local data goes through ``train_file``, whose files are
    checked. Not a Hub id: paths (absolute, ``..``, ``~``), ``hf://`` URLs, bucket paths."""
    if name == "sample":
        return None
    if not is_hub_id(name):
        return f"{name!r} is not 'sample' or a Hub dataset id ('user/name')"
    if "/" not in name and name.lower() in builder_names():  # (all of them are bare names)
        return f"{name!r} is one of the datasets library's built-in loaders, which read local files, not a Hub dataset"
    if Path(name).exists():
        what = "folder" if Path(name).is_dir() else "file"
        return f"{name!r} is a local {what}, which datasets would read instead of the Hub"
    return None


@dataclass
class TrainConfig:
    # --- model and data
    model_name_or_path: str = _doc(
        "Hub id, local checkpoint directory, or a preset: 'tiny', 'random-400M' (offline).", default=DEFAULT_MODEL
    )
    dataset_name: str | None = _doc("Hub dataset id, or 'sample' for the shipped sample data.", default=DEFAULT_DATASET)
    train_file: str | None = _doc(
        "Local train file (.jsonl/.json/.csv/.parquet); overrides dataset_name.", default=None
    )
    validation_file: str | None = _doc("Local validation file (same formats).", default=None)
    feedback_file: str | None = _doc(
        "Extra training rows (e.g. the app's feedback export, same formats), mixed into the train split.", default=None
    )
    feedback_ratio: float = _doc(
        "Share of training rows drawn from feedback_file (0 < r <= 1; the smaller part is oversampled so both "
        "are seen once per epoch; 1 = the feedback rows only).",
        default=0.5,
    )
    feedback_validation_file: str | None = _doc(
        "Held-out feedback rows, evaluated separately (eval_bleu_feedback); needs feedback_file.", default=None
    )
    n_train: int | None = _doc(
        "Use only the first N train rows (seed behaviour, no shuffle before the cut).", default=None
    )
    n_val: int | None = _doc("Use only the first N validation rows.", default=None)
    source_prefix: str = _doc(
        "Text prepended to every source at tokenization (the seed used 'chatbot: ').", default="chatbot: "
    )
    max_source_length: int = _doc("Encoder tokens; long dialogues drop their oldest turns to fit.", default=128)
    max_target_length: int = _doc("Label tokens for training.", default=64)
    val_max_target_length: int | None = _doc(
        "Max generated length at evaluation (default: max_target_length).", default=None
    )
    val_min_target_length: int = _doc("Min generated length at evaluation.", default=20)
    pad_to_max_length: bool = _doc("Pad every batch to the max lengths (seed); default pads per batch.", default=False)
    attention: str = _doc(
        "Attention kernels: auto (fastest measured), sdpa, eager, sdpa-flash, sdpa-efficient, sdpa-cudnn.",
        default="auto",
    )
    group_by_length: bool = _doc(
        "Batch rows of similar length together: less padding, but slower convergence per step on the sample "
        "data (docs/benchmarks.md).",
        default=False,
    )
    packing: bool | None = _doc(
        "Pack several dialogues into each training row, attention kept inside each (finetune/packing.py): same "
        "loss and gradients, ~1.6x fewer multiply-adds on realistic rows. Default: on unless pad_to_max_length "
        "or attention sdpa-flash (which takes no mask).",
        default=None,
    )
    dataloader_num_workers: int | None = _doc(
        "Batch-collating worker processes (default: 2 on GPUs, 0 on CPU).", default=None
    )
    # --- preference tuning (finetune/preference.py, finetune/preference_data.py)
    objective: str = _doc(
        "sft: learn the target replies (cross-entropy); dpo: prefer each chosen reply over its rejected one; "
        "kto: raise desirable replies and lower undesirable ones (unpaired). dpo and kto need preference_file.",
        default="sft",
    )
    beta: float = _doc(
        "How far dpo/kto may move from the starting model (the reference): larger stays closer.", default=0.1
    )
    sft_weight: float = _doc(
        "Weight of a cross-entropy term on the chosen (dpo) or desirable (kto) replies, added to the loss.", default=0.0
    )
    preference_file: str | None = _doc(
        "Preference rows (.jsonl/.json/.csv/.parquet): kind, context, turns (or texts) with chosen and rejected "
        "(dpo) or response and label (kto); every 10th row is held out unless preference_validation_file is given.",
        default=None,
    )
    preference_validation_file: str | None = _doc(
        "Held-out preference rows (eval_pref_accuracy, eval_pref_margin); needs preference_file.", default=None
    )
    # --- adapters (finetune/lora.py)
    adapter: str = _doc(
        "none: fine-tune every weight; lora: train a LoRA adapter (peft) on the frozen base. A finished "
        "adapter run's final/ as --model_name_or_path always trains that adapter further (on its base).",
        default="none",
    )
    lora_r: int = _doc("LoRA rank (with --adapter lora).", default=8)
    lora_alpha: int = _doc("LoRA alpha: the update is scaled by alpha / r.", default=16)
    lora_dropout: float = _doc("Dropout on the LoRA path's input while training (0 <= p < 1).", default=0.05)
    lora_target_modules: tuple[str, ...] = _doc(
        "Projections that get a LoRA pair, comma-separated (a list in YAML), in the encoder and the decoder: "
        + ", ".join(LORA_TARGETS)
        + ".",
        default=LORA_TARGETS,
    )
    lora_fused: bool = _doc(
        "Train through finetune/lora_layer.py: the LoRA update added inside the base projection's matrix product "
        "and, on a GPU, its dropout recomputed in the backward pass instead of kept (same results as peft's layer, "
        "less memory and traffic); false: peft's own layer.",
        default=True,
    )
    # --- evaluation
    num_beams: int = _doc("Beams for evaluation generation.", default=10)
    no_repeat_ngram_size: int = _doc("Evaluation n-gram blocking in the output.", default=3)
    encoder_no_repeat_ngram_size: int = _doc("Evaluation blocking of n-grams copied from the input.", default=3)
    repetition_penalty: float = _doc("Evaluation repetition penalty.", default=1.2)
    n_val_batch_generations: int = _doc(
        "Evaluation batches whose (prompt, prediction, reference) are logged.", default=5
    )
    eval_attention: str = _doc(
        "Attention for evaluation generation: grouped (eager, with cross-attention read once per input "
        "for all its beams: chat.fastgen; 1.31x on an H200), eager (per hypothesis) or sdpa.",
        default="grouped",
    )
    fast_ngram_blocking: bool = _doc(
        "Tensorized n-gram blocking (same bans as transformers' per-hypothesis loop, far faster).", default=True
    )
    context_scorer: str | None = _doc(
        "Model that scores the context score (eval_context_hits): a preset, Hub id or local model folder, fixed so "
        "runs compare on one scale; default: the evaluated model.",
        default=None,
    )
    # --- optimisation
    per_device_train_batch_size: int | str = _doc(
        "Micro-batch per process, or 'auto': the largest that fits the GPU (finetune/memory.py; 8 without a GPU).",
        default=8,
    )
    per_device_eval_batch_size: int = _doc("Evaluation batch per process.", default=8)
    learning_rate: float = _doc("Peak learning rate.", default=5e-5)
    weight_decay: float = _doc("AdamW weight decay.", default=0.0)
    num_train_epochs: int = _doc("Epochs (ignored when max_train_steps is set).", default=1)
    max_train_steps: int | None = _doc("Total optimizer steps; overrides num_train_epochs.", default=None)
    gradient_accumulation_steps: int = _doc("Micro-batches per optimizer step.", default=1)
    lr_scheduler_type: str = _doc("transformers scheduler when the DeepSpeed JSON has none.", default="linear")
    num_warmup_steps: int = _doc("Warm-up steps of the learning-rate schedule.", default=0)
    max_grad_norm: float = _doc("Gradient clipping (fills DeepSpeed's 'auto').", default=1.0)
    seed: int = _doc("Random seed.", default=42)
    # --- logging, checkpoints, hub
    output_dir: str = _doc("Where metrics, checkpoints and the final model go.", default="runs/latest")
    logging_steps: int = _doc("Log loss / lr / speed every N optimizer steps.", default=10)
    with_tracking: bool = _doc("Also log to the trackers in report_to.", default=False)
    report_to: str = _doc("Tracker: tensorboard, wandb, trackio or all.", default="tensorboard")
    report_name: str = _doc("Tracker project/run name.", default="blenderbot_finetuning")
    checkpointing_steps: int | None = _doc(
        "Save full training state every N steps (and at each epoch end).", default=None
    )
    checkpoints_total_limit: int = _doc("Keep this many step checkpoints (older ones are deleted).", default=2)
    resume_from_checkpoint: str | None = _doc("'latest' or a checkpoint directory to continue from.", default=None)
    profile_dir: str | None = _doc(
        "Write a torch.profiler table of training steps 3-5 (main process) to this folder.", default=None
    )
    save_model: bool = _doc(
        "Save the final model to output_dir/final (off only for benchmarks and dry runs).", default=True
    )
    push_to_hub: bool = _doc("Upload the final model to the Hub.", default=False)
    hub_model_id: str | None = _doc("Hub repo 'user/name' for push_to_hub.", default=None)
    hub_private: bool = _doc("Create the Hub repo as private.", default=False)

    def __post_init__(self):
        if self.train_file is None and self.dataset_name is None:
            raise ValueError("give --dataset_name or --train_file")
        if (self.train_file is None) != (self.validation_file is None):
            raise ValueError("--train_file and --validation_file go together")
        problem = dataset_name_problem(self.dataset_name) if self.train_file is None else None
        if problem:
            raise ValueError(f"--dataset_name {problem}: give local data as --train_file/--validation_file")
        if not 0 < self.feedback_ratio <= 1:  # (also refuses NaN)
            raise ValueError(f"--feedback_ratio must be > 0 and <= 1, got {self.feedback_ratio}")
        if self.feedback_validation_file is not None and self.feedback_file is None:
            raise ValueError("--feedback_validation_file needs --feedback_file (held-out rows of the same feedback)")
        for name in (
            "max_source_length",
            "max_target_length",
            "per_device_train_batch_size",
            "per_device_eval_batch_size",
            "num_train_epochs",
            "gradient_accumulation_steps",
            "num_beams",
            "logging_steps",
        ):
            if getattr(self, name) != "auto" and getattr(self, name) < 1:  # (only the batch size takes 'auto')
                raise ValueError(f"--{name} must be >= 1, got {getattr(self, name)}")
        for name in ("n_train", "n_val", "max_train_steps", "checkpointing_steps"):
            value = getattr(self, name)
            if value is not None and value < 1:
                raise ValueError(f"--{name} must be >= 1, got {value}")
        if self.val_max_target_length is None:
            self.val_max_target_length = self.max_target_length
        if self.val_min_target_length > self.val_max_target_length:
            raise ValueError("--val_min_target_length is larger than --val_max_target_length")
        if self.learning_rate <= 0:
            raise ValueError("--learning_rate must be > 0")
        if self.report_to not in TRACKERS:
            raise ValueError(f"--report_to must be one of {', '.join(TRACKERS)}")
        if self.attention not in ATTENTION:
            raise ValueError(f"--attention must be one of {', '.join(ATTENTION)}, got {self.attention!r}")
        if self.eval_attention not in EVAL_ATTENTION:
            raise ValueError(
                f"--eval_attention must be one of {', '.join(EVAL_ATTENTION)}, got {self.eval_attention!r}"
            )
        if self.context_scorer is not None:
            self._check_scorer()
        if self.packing and self.pad_to_max_length:
            raise ValueError("--packing and --pad_to_max_length exclude each other: packed rows are never padded")
        if self.packing and self.attention == "sdpa-flash":
            raise ValueError(
                "--packing needs attention masks, which sdpa-flash does not take: choose another --attention"
            )
        if self.dataloader_num_workers is not None and self.dataloader_num_workers < 0:
            raise ValueError(f"--dataloader_num_workers must be >= 0, got {self.dataloader_num_workers}")
        self._check_adapter()
        self._check_objective()
        if self.push_to_hub and not self.save_model:
            raise ValueError("--push_to_hub needs the final model: drop --save_model false")
        if self.push_to_hub and not self.hub_model_id:
            raise ValueError("--push_to_hub needs --hub_model_id user/name")
        if self.hub_model_id and self.hub_model_id.count("/") != 1:
            raise ValueError(f"--hub_model_id must look like 'user/name', got {self.hub_model_id!r}")

    def _check_adapter(self) -> None:
        """--adapter and the --lora_* settings. (An adapter folder as the model, which continues that
        adapter with its own settings, is read when the run starts: finetune.lora.prepare.)"""
        self.lora_target_modules = module_names(self.lora_target_modules)
        if self.adapter not in ADAPTER_KINDS:
            raise ValueError(f"--adapter must be one of {', '.join(ADAPTER_KINDS)}, got {self.adapter!r}")
        if self.adapter == "none":
            changed = [name for name in LORA_FIELDS if getattr(self, name) != FIELD_DEFAULTS[name]]
            if changed:
                raise ValueError(f"--{changed[0]} needs --adapter lora (full fine-tuning has no LoRA settings)")
            return
        if isinstance(self.lora_r, bool) or self.lora_r < 1:
            raise ValueError(f"--lora_r must be >= 1, got {self.lora_r}")
        if isinstance(self.lora_alpha, bool) or self.lora_alpha < 1:
            raise ValueError(f"--lora_alpha must be >= 1, got {self.lora_alpha}")
        if not 0 <= self.lora_dropout < 1:  # (also refuses NaN)
            raise ValueError(f"--lora_dropout must be >= 0 and < 1, got {self.lora_dropout}")

    def _check_scorer(self) -> None:
        name = self.context_scorer = self.context_scorer.strip()
        if name not in MODEL_PRESETS and not (Path(name) / "config.json").is_file() and not is_hub_id(name):
            raise ValueError(f"--context_scorer must be a preset, a Hub id or a model folder, got {name!r}")

    def _check_objective(self) -> None:
        if self.objective not in OBJECTIVES:
            raise ValueError(f"--objective must be one of {', '.join(OBJECTIVES)}, got {self.objective!r}")
        if self.objective == "sft":
            if self.preference_file is not None:
                raise ValueError("--preference_file needs --objective dpo or kto")
        elif self.preference_file is None:
            raise ValueError(f"--objective {self.objective} needs --preference_file (its preference rows)")
        if self.preference_validation_file is not None and self.preference_file is None:
            raise ValueError("--preference_validation_file needs --preference_file")
        if not self.beta > 0:  # (also refuses NaN)
            raise ValueError(f"--beta must be > 0, got {self.beta}")
        if not self.sft_weight >= 0:
            raise ValueError(f"--sft_weight must be >= 0, got {self.sft_weight}")

    @property
    def packs(self) -> bool:
        """Whether training batches are packed (``packing``, or its default)."""
        if self.packing is not None:
            return self.packing
        return not self.pad_to_max_length and self.attention != "sdpa-flash"

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    def tracker_config(self) -> dict:
        """The settings as trackers take them: set ones only, lists as text (TensorBoard's hparams
        refuse a tuple such as lora_target_modules)."""
        return {k: ",".join(v) if isinstance(v, tuple) else v for k, v in self.to_dict().items() if v is not None}


LORA_FIELDS = ("lora_r", "lora_alpha", "lora_dropout", "lora_target_modules", "lora_fused")
FIELD_DEFAULTS = {f.name: f.default for f in dataclasses.fields(TrainConfig)}


def module_names(value) -> tuple[str, ...]:
    """--lora_target_modules: comma-separated text (the CLI) or a list (YAML, training_args.json), as a
    tuple of BlenderBot's projection names in the order given; ValueError naming the unknown ones."""
    if isinstance(value, str):
        value = value.split(",")
    if not isinstance(value, (list, tuple)) or not all(isinstance(v, str) for v in value):
        raise ValueError(f"--lora_target_modules must be module names, got {value!r}")
    names = tuple(dict.fromkeys(v.strip() for v in value if v.strip()))  # (order kept, repeats dropped)
    unknown = [name for name in names if name not in LORA_TARGETS]
    if unknown:
        raise ValueError(
            f"--lora_target_modules: unknown module(s) {', '.join(unknown)}; BlenderBot's are {', '.join(LORA_TARGETS)}"
        )
    if not names:
        raise ValueError(f"--lora_target_modules needs at least one of {', '.join(LORA_TARGETS)}")
    return names


def _field_type(f: dataclasses.Field) -> type:
    """The concrete type behind ``int | None`` style annotations."""
    hint = typing.get_type_hints(TrainConfig)[f.name]
    if hint == tuple[str, ...]:  # module names: "a,b" on the CLI, checked by __post_init__
        return str
    args = [a for a in typing.get_args(hint) if a is not type(None)]
    if args == [int, str]:  # a number or 'auto'
        return int_or_auto
    return args[0] if args else hint


def int_or_auto(value) -> int | str:
    """A whole number, or 'auto' (any case): the type of --per_device_train_batch_size."""
    if isinstance(value, str) and value.strip().lower() == "auto":
        return "auto"
    if isinstance(value, bool) or not isinstance(value, (int, str)):
        raise ValueError(f"expected a whole number or 'auto', got {value!r}")
    return int(value)


def _parse_bool(text: str) -> bool:
    lowered = text.lower()
    if lowered in ("1", "true", "yes"):
        return True
    if lowered in ("0", "false", "no"):
        return False
    raise argparse.ArgumentTypeError(f"expected true/false, got {text!r}")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m finetune",
        description="Fine-tune BlenderBot on MuDoConv-format dialogues with accelerate + DeepSpeed.",
    )
    parser.add_argument("--config", help="YAML file of defaults (same keys as the flags).")
    for f in dataclasses.fields(TrainConfig):
        kind = _field_type(f)
        if kind is bool:
            # `--flag` turns it on (seed style); `--flag false` is accepted too.
            parser.add_argument(
                f"--{f.name}",
                nargs="?",
                const=True,
                type=_parse_bool,
                default=argparse.SUPPRESS,
                help=f.metadata["help"],
            )
        else:
            parser.add_argument(
                f"--{f.name}",
                type=kind,
                default=argparse.SUPPRESS,
                help=f.metadata["help"] + f" (default: {f.default})",
            )
    return parser


def load_yaml(path: str) -> dict:
    try:
        data = yaml.safe_load(Path(path).read_text()) or {}
    except (OSError, yaml.YAMLError) as err:
        raise ValueError(f"cannot read config {path}: {err}") from None
    if not isinstance(data, dict):
        raise ValueError(f"config {path} must be a mapping of option names to values")
    fields = {f.name: f for f in dataclasses.fields(TrainConfig)}
    unknown = sorted(set(data) - set(fields))
    if unknown:
        raise ValueError(f"config {path}: unknown keys {unknown}")
    return {name: _yaml_value(path, fields[name], value) for name, value in data.items()}


def _yaml_value(path: str, f: dataclasses.Field, value):
    """Give a YAML value the field's type, as the CLI would: YAML reads 5e-5 as a string."""
    kind = _field_type(f)
    if kind is int_or_auto:
        try:
            return int_or_auto(value)
        except ValueError:
            raise ValueError(f"config {path}: {f.name} must be a whole number or 'auto', got {value!r}") from None
    if typing.get_type_hints(TrainConfig)[f.name] == tuple[str, ...]:
        try:
            return module_names(value)
        except ValueError as err:
            raise ValueError(f"config {path}: {err}") from None
    if value is None and type(None) in typing.get_args(typing.get_type_hints(TrainConfig)[f.name]):
        return value
    if kind is bool:
        typed = isinstance(value, bool)
    else:  # bool is an int to Python, never to us; an int is a fine float
        typed = not isinstance(value, bool) and isinstance(value, (int, float) if kind is float else kind)
    if typed:
        return kind(value)
    if isinstance(value, str):
        try:
            return _parse_bool(value) if kind is bool else kind(value)
        except (ValueError, argparse.ArgumentTypeError):
            pass
    raise ValueError(f"config {path}: {f.name} must be {kind.__name__}, got {value!r}")


def parse_args(argv: list[str] | None = None) -> TrainConfig:
    parser = build_parser()
    args = vars(parser.parse_args(argv))
    try:
        values = load_yaml(args.pop("config")) if args.get("config") else {}
        args.pop("config", None)
        values.update(args)
        return TrainConfig(**values)
    except (TypeError, ValueError) as err:
        parser.error(str(err))
