"""The Train tab's "New run" form: one section of ``webui.train_tab``'s layout (its events are wired
there). The components are named after the training settings they set (``train_handlers.FORM_FIELDS``)
and locked until a login (the tab's page-state event unlocks them)."""

from __future__ import annotations

from types import SimpleNamespace

import gradio as gr

from webui import train_handlers as handlers
from webui import train_lora, train_objective
from webui import train_preflight as preflight
from webui.train_handlers import TrainTab


def form_section(train: TrainTab, defaults: dict) -> SimpleNamespace:
    """ "New run": base model, data (sample, Hub, upload, feedback), rows, epochs, learning rate and
    "More settings"; the components in ``form`` by FORM_FIELDS name."""
    form = {}  # FORM_FIELDS name -> component
    # Locked (not interactive) until a login: the page-state event below unlocks them.
    locked = {"interactive": False}
    with gr.Accordion("New run", open=True):
        with gr.Row():
            form["model_name_or_path"] = gr.Dropdown(
                handlers.base_model_choices(train),
                value=defaults["model_name_or_path"],
                allow_custom_value=True,
                label="Base model",
                scale=2,
                elem_id="train-model",
                info="A preset, a Hub model id, or a finished run to continue from.",
                **locked,
            )
            form["data_source"] = gr.Radio(
                handlers.DATA_SOURCES, value=defaults["data_source"], label="Data", elem_id="train-data", **locked
            )
            form["hub_dataset"] = gr.Textbox(
                defaults["hub_dataset"],
                label="Hub dataset id",
                max_length=200,
                visible=False,
                info="train/validation splits, texts/labels columns",
                **locked,
            )
        form.update(train_lora.build(defaults, locked))  # full fine-tuning or a LoRA adapter
        objective, preference_counts = train_objective.build(defaults, locked)  # SFT, DPO or KTO
        form.update(objective)
        with gr.Row(elem_classes="train-pair"):
            form["use_feedback"] = gr.Checkbox(
                defaults["use_feedback"],
                label="Add accepted chat feedback",
                info="the rows accepted under Feedback from the chat (above), exported at Start",
                elem_id="train-feedback",
                **locked,
            )
            form["feedback_ratio"] = gr.Slider(
                0.05,
                1,
                value=defaults["feedback_ratio"],
                step=0.05,
                label="Share of feedback rows (1 = feedback only)",
                visible=False,
                elem_id="train-feedback-ratio",
                **locked,
            )
        # What the share makes of the accepted rows in an epoch (how many times each is repeated).
        mix = gr.Markdown(visible=defaults["use_feedback"], elem_id="train-feedback-mix")
        with gr.Row(visible=False) as upload_row:
            train_file = gr.File(
                label="Training file (.jsonl/.json/.csv/.parquet)",
                file_types=list(handlers.UPLOAD_TYPES),
                elem_id="train-file",
                **locked,
            )
            val_file = gr.File(
                label="Validation file (optional: else the last 10% of the training rows)",
                file_types=list(handlers.UPLOAD_TYPES),
                elem_id="train-val-file",
                **locked,
            )
        preview = gr.Markdown(elem_id="train-preview", visible=False)  # an upload's rows, or why it was refused
        with gr.Row(elem_classes="train-pair"):
            form["n_train"] = gr.Number(
                defaults["n_train"], precision=0, label="Train rows (0 = all)", elem_id="train-n-train", **locked
            )
            form["n_val"] = gr.Number(
                defaults["n_val"], precision=0, label="Validation rows (0 = all)", elem_id="train-n-val", **locked
            )
            form["num_train_epochs"] = gr.Number(
                defaults["num_train_epochs"], precision=0, label="Epochs", elem_id="train-epochs", **locked
            )
            form["learning_rate"] = gr.Number(defaults["learning_rate"], label="Learning rate", **locked)
        with gr.Accordion("More settings: batches, lengths, strategy, logging, Hub", open=False, elem_id="train-more"):
            with gr.Row(elem_classes="train-pair"):
                form["per_device_train_batch_size"] = gr.Textbox(
                    str(defaults["per_device_train_batch_size"]),
                    label=preflight.BATCH_LABEL,
                    info="a number, or auto: the largest that fits the GPU (8 on the CPU)",
                    max_length=12,
                    elem_id="train-batch",
                    **locked,
                )
                form["per_device_eval_batch_size"] = gr.Number(
                    defaults["per_device_eval_batch_size"], precision=0, label="Eval batch", **locked
                )
                form["max_source_length"] = gr.Number(
                    defaults["max_source_length"], precision=0, label="Max source tokens", **locked
                )
                form["max_target_length"] = gr.Number(
                    defaults["max_target_length"], precision=0, label="Max target tokens", **locked
                )
                form["source_prefix"] = gr.Textbox(
                    defaults["source_prefix"], label="Source prefix", max_length=100, **locked
                )
            with gr.Row():
                form["strategy"] = gr.Radio(
                    handlers.STRATEGY_CHOICES,
                    value=defaults["strategy"],
                    label="Strategy",
                    info="On the CPU: ZeRO-2 on 2 processes",
                    **locked,
                )
                form["precision"] = gr.Radio(
                    handlers.PRECISION_CHOICES,
                    value=defaults["precision"],
                    label="Precision",
                    info="GPU only; the CPU trains in fp32",
                    **locked,
                )
                if train.gpus:
                    form["num_gpus"] = gr.Slider(
                        0, train.gpus, value=defaults["num_gpus"], step=1, label="GPUs (0: CPU)", **locked
                    )
                else:  # nothing to choose: never unlocked
                    form["num_gpus"] = gr.Number(
                        defaults["num_gpus"],
                        precision=0,
                        interactive=False,
                        label="GPUs",
                        info="none detected: the CPU",
                    )
            with gr.Row(elem_classes="train-pair"):
                form["checkpointing_steps"] = gr.Number(
                    defaults["checkpointing_steps"],
                    precision=0,
                    label="Checkpoint every N steps (0 = each epoch)",
                    **locked,
                )
                form["logging_steps"] = gr.Number(
                    defaults["logging_steps"],
                    precision=0,
                    label="Log loss every N steps",
                    elem_id="train-logging",
                    **locked,
                )
                form["num_beams"] = gr.Number(
                    defaults["num_beams"], precision=0, label="Eval beams", elem_id="train-beams", **locked
                )
            with gr.Row(elem_classes="train-pair"):
                form["push_to_hub"] = gr.Checkbox(defaults["push_to_hub"], label="Push to the Hub when done", **locked)
                form["hub_model_id"] = gr.Textbox(
                    defaults["hub_model_id"],
                    label="Hub repo id",
                    placeholder="user/my-chat-e",
                    max_length=200,
                    **locked,
                )
                form["hub_private"] = gr.Checkbox(defaults["hub_private"], label="Private repo", **locked)
    form_inputs = handlers.form_inputs(form)  # passed by name (inputs_kwargs), in FORM_FIELDS order for API clients
    # The numbers have no gradio minimum: gradio's own check refused with "Value -1 is less than minimum
    # value 1." (no field named) and a traceback in the log. The run's spec checks every value and
    # its messages name the field as the form labels it (train_handlers.in_form_words).
    train.form_labels = {name: component.label for name, component in form.items()}
    return SimpleNamespace(
        form=form,
        form_inputs=form_inputs,
        train_file=train_file,
        val_file=val_file,
        upload_row=upload_row,
        preview=preview,
        mix=mix,
        objective=objective,
        preference_counts=preference_counts,
    )
