"""Chat-E: the persona-chat web app (``python app.py``; also a Hugging Face Space's app file).

Tabs: **Chat** (talk to the served checkpoint as a persona / emotion / task goal / topic / no
context, with presets, generation settings, a token meter and a model picker) and **Train**
(start, watch, stop, resume and push training runs: chat/train_ui.py over finetune/runner.py).
Public API: ``Client(url).predict(message, kind, context, api_name="/chat")`` (see README, "API").
Every other endpoint is private, and those that change something check the login themselves
(chat/auth.py: ``TRAIN_PASSWORD``, or Hugging Face OAuth on a Space with ``TRAIN_USERS``).

``build_demo(engine, train)`` builds the app around any ``ChatEngine`` and Train tab settings (the
tests pass the bundled demo model and their own runs root and login). ``python app.py`` starts the
engine (``CHAT_MODEL`` or the 400M base model; offline, the demo model) and serves on
GRADIO_SERVER_NAME / GRADIO_SERVER_PORT. Importing this module loads nothing: ``app.demo`` is
built on first access.
"""

import logging
import time

import gradio as gr

from chat import auth, train_ui, ui
from chat.engine import MAX_CONTEXT_CHARS, MAX_MESSAGE_CHARS, ChatEngine
from chat.prompt import EMOTIONS
from finetune.runner import MAX_UPLOAD_BYTES

log = logging.getLogger("app")

QUEUE_MAX_SIZE = 64
# Up to 8 replies run at once; the engine batches concurrent ones into one generate() call.
CONCURRENCY = 8
# gradio refuses bigger uploads before they reach a handler (the runner checks again before parsing).
LAUNCH_OPTIONS = {"max_file_size": MAX_UPLOAD_BYTES}

INTRO = """# Chat-E
Give the bot a **persona**, an **emotion**, a **task goal** or a **topic** (or nothing) and chat.
The model is a BlenderBot fine-tuned on MuDoConv; your messages are sent to it in exactly the format it was
trained on. Each browser tab is its own conversation."""

TRAIN_INTRO = """### Train a model
Fine-tune a BlenderBot on the sample, a Hub dataset or your own file. **Start** runs `accelerate launch … -m finetune`
in the background, exactly the command **Show command** prints (the README's **Train** section explains it).
One run at a time; it keeps going when this page closes, and everyone who opens the app sees it. A finished run
appears in the Chat tab's **Model** list."""


def build_demo(engine: ChatEngine, train: train_ui.TrainTab | None = None) -> gr.Blocks:
    """The whole app around ``engine`` (queue configured, not launched). ``train`` is the Train
    tab's runs root, login settings and hardware (default: from the environment)."""
    train = train or train_ui.TrainTab.create()
    runs = train.manager.root  # the chat's model picker lists the Train tab's finished runs
    choices = ui.model_choices(runs, current=engine.current.name)
    with gr.Blocks(title="Chat-E · persona-chat", analytics_enabled=False) as demo:
        # This session's login: kept on the server by gradio, never sent to or taken from the browser.
        session = gr.State(auth.Session())
        gr.Markdown(INTRO)
        status = gr.Markdown(ui.status_markdown(engine), elem_id="serving-status")
        with gr.Tabs():
            with gr.Tab("Chat"):
                with gr.Row():
                    with gr.Column(scale=1, min_width=300):
                        kind = gr.Radio(ui.KIND_CHOICES, value="persona", label="The bot has a…")
                        label, info = ui.CONTEXT_LABELS["persona"]
                        # The context string sent with every message. For emotions it is hidden and
                        # set from the dropdown below, so the chat always gets one string.
                        context = gr.Textbox(ui.CHAT_E_PERSONA, label=label, info=info, lines=2, max_lines=6,
                                             max_length=MAX_CONTEXT_CHARS)
                        emotion = gr.Dropdown(list(EMOTIONS), value=ui.KIND_DEFAULTS["emotion"],
                                              allow_custom_value=True, label="Emotion", visible=False,
                                              elem_id="context-emotion",
                                              info="One of the 32 emotions the model was trained on (or type one).")
                        preset = gr.Radio(ui.PRESET_CHOICES, value="fast", label="Preset")
                        beams0, sample0, temperature0, top_p0, max_new0 = ui.preset_values("fast")
                        with gr.Accordion("Generation settings", open=False):
                            beams = gr.Slider(1, 16, value=beams0, step=1, label="Beams",
                                              info="1 streams word by word; beam search answers at the end.")
                            sample = gr.Checkbox(value=sample0, label="Sampling")
                            temperature = gr.Slider(0.05, 2.0, value=temperature0, step=0.05,
                                                    label="Temperature (with sampling)")
                            top_p = gr.Slider(0.05, 1.0, value=top_p0, step=0.05, label="Top-p (with sampling)")
                            max_new_tokens = gr.Slider(1, 128, value=max_new0, step=1, label="Max new tokens")
                            seed = gr.Number(0, precision=0, minimum=0, maximum=ui.SEED_MAX, label="Seed (0 = random)")
                        meter = gr.Markdown(ui.meter_text(None))
                    with gr.Column(scale=3):
                        chat = gr.ChatInterface(
                            ui.chat_fn(engine),
                            chatbot=gr.Chatbot(label="Chat-E", height=460,
                                               placeholder="Pick who the bot is on the left, then say hi."),
                            textbox=gr.Textbox(placeholder="Type a message…", show_label=False,
                                               max_length=MAX_MESSAGE_CHARS, submit_btn=True, stop_btn=True,
                                               elem_id="chat-input"),
                            additional_inputs=[kind, context, preset, beams, sample, temperature, top_p,
                                               max_new_tokens, seed],
                            additional_outputs=[meter],
                            examples=ui.EXAMPLES,
                            cache_examples=False,  # Spaces would otherwise run every example at start-up
                            editable=True,
                            save_history=True,  # in the browser's local storage: stays with its user
                            fill_height=False,
                            # The UI's own endpoint (history kept in the session, returns reply and
                            # meter) is not public: the API is the stateless /chat below.
                            api_name="chat_ui",
                            api_visibility="private",
                        )
                with gr.Accordion("Model", open=False):
                    with gr.Row():
                        picker = gr.Dropdown(choices, value=ui.current_choice(engine, choices), label="Model",
                                             elem_id="model-picker",
                                             info="Base model, bundled demo model, and finished runs (newest first).",
                                             scale=3)
                        hub_id = gr.Textbox(label="…or a Hub model id", placeholder="user/my-blenderbot-chat", scale=2,
                                            max_length=200)
                    with gr.Row():
                        load = gr.Button("Load", variant="primary", elem_id="model-load")
                        refresh = gr.Button("Refresh")
                    gr.Markdown("Loading a model switches it for everyone using this app, so it needs the Train "
                                "tab's login; replies already being written finish on the old one. If loading "
                                "fails, the current model keeps serving.")
            with gr.Tab("Train"):
                tab = _train_tab(train, session)

        # Public API: Client(url).predict(message, kind, context, api_name="/chat") -> reply text.
        gr.api(ui.api_chat_fn(engine), api_name="chat")

        private = {"api_visibility": "private"}
        kind.change(ui.context_visibility, kind, [context, emotion], queue=False, **private)
        kind.input(ui.context_for_kind, [kind, context], context, queue=False, **private)
        emotion.input(lambda value: value or "", emotion, context, queue=False, **private)
        context.change(lambda k, c: gr.update(value=c) if k == "emotion" else gr.skip(), [kind, context], emotion,
                       queue=False, **private)
        preset.change(ui.preset_values, preset, [beams, sample, temperature, top_p, max_new_tokens], queue=False,
                      **private)

        def load_model(state: auth.Session, profile: gr.OAuthProfile | None, choice, hub):
            # Swapping the model changes it for everyone: a login is needed, checked here.
            with train_ui.explained("switch the served model"):
                auth.require(train.auth, state, profile, "switch the served model (it changes it for everyone)")
            yield from ui.load_model(engine, choice, hub, runs)

        load.click(load_model, [session, picker, hub_id], [status, picker], concurrency_limit=1, concurrency_id="load",
                   api_name="load_model", **private)
        refresh.click(lambda: ui.refresh_models(engine, runs), None, picker, api_name="refresh_models", queue=False,
                      **private)

        # The Train tab's live view: from the run directory, so every page shows the same run.
        def redraw(cache):
            return train_ui.live_view(train, cache, (lambda: train_ui.model_list_update(train),
                                                     lambda: ui.refresh_models(engine, runs)))

        live = [tab["cache"], tab["run"], tab["loss"], tab["bleu"], tab["samples"], tab["log"], tab["model"], picker]
        tab["timer"].tick(redraw, tab["cache"], live, queue=False, show_progress="hidden", **private)
        for event in tab["actions"]:  # show what an action did at once, not at the next tick
            event.success(redraw, tab["cache"], live, queue=False, show_progress="hidden", **private)

        def on_page_load(state: auth.Session, profile: gr.OAuthProfile | None):
            # The model is shared: show what is serving now whenever a page opens (the picker is
            # refreshed by the redraw), and re-attach to the latest run.
            return ui.status_markdown(engine), auth.status_markdown(train.auth, state, profile), *redraw(None)

        demo.load(on_page_load, session, [status, tab["auth"], *live], queue=False, **private)
    demo.queue(max_size=QUEUE_MAX_SIZE, default_concurrency_limit=CONCURRENCY)
    demo.chat_interface = chat  # for tests and for code that wires more events to the chat
    return demo


def _train_tab(train: train_ui.TrainTab, session: gr.State) -> dict:
    """The Train tab's components and events (inside ``gr.Tab``); returns the parts that
    build_demo wires to the chat tab and the page: live outputs, timer, action events."""
    private = {"api_visibility": "private"}  # not a security boundary: every handler checks the login
    defaults = train_ui.default_form(train)
    uploads = gr.State(train_ui.Uploads())  # validated copies' paths, server-side
    cache = gr.State(None)  # what this page shows, to send only changes

    gr.Markdown(TRAIN_INTRO)
    auth_md = gr.Markdown(auth.status_markdown(train.auth, None), elem_id="train-auth")
    with gr.Row(visible=bool(train.auth.password)):
        password = gr.Textbox(type="password", label="Password", placeholder="TRAIN_PASSWORD", scale=3,
                              max_length=auth.MAX_PASSWORD_CHARS, elem_id="train-password")
        login = gr.Button("Log in", scale=1, elem_id="train-login")
        logout = gr.Button("Log out", scale=1)
    if train.auth.oauth:
        gr.LoginButton()
    gr.Markdown(train_ui.hardware_note(train.gpus))

    form = {}
    with gr.Accordion("New run", open=True):
        with gr.Row():
            form["model"] = gr.Dropdown(train_ui.model_choices(train), value=defaults["model"], allow_custom_value=True,
                                        label="Base model", scale=2, elem_id="train-model",
                                        info="A preset, a Hub model id, or a finished run to continue from.")
            form["data_source"] = gr.Radio(train_ui.DATA_SOURCES, value=defaults["data_source"], label="Data",
                                           elem_id="train-data")
            form["hub_dataset"] = gr.Textbox(defaults["hub_dataset"], label="Hub dataset id", max_length=200,
                                             visible=False, info="train/validation splits, texts/labels columns")
        with gr.Row(visible=False) as upload_row:
            train_file = gr.File(label="Training file (.jsonl/.json/.csv/.parquet)",
                                 file_types=list(train_ui.UPLOAD_TYPES))
            val_file = gr.File(label="Validation file (optional: else the last 10% of the training rows)",
                               file_types=list(train_ui.UPLOAD_TYPES))
        preview = gr.Markdown()
        with gr.Row():
            form["n_train"] = gr.Number(None, precision=0, minimum=0, label="Train rows (0 = all)",
                                        elem_id="train-n-train")
            form["n_val"] = gr.Number(None, precision=0, minimum=0, label="Validation rows (0 = all)",
                                      elem_id="train-n-val")
            form["epochs"] = gr.Number(defaults["epochs"], precision=0, minimum=1, label="Epochs",
                                       elem_id="train-epochs")
            form["learning_rate"] = gr.Number(defaults["learning_rate"], minimum=0, label="Learning rate")
        with gr.Row():
            form["train_batch_size"] = gr.Number(defaults["train_batch_size"], precision=0, minimum=1,
                                                 label="Train batch (per device)", elem_id="train-batch")
            form["eval_batch_size"] = gr.Number(defaults["eval_batch_size"], precision=0, minimum=1,
                                                label="Eval batch (per device)")
            form["max_source_length"] = gr.Number(defaults["max_source_length"], precision=0, minimum=1,
                                                  label="Max source tokens")
            form["max_target_length"] = gr.Number(defaults["max_target_length"], precision=0, minimum=1,
                                                  label="Max target tokens")
            form["source_prefix"] = gr.Textbox(defaults["source_prefix"], label="Source prefix", max_length=100)
        with gr.Row():
            form["strategy"] = gr.Radio(train_ui.STRATEGY_CHOICES, value=defaults["strategy"], label="Strategy",
                                        info="On the CPU: ZeRO-2 on 2 processes")
            form["precision"] = gr.Radio(train_ui.PRECISION_CHOICES, value=defaults["precision"], label="Precision",
                                         info="GPU only; the CPU trains in fp32")
            if train.gpus:
                form["num_gpus"] = gr.Slider(0, train.gpus, value=train.gpus, step=1, label="GPUs (0: CPU)")
            else:
                form["num_gpus"] = gr.Number(0, precision=0, interactive=False, label="GPUs",
                                             info="none detected: the CPU")
        with gr.Row():
            form["checkpointing_steps"] = gr.Number(None, precision=0, minimum=0,
                                                    label="Checkpoint every N steps (0 = each epoch)")
            form["logging_steps"] = gr.Number(defaults["logging_steps"], precision=0, minimum=1,
                                              label="Log loss every N steps", elem_id="train-logging")
            form["num_beams"] = gr.Number(defaults["num_beams"], precision=0, minimum=1, label="Eval beams",
                                          elem_id="train-beams")
        with gr.Row():
            form["push_to_hub"] = gr.Checkbox(False, label="Push to the Hub when done")
            form["hub_model_id"] = gr.Textbox(label="Hub repo id", placeholder="user/my-chat-e", max_length=200)
            form["hub_private"] = gr.Checkbox(False, label="Private repo")
    assert tuple(form) == train_ui.FORM_FIELDS
    inputs = [form[name] for name in train_ui.FORM_FIELDS]

    with gr.Row():
        start = gr.Button("Start", variant="primary", elem_id="train-start")
        stop = gr.Button("Stop", variant="stop", elem_id="train-stop")
        resume = gr.Button("Resume", elem_id="train-resume")
        show = gr.Button("Show command", elem_id="train-show-command")
    action = gr.Markdown(elem_id="train-action")
    command = gr.Code(language="shell", label="Command", interactive=False, lines=2, max_lines=8,
                      elem_id="train-command")
    run = gr.Markdown(elem_id="train-run")
    with gr.Row():
        loss = gr.LinePlot(train_ui.loss_frame(train_ui.RunStatus()), x="step", y="loss", title="Training loss",
                           elem_id="train-loss")
        bleu = gr.LinePlot(train_ui.bleu_frame(train_ui.RunStatus()), x="step", y="bleu", title="Validation BLEU",
                           elem_id="train-bleu")
    samples = gr.Dataframe(train_ui.samples_frame(train_ui.RunStatus()), label="Sample replies (validation)",
                           interactive=False, wrap=True, column_widths=["50%", "25%", "25%"],
                           elem_id="train-samples")
    log_tail = gr.Textbox(label="Log (last lines)", lines=12, max_lines=12, interactive=False, autoscroll=True,
                          elem_id="train-log")
    with gr.Row():
        push_repo = gr.Textbox(label="Push the finished run to", placeholder="user/my-chat-e", max_length=200, scale=3)
        push_private = gr.Checkbox(False, label="Private repo", scale=1)
        push = gr.Button("Push to Hub", scale=1, elem_id="train-push")
    timer = gr.Timer(train_ui.TICK_SECONDS)

    # ---- events: each handler checks the login itself (train_ui / chat.auth)
    def do_login(state, typed):
        with train_ui.explained("log in"):
            state, message = auth.login(train.auth, state, typed)
        gr.Info(message)
        return state, auth.status_markdown(train.auth, state), ""

    def do_logout(state):
        state, _ = auth.logout(state)
        return state, auth.status_markdown(train.auth, state)

    def upload(which):
        def handler(state: auth.Session, profile: gr.OAuthProfile | None, current, file, prefix):
            return train_ui.accept_upload(train, state, profile, current, which, file, prefix)
        return handler

    def do_start(state: auth.Session, profile: gr.OAuthProfile | None, current, *values):
        return train_ui.start_run(train, state, profile, current, values)

    def do_stop(state: auth.Session, profile: gr.OAuthProfile | None):
        return train_ui.stop_run(train, state, profile)

    def do_resume(state: auth.Session, profile: gr.OAuthProfile | None):
        return train_ui.resume_run(train, state, profile)

    def do_push(state: auth.Session, profile: gr.OAuthProfile | None, repo, is_private):
        return train_ui.push_run(train, state, profile, repo, is_private)

    one_at_a_time = {"concurrency_limit": 1, "concurrency_id": "train"}
    for trigger in (login.click, password.submit):
        trigger(do_login, [session, password], [session, auth_md, password], api_name="train_login",
                concurrency_limit=1, concurrency_id="login", **private)
    logout.click(do_logout, session, [session, auth_md], api_name="train_logout", queue=False, **private)
    for file, which in ((train_file, "train"), (val_file, "validation")):
        for trigger in (file.upload, file.clear):
            trigger(upload(which), [session, uploads, file, form["source_prefix"]], [uploads, preview],
                    api_name=f"train_upload_{which}", **one_at_a_time, **private)
    actions = [
        start.click(do_start, [session, uploads, *inputs], action, api_name="train_start", **one_at_a_time, **private),
        stop.click(do_stop, session, action, api_name="train_stop", **one_at_a_time, **private),
        resume.click(do_resume, session, action, api_name="train_resume", **one_at_a_time, **private),
        push.click(do_push, [session, push_repo, push_private], action, api_name="train_push", **one_at_a_time,
                   **private),
    ]
    show.click(lambda current, *values: train_ui.show_command(train, current, values), [uploads, *inputs], command,
               api_name="train_command", queue=False, **private)
    form["data_source"].change(lambda source: (gr.update(visible=source == "hub"),
                                               gr.update(visible=source == "upload")),
                               form["data_source"], [form["hub_dataset"], upload_row], queue=False, **private)
    form["model"].input(train_ui.learning_rate_for, form["model"], form["learning_rate"], queue=False, **private)
    return {"auth": auth_md, "cache": cache, "run": run, "loss": loss, "bleu": bleu, "samples": samples,
            "log": log_tail, "model": form["model"], "timer": timer, "actions": actions}


_demo: gr.Blocks | None = None


def __getattr__(name: str):
    """``app.demo`` (what Spaces and ``gradio app.py`` look for), built with the engine on first use."""
    global _demo
    if name == "demo":
        if _demo is None:
            _demo = build_demo(ChatEngine.start())
        return _demo
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


if __name__ == "__main__":
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    started = time.perf_counter()
    engine = ChatEngine.start()
    log.info("%s (model ready in %.1f s)", engine.status, time.perf_counter() - started)
    demo = build_demo(engine)
    demo.launch(**LAUNCH_OPTIONS)  # GRADIO_SERVER_NAME / GRADIO_SERVER_PORT are read by gradio itself
