"""LoRA adapters in training (``--adapter lora``): the base is loaded, fingerprinted and frozen, peft
adds a LoRA pair to BlenderBot's projections, and the run trains and saves only those pairs.

The recipe (``finetune/train.py``) stays the same path as full fine-tuning; this module is what
differs:

- ``prepare``: which base a run loads (a finished adapter run's own base when continuing it, with
  that adapter's own settings);
- ``wrap``: the loaded base fingerprinted (``chat.adapters.model_fingerprint``, gathered under
  ZeRO-3) and wrapped by peft: a new adapter (``get_peft_model``) or the finished one, trainable
  again (``PeftModel.from_pretrained(..., is_trainable=True)``);
- checkpoints (``save_kwargs`` / ``load_kwargs``): under DeepSpeed ZeRO-0/1/2 a checkpoint holds
  the trainable weights and their optimizer state only (the base is loaded again on resume and
  must have the fingerprint the checkpoint recorded: ``check_resume``);
- ``final/`` (``parts.save_final``): peft's own layout (adapter_config.json,
  adapter_model.safetensors) plus the tokenizer, training_args.json (with ``base_fingerprint``:
  ``final_args``), all_results.json and the model card. No config.json or model.safetensors: an
  adapter is not a full model (``python -m finetune.merge`` makes one).

The adapter's ``base_model_name_or_path`` names the base as the user gave it: a Hub id or a preset
name as is, a local folder as its absolute path (a finished full run: its ``final/``).
"""

from __future__ import annotations

import logging
from pathlib import Path

import torch

from chat.adapters import FINGERPRINT_KEY, LORA_TARGETS, adapter_config, base_of, is_adapter_dir, model_fingerprint
from chat.model import MODEL_PRESETS, ModelLoadError
from finetune.checkpoint import TrainingError
from finetune.lora_layer import fuse

log = logging.getLogger(__name__)

LORA_FLAGS = {"lora_r": "r", "lora_alpha": "lora_alpha", "lora_dropout": "lora_dropout"}  # flag: peft's key


def continued_settings(cfg) -> dict:
    """The --lora_* values of the finished adapter in ``cfg.model_name_or_path``: continuing an
    adapter trains it as it is (its rank, alpha, dropout and modules). A value given that is not
    the default and not the adapter's own is a ValueError (the run would not do what it says)."""
    from finetune.config import FIELD_DEFAULTS, module_names

    folder = cfg.model_name_or_path
    config = adapter_config(folder)
    if config.get("peft_type") != "LORA":
        raise ValueError(f"{folder} holds a {config.get('peft_type')} adapter; only LoRA adapters are trained here")
    targets = config.get("target_modules")
    if not isinstance(targets, list):  # a regular expression (an adapter made elsewhere)
        raise ValueError(f"{folder}: the adapter's target_modules {targets!r} is not a list of module names")
    own = {flag: config.get(key) for flag, key in LORA_FLAGS.items()}
    # peft keeps the names as a set: in LORA_TARGETS' order (module_names names any unknown one)
    given = module_names(targets)
    own["lora_target_modules"] = tuple(name for name in LORA_TARGETS if name in given)
    for name, value in own.items():
        asked = getattr(cfg, name)
        same = set(asked) == set(value) if name == "lora_target_modules" else asked == value
        if not same and asked != FIELD_DEFAULTS[name]:
            raise ValueError(
                f"--{name} {asked!r} differs from the adapter's own {value!r} in {folder}: continuing an adapter "
                "trains it as it is (drop the flag, or start a new adapter on its base)"
            )
    return own


def prepare(cfg) -> str:
    """The model a run loads (the base, for a LoRA run). A finished adapter run's folder as the
    model makes ``cfg`` a LoRA run with that adapter's own settings (``continued``): it is trained
    further, on its own base. ModelLoadError when it cannot be continued as asked."""
    if is_adapter_dir(cfg.model_name_or_path):
        try:
            continued(cfg)
        except ValueError as err:
            raise ModelLoadError(str(err)) from None
    return base_model(cfg) if cfg.adapter == "lora" else cfg.model_name_or_path


def continued(cfg) -> None:
    """Set ``cfg`` to continue the finished adapter in ``cfg.model_name_or_path`` (``continued_settings``)."""
    settings = continued_settings(cfg)
    cfg.adapter = "lora"
    for name, value in settings.items():
        setattr(cfg, name, value)


def base_model(cfg) -> str:
    """The base model a LoRA run loads, named as its adapter will name it: a finished adapter's
    own base when continuing it, else the model given (a local folder as its absolute path)."""
    name = cfg.model_name_or_path
    if is_adapter_dir(name):
        return base_of(name)[0]
    if name not in MODEL_PRESETS and Path(name).exists():
        return str(Path(name).resolve())
    return name


def fingerprint_of(model: torch.nn.Module) -> str:
    """``chat.adapters.model_fingerprint`` of a loaded base; under ZeRO-3 (weights partitioned as
    they loaded) the embedding is gathered first, on every rank (a collective)."""
    weight = model.get_input_embeddings().weight
    if hasattr(weight, "ds_id"):
        import deepspeed

        with deepspeed.zero.GatheredParameters([weight]):
            return model_fingerprint(model)
    return model_fingerprint(model)


def lora_config(cfg):
    from peft import LoraConfig, TaskType

    return LoraConfig(
        task_type=TaskType.SEQ_2_SEQ_LM,
        r=cfg.lora_r,
        lora_alpha=cfg.lora_alpha,
        lora_dropout=cfg.lora_dropout,
        target_modules=list(cfg.lora_target_modules),
    )


def wrap(model: torch.nn.Module, cfg, base: str):
    """The loaded base ``model`` (named ``base``) with a trainable LoRA adapter: a new one, or the
    finished adapter in ``cfg.model_name_or_path`` when continuing it (after checking that its base
    is the one it was trained on). The returned peft model carries ``base_fingerprint``."""
    from peft import PeftModel, get_peft_model

    found = fingerprint_of(model)
    folder = cfg.model_name_or_path
    if is_adapter_dir(folder):
        recorded = base_of(folder)[1]
        if recorded is not None and recorded != found:
            raise ModelLoadError(
                f"the adapter in {folder} was trained on a base {base} with fingerprint {recorded}, but {base} "
                f"now has {found}: it changed since (a new Hub revision, a retrained folder). Train a new adapter."
            )
        model = PeftModel.from_pretrained(model, folder, is_trainable=True)
        log.info(f"continuing the LoRA adapter in {folder} on its base {base}")
    else:
        model = get_peft_model(model, lora_config(cfg))
    model.peft_config["default"].base_model_name_or_path = base
    model.base_fingerprint = found
    if cfg.lora_fused:
        fuse(model)  # same results as peft's layers, without their copies (finetune/lora_layer.py)
    trainable, total = model.get_nb_trainable_parameters()
    log.info(f"LoRA on {base}: {trainable:,} trainable of {total:,} parameters ({100 * trainable / total:.2f}%)")
    return model


# --------------------------------------------------------------------------- checkpoints


def frozen_left_out(cfg, zero_stage: int | None) -> bool:
    """Do this run's checkpoints leave the frozen base out? Under DeepSpeed below ZeRO-3 (ZeRO-3
    partitions every weight into its own files; other launches save what accelerate saves)."""
    return cfg.adapter == "lora" and zero_stage is not None and zero_stage < 3


def save_kwargs(cfg, zero_stage: int | None) -> dict:
    """``accelerator.save_state`` options: a LoRA checkpoint without the frozen base weights."""
    return {"exclude_frozen_parameters": True} if frozen_left_out(cfg, zero_stage) else {}


def load_kwargs(cfg, zero_stage: int | None) -> dict:
    """``accelerator.load_state`` options matching ``save_kwargs``: the checkpoint's weights are
    loaded into the model, and every trainable weight must be among them."""
    return {"custom_load_fn": load_trainable} if frozen_left_out(cfg, zero_stage) else {}


def load_trainable(src: dict, dst: torch.nn.Module) -> None:
    """DeepSpeed's ``custom_load_fn``: load a checkpoint that holds the trainable weights only."""
    result = dst.load_state_dict(src, strict=False)
    trainable = {name for name, p in dst.named_parameters() if p.requires_grad}
    missing = sorted(trainable & set(result.missing_keys))
    if missing or result.unexpected_keys:
        raise TrainingError(
            f"the checkpoint does not match this LoRA model: missing {missing[:3]}, unexpected "
            f"{list(result.unexpected_keys)[:3]} (was it saved by another run?)"
        )


def checkpoint_state(model) -> dict:
    """What trainer_state.json records about the base (checked by ``check_resume``)."""
    found = getattr(model, "base_fingerprint", None)
    return {FINGERPRINT_KEY: found} if found else {}


def check_resume(state: dict, model, path: Path) -> None:
    """A checkpoint without the frozen base resumes only onto the base it was trained on."""
    recorded, found = state.get(FINGERPRINT_KEY), getattr(model, "base_fingerprint", None)
    if recorded and found and recorded != found:
        raise TrainingError(
            f"checkpoint {path} was trained on a base with fingerprint {recorded}; the base loaded now has "
            f"{found} (it changed since): resume is not possible, start a new run",
            file=str(path),
        )


# --------------------------------------------------------------------------- the final adapter


def final_args(unwrapped) -> tuple[dict, str]:
    """(what an adapter's training_args.json adds to the run's config, the base the adapter names)."""
    return {FINGERPRINT_KEY: unwrapped.base_fingerprint}, unwrapped.peft_config["default"].base_model_name_or_path
