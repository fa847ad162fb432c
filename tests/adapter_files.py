"""Real LoRA adapters for the serving tests, made with peft itself in the layout training writes.

An adapter run's ``final/`` (see chat/adapters.py): peft's ``save_pretrained`` files
(adapter_config.json naming the base, adapter_model.safetensors), the tokenizer and a
training_args.json with ``adapter: "lora"``, the input format and the base's fingerprint.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from peft import LoraConfig, get_peft_model

from chat.adapters import FINGERPRINT_KEY, LORA_TARGETS, model_fingerprint
from chat.layout import FINAL
from chat.model import load_model, load_tokenizer


def make_adapter(
    base: str | Path,
    run_dir: Path,
    seed: int = 0,
    r: int = 4,
    base_name: str | None = None,
    fingerprint: bool = True,
    targets: tuple[str, ...] = LORA_TARGETS,
    scale: float = 1.0,
    prefix: str = "chatbot: ",
    dropout: float = 0.05,
    dora: bool = False,
) -> Path:
    """A LoRA adapter of ``base`` in ``run_dir/final`` (returned). Its A and B are random, not
    zero (peft's ``init_lora_weights=False``; B scaled by ``scale``), so it changes the replies:
    each ``seed`` gives another adapter. ``base_name`` is what adapter_config.json names as the
    base (default: ``base`` as given); ``fingerprint`` records the base's in training_args.json.
    ``dropout`` is training's default: LoRA dropout must do nothing when the adapter serves.
    ``dora``: a DoRA adapter (peft's ``use_dora``), which only peft's own forward serves."""
    torch.manual_seed(seed)
    model = load_model(str(base))
    recorded = model_fingerprint(model)
    config = LoraConfig(
        r=r,
        lora_alpha=2 * r,
        lora_dropout=dropout,
        target_modules=list(targets),
        init_lora_weights=False,
        use_dora=dora,
    )
    peft_model = get_peft_model(model, config)
    with torch.no_grad():
        for name, param in peft_model.named_parameters():
            if ".lora_B." in name:
                param.mul_(scale)
    peft_model.peft_config["default"].base_model_name_or_path = str(base_name or base)
    final = run_dir / FINAL
    peft_model.save_pretrained(final, save_embedding_layers=False)  # (no Hub lookup of the base's vocabulary)
    load_tokenizer(str(base)).save_pretrained(final)
    args = {
        "model_name_or_path": str(base_name or base),
        "adapter": "lora",
        "lora_r": r,
        "lora_alpha": 2 * r,
        "lora_dropout": dropout,
        "lora_target_modules": list(targets),
        "source_prefix": prefix,
        "max_source_length": 128,
        "max_target_length": 64,
    }
    if fingerprint:
        args[FINGERPRINT_KEY] = recorded
    (final / "training_args.json").write_text(json.dumps(args, indent=2))
    return final
