"""LoRA adapters: what an adapter folder is, which of BlenderBot's modules an adapter wraps, and
how the base model an adapter was trained on is recognised.

An adapter run's ``final/`` keeps peft's own layout, so ``peft.PeftModel.from_pretrained(base,
"RUN/final")`` loads it anywhere: ``adapter_config.json`` (``base_model_name_or_path`` names the
base) and ``adapter_model.safetensors``, plus the tokenizer, ``training_args.json`` (how it was
trained, with ``adapter`` and the base's fingerprint) and a model card. Training (``finetune``)
writes these folders and the chat serves them; this module holds the facts both sides share.

A base is recognised by its name and by a fingerprint of its token embeddings: two checkpoints
of one architecture (the base and a full fine-tune of it, say) have the same parameter names and
shapes, so an adapter would load onto either without an error and serve nonsense on the wrong one.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import torch
from peft.utils import CONFIG_NAME, SAFETENSORS_WEIGHTS_NAME

from chat.layout import TRAINING_ARGS_FILE

ADAPTER_CONFIG = CONFIG_NAME  # "adapter_config.json", peft's name
ADAPTER_WEIGHTS = SAFETENSORS_WEIGHTS_NAME  # "adapter_model.safetensors", peft's name
ADAPTER_KINDS = ("none", "lora")  # --adapter: none = full fine-tuning
# BlenderBot's attention (q/k/v/out, self- and cross-attention) and feed-forward (fc1/fc2)
# projections, in the encoder and the decoder. peft has no default for BlenderBot: name them.
LORA_TARGETS = ("q_proj", "k_proj", "v_proj", "out_proj", "fc1", "fc2")
FINGERPRINT_KEY = "base_fingerprint"  # in training_args.json of an adapter run


def is_adapter_dir(path: str | Path) -> bool:
    """Does ``path`` hold a peft adapter (config and safetensors weights)?"""
    path = Path(path)
    return (path / ADAPTER_CONFIG).is_file() and (path / ADAPTER_WEIGHTS).is_file()


def adapter_config(path: str | Path) -> dict:
    """The adapter's ``adapter_config.json`` as a dict (ValueError naming the file if unreadable)."""
    file = Path(path) / ADAPTER_CONFIG
    try:
        config = json.loads(file.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as err:
        raise ValueError(f"{file}: unreadable adapter config ({err})") from None
    if not isinstance(config, dict):
        raise ValueError(f"{file}: not a JSON object")
    return config


def fingerprint(embedding: torch.Tensor) -> str:
    """A short, stable id of a base model: sha256 of its token-embedding matrix in fp32.

    The embeddings are what every adapter's input goes through first and differ between any two
    trained checkpoints; reading 41 MB (the 400M model's 8,008 x 1,280) takes tens of milliseconds.
    Take it before a model is cast (bf16) or quantized: it must not depend on how a base serves."""
    data = embedding.detach().to("cpu", torch.float32).contiguous()
    digest = hashlib.sha256(str(tuple(data.shape)).encode())
    digest.update(data.numpy().tobytes())
    return digest.hexdigest()[:16]


def model_fingerprint(model: torch.nn.Module) -> str:
    """``fingerprint`` of a loaded (unwrapped, un-partitioned) model's input embeddings."""
    return fingerprint(model.get_input_embeddings().weight)


def base_of(path: str | Path) -> tuple[str, str | None]:
    """The base model an adapter folder was trained on: (name, fingerprint or None).

    The name is peft's ``base_model_name_or_path`` (a Hub id, a preset such as ``tiny``, or a
    local folder); the fingerprint comes from ``training_args.json`` when the project trained it
    (an adapter from elsewhere has none, and is matched by name only)."""
    name = adapter_config(path).get("base_model_name_or_path")
    if not isinstance(name, str) or not name:
        raise ValueError(f"{Path(path) / ADAPTER_CONFIG}: no base_model_name_or_path")
    args_file = Path(path) / TRAINING_ARGS_FILE
    found = None
    if args_file.is_file():
        try:
            found = json.loads(args_file.read_text()).get(FINGERPRINT_KEY)
        except (OSError, UnicodeDecodeError, json.JSONDecodeError, AttributeError):
            found = None
    return name, found if isinstance(found, str) else None
