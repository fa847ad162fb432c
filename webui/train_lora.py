"""The Train tab's choice of what to train: every weight, or a LoRA adapter (rank, alpha, modules).

A piece of the form (``build``, placed by ``webui.train_tab``) and the plain function that turns its
values into TrainConfig's adapter settings (``settings``, used by ``webui.train_handlers``). A
finished adapter run chosen as the base model is trained further as it is: its own rank, alpha and
modules (finetune.jobs.spec), whatever these fields say.
"""

from __future__ import annotations

from collections.abc import Mapping

import gradio as gr

from chat.adapters import LORA_TARGETS, is_adapter_dir
from finetune.jobs.spec import checked_model

# The form's fields, TrainConfig's names (webui.train_handlers.FORM_FIELDS includes them).
FIELDS = ("adapter", "lora_r", "lora_alpha", "lora_target_modules")
ADAPTER_CHOICES = [("Full fine-tuning (every weight)", "none"), ("LoRA adapter (base frozen)", "lora")]
MODULE_CHOICES = [
    ("attention q", "q_proj"),
    ("attention k", "k_proj"),
    ("attention v", "v_proj"),
    ("attention out", "out_proj"),
    ("feed-forward in", "fc1"),
    ("feed-forward out", "fc2"),
]
assert [value for _, value in MODULE_CHOICES] == list(LORA_TARGETS)
PRIVATE = {"api_visibility": "private"}


def build(defaults: Mapping, locked: dict) -> dict:
    """The fields (call inside the form's layout); returns them by FIELDS name. The LoRA settings
    show only while LoRA is chosen (hidden, they keep their values)."""
    with gr.Row():  # its own line: a phone keeps each choice's words on one line
        adapter = gr.Radio(
            ADAPTER_CHOICES,
            value=defaults["adapter"],
            label="What to train",
            info="LoRA: a small adapter (megabytes) on a frozen base; faster, less memory, many bots on one base",
            elem_id="train-adapter",
            **locked,
        )
    with gr.Column(visible=defaults["adapter"] == "lora", elem_id="train-lora") as box:
        with gr.Row(elem_classes="train-pair"):
            rank = gr.Number(
                defaults["lora_r"], precision=0, minimum=1, label="LoRA rank r", elem_id="train-lora-r", **locked
            )
            alpha = gr.Number(
                defaults["lora_alpha"],
                precision=0,
                minimum=1,
                label="LoRA alpha (× alpha / r)",
                elem_id="train-lora-alpha",
                **locked,
            )
        modules = gr.CheckboxGroup(
            MODULE_CHOICES,
            value=list(defaults["lora_target_modules"]),
            label="LoRA on (encoder and decoder)",
            elem_id="train-lora-modules",
            **locked,
        )
    adapter.change(lambda kind: gr.update(visible=kind == "lora"), adapter, box, queue=False, **PRIVATE)
    return {"adapter": adapter, "lora_r": rank, "lora_alpha": alpha, "lora_target_modules": modules}


def settings(values: Mapping) -> dict:
    """TrainConfig's adapter settings of the form's ``values``: none for full fine-tuning (the
    fields keep their values for the next LoRA run, unused), and none for a finished adapter run as
    the base (JobSpec gives it its own)."""
    if continues_adapter(values.get("model_name_or_path")):
        return {}
    if values["adapter"] != "lora":
        if values["adapter"] != "none":
            raise ValueError(f"what to train must be 'none' or 'lora', got {values['adapter']!r}")
        return {}
    modules = values["lora_target_modules"]
    if not modules:
        raise ValueError("pick at least one module for LoRA (attention q/k/v/out, feed-forward in/out)")
    return {
        "adapter": "lora",
        "lora_r": values["lora_r"],
        "lora_alpha": values["lora_alpha"],
        "lora_target_modules": list(modules) if isinstance(modules, (list, tuple)) else modules,
    }


def continues_adapter(model: str | None) -> bool:
    """Is the base model a finished adapter run (an allowed folder: checked before it is looked at)?"""
    try:
        return is_adapter_dir(checked_model(model or ""))
    except ValueError:  # not an allowed model at all: JobSpec says why
        return False
