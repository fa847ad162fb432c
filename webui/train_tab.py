"""The Train tab: log in, describe a run, start / stop / resume / push it, and watch it live.

Layout and wiring only; what the controls do is in ``webui.train_handlers`` (each handler
checks the login itself) and the runs themselves are ``finetune.jobs``'s. The form's components
are named after the training settings they set (``train_handlers.FORM_FIELDS``) and reach the
handlers by those names, so the layout is free to arrange them.
"""

from __future__ import annotations

from dataclasses import dataclass

import gradio as gr

from webui import auth
from webui import train_handlers as handlers
from webui.train_handlers import TrainTab

PRIVATE = {"api_visibility": "private"}  # not a security boundary: every handler checks the login

INTRO = """### Train a model
Fine-tune a BlenderBot on the sample, a Hub dataset or your own file. **Start** runs `accelerate launch … -m finetune`
in the background, exactly the command **Show command** prints (the README's **Train** section explains it).
One run at a time; it keeps going when this page closes, and everyone who opens the app sees it. A finished run
appears in the Chat tab's **Model** list."""


@dataclass
class TrainParts:
    """What app.py wires to the page: the login line, the live view's outputs and triggers."""

    auth: gr.Markdown
    cache: gr.State  # what this page shows, so a redraw sends only changes
    timer: gr.Timer
    actions: list  # start / stop / resume / push events: redraw as soon as one succeeds
    live: list  # run text, loss plot, BLEU plot, samples, log tail, base-model dropdown (live_view's order)


def build(train: TrainTab, session: gr.BrowserState) -> TrainParts:
    """The tab's components and events (call inside ``gr.Tab``); returns the parts that app.py
    wires to the chat tab and the page: live outputs, timer, action events."""

    defaults = handlers.default_form(train)
    uploads = gr.State(handlers.Uploads())  # validated copies' paths, server-side
    cache = gr.State(None)  # what this page shows, to send only changes

    gr.Markdown(INTRO)
    auth_md = gr.Markdown(auth.login_markdown(train.auth, None), elem_id="train-auth")
    with gr.Row(visible=bool(train.auth.password)):
        password = gr.Textbox(
            type="password",
            label="Password",
            placeholder="TRAIN_PASSWORD",
            scale=3,
            max_length=auth.MAX_PASSWORD_CHARS,
            elem_id="train-password",
        )
        login = gr.Button("Log in", scale=1, elem_id="train-login")
        logout = gr.Button("Log out", scale=1)
    if train.auth.oauth:
        gr.LoginButton()
    gr.Markdown(handlers.hardware_note(train.gpus))

    form = {}  # FORM_FIELDS name -> component
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
            )
            form["data_source"] = gr.Radio(
                handlers.DATA_SOURCES, value=defaults["data_source"], label="Data", elem_id="train-data"
            )
            form["hub_dataset"] = gr.Textbox(
                defaults["hub_dataset"],
                label="Hub dataset id",
                max_length=200,
                visible=False,
                info="train/validation splits, texts/labels columns",
            )
        with gr.Row(visible=False) as upload_row:
            train_file = gr.File(
                label="Training file (.jsonl/.json/.csv/.parquet)", file_types=list(handlers.UPLOAD_TYPES)
            )
            val_file = gr.File(
                label="Validation file (optional: else the last 10% of the training rows)",
                file_types=list(handlers.UPLOAD_TYPES),
            )
        preview = gr.Markdown()
        with gr.Row():
            form["n_train"] = gr.Number(
                defaults["n_train"], precision=0, minimum=0, label="Train rows (0 = all)", elem_id="train-n-train"
            )
            form["n_val"] = gr.Number(
                defaults["n_val"], precision=0, minimum=0, label="Validation rows (0 = all)", elem_id="train-n-val"
            )
            form["num_train_epochs"] = gr.Number(
                defaults["num_train_epochs"], precision=0, minimum=1, label="Epochs", elem_id="train-epochs"
            )
            form["learning_rate"] = gr.Number(defaults["learning_rate"], minimum=0, label="Learning rate")
        with gr.Row():
            form["per_device_train_batch_size"] = gr.Number(
                defaults["per_device_train_batch_size"],
                precision=0,
                minimum=1,
                label="Train batch (per device)",
                elem_id="train-batch",
            )
            form["per_device_eval_batch_size"] = gr.Number(
                defaults["per_device_eval_batch_size"], precision=0, minimum=1, label="Eval batch (per device)"
            )
            form["max_source_length"] = gr.Number(
                defaults["max_source_length"], precision=0, minimum=1, label="Max source tokens"
            )
            form["max_target_length"] = gr.Number(
                defaults["max_target_length"], precision=0, minimum=1, label="Max target tokens"
            )
            form["source_prefix"] = gr.Textbox(defaults["source_prefix"], label="Source prefix", max_length=100)
        with gr.Row():
            form["strategy"] = gr.Radio(
                handlers.STRATEGY_CHOICES,
                value=defaults["strategy"],
                label="Strategy",
                info="On the CPU: ZeRO-2 on 2 processes",
            )
            form["precision"] = gr.Radio(
                handlers.PRECISION_CHOICES,
                value=defaults["precision"],
                label="Precision",
                info="GPU only; the CPU trains in fp32",
            )
            if train.gpus:
                form["num_gpus"] = gr.Slider(0, train.gpus, value=defaults["num_gpus"], step=1, label="GPUs (0: CPU)")
            else:
                form["num_gpus"] = gr.Number(
                    defaults["num_gpus"], precision=0, interactive=False, label="GPUs", info="none detected: the CPU"
                )
        with gr.Row():
            form["checkpointing_steps"] = gr.Number(
                defaults["checkpointing_steps"],
                precision=0,
                minimum=0,
                label="Checkpoint every N steps (0 = each epoch)",
            )
            form["logging_steps"] = gr.Number(
                defaults["logging_steps"],
                precision=0,
                minimum=1,
                label="Log loss every N steps",
                elem_id="train-logging",
            )
            form["num_beams"] = gr.Number(
                defaults["num_beams"], precision=0, minimum=1, label="Eval beams", elem_id="train-beams"
            )
        with gr.Row():
            form["push_to_hub"] = gr.Checkbox(defaults["push_to_hub"], label="Push to the Hub when done")
            form["hub_model_id"] = gr.Textbox(
                defaults["hub_model_id"], label="Hub repo id", placeholder="user/my-chat-e", max_length=200
            )
            form["hub_private"] = gr.Checkbox(defaults["hub_private"], label="Private repo")
    form_inputs = handlers.form_inputs(form)  # passed by name (inputs_kwargs), in FORM_FIELDS order for API clients

    with gr.Row():
        start = gr.Button("Start", variant="primary", elem_id="train-start")
        stop = gr.Button("Stop", variant="stop", elem_id="train-stop")
        resume = gr.Button("Resume", elem_id="train-resume")
        show = gr.Button("Show command", elem_id="train-show-command")
    action = gr.Markdown(elem_id="train-action")
    command = gr.Code(
        language="shell", label="Command", interactive=False, lines=2, max_lines=8, elem_id="train-command"
    )
    run = gr.Markdown(elem_id="train-run")
    with gr.Row():
        loss = gr.LinePlot(
            handlers.loss_frame(handlers.RunStatus()), x="step", y="loss", title="Training loss", elem_id="train-loss"
        )
        bleu = gr.LinePlot(
            handlers.bleu_frame(handlers.RunStatus()), x="step", y="bleu", title="Validation BLEU", elem_id="train-bleu"
        )
    samples = gr.Dataframe(
        handlers.samples_frame(handlers.RunStatus()),
        label="Sample replies (validation)",
        interactive=False,
        wrap=True,
        column_widths=["50%", "25%", "25%"],
        elem_id="train-samples",
    )
    log_tail = gr.Textbox(
        label="Log (last lines)", lines=12, max_lines=12, interactive=False, autoscroll=True, elem_id="train-log"
    )
    with gr.Row():
        push_repo = gr.Textbox(label="Push the finished run to", placeholder="user/my-chat-e", max_length=200, scale=3)
        push_private = gr.Checkbox(False, label="Private repo", scale=1)
        push = gr.Button("Push to Hub", scale=1, elem_id="train-push")
    timer = gr.Timer(handlers.TICK_SECONDS, active=False)  # ticks only while the tab is shown (app.py)

    # ---- events: each handler checks the login itself (train_handlers / webui.auth)
    def do_login(token, typed, request: gr.Request):
        with handlers.explained("log in"):
            token, message = auth.login(train.auth, typed, train.auth.client(request))
        gr.Info(message)
        return token, auth.login_markdown(train.auth, token), ""

    def do_logout(token):
        auth.logout(train.auth, token)
        return None, auth.login_markdown(train.auth, None)

    def upload(which):
        def handler(token: str | None, profile: gr.OAuthProfile | None, current, file, prefix):
            return handlers.accept_upload(train, token, profile, current, which, file, prefix)

        return handler

    def do_start(token: str | None, profile: gr.OAuthProfile | None, current, **values):
        return handlers.start_run(train, token, profile, current, values)

    def do_show(current, **values):
        return handlers.show_command(train, current, values)

    def do_stop(token: str | None, profile: gr.OAuthProfile | None):
        return handlers.stop_run(train, token, profile)

    def do_resume(token: str | None, profile: gr.OAuthProfile | None):
        return handlers.resume_run(train, token, profile)

    def do_push(token: str | None, profile: gr.OAuthProfile | None, repo, is_private):
        return handlers.push_run(train, token, profile, repo, is_private)

    one_at_a_time = {"concurrency_limit": 1, "concurrency_id": "train"}
    for trigger in (login.click, password.submit):
        # Not queued: a flood of wrong passwords takes no place in the queue that chat replies use,
        # and a refused login returns at once (auth.Throttle), holding nothing.
        trigger(
            do_login, [session, password], [session, auth_md, password], api_name="train_login", queue=False, **PRIVATE
        )
    logout.click(do_logout, session, [session, auth_md], api_name="train_logout", queue=False, **PRIVATE)
    for file, which in ((train_file, "train"), (val_file, "validation")):
        for trigger in (file.upload, file.clear):
            trigger(
                upload(which),
                [session, uploads, file, form["source_prefix"]],
                [uploads, preview],
                api_name=f"train_upload_{which}",
                **one_at_a_time,
                **PRIVATE,
            )
    actions = [
        start.click(
            do_start,
            [session, uploads],
            action,
            inputs_kwargs=form_inputs,
            api_name="train_start",
            **one_at_a_time,
            **PRIVATE,
        ),
        stop.click(do_stop, session, action, api_name="train_stop", **one_at_a_time, **PRIVATE),
        resume.click(do_resume, session, action, api_name="train_resume", **one_at_a_time, **PRIVATE),
        push.click(
            do_push, [session, push_repo, push_private], action, api_name="train_push", **one_at_a_time, **PRIVATE
        ),
    ]
    show.click(do_show, uploads, command, inputs_kwargs=form_inputs, api_name="train_command", queue=False, **PRIVATE)
    form["data_source"].change(
        lambda source: (gr.update(visible=source == "hub"), gr.update(visible=source == "upload")),
        form["data_source"],
        [form["hub_dataset"], upload_row],
        queue=False,
        **PRIVATE,
    )
    form["model_name_or_path"].input(
        handlers.learning_rate_for, form["model_name_or_path"], form["learning_rate"], queue=False, **PRIVATE
    )
    return TrainParts(
        auth=auth_md,
        cache=cache,
        timer=timer,
        actions=actions,
        live=[run, loss, bleu, samples, log_tail, form["model_name_or_path"]],
    )
