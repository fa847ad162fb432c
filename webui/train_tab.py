"""The Train tab: log in, describe a run, start / stop / resume / push it, and watch it live.

Layout and wiring only; what the controls do is in ``webui.train_handlers`` (each handler
checks the login itself) and the runs themselves are ``finetune.jobs``'s. The form's components
are named after the training settings they set (``train_handlers.FORM_FIELDS``) and reach the
handlers by those names, so the layout is free to arrange them.
"""

from __future__ import annotations

from dataclasses import dataclass

import gradio as gr

from webui import auth, review_tab, train_lora, train_objective
from webui import train_handlers as handlers
from webui import train_preflight as preflight
from webui import train_view as view
from webui.train_handlers import TrainTab

PRIVATE = {"api_visibility": "private"}  # not a security boundary: every handler checks the login
PLOT_HEIGHT = 260

# On a phone the tab is one long column: rows of small inputs keep two per line and buttons share a
# line (gradio stacks each on its own line below its min width). A button's or a checkbox's words
# stay on one line (a phone broke "Show command" and "Private repo" into one word per line): in the
# push row, the repo id, the checkbox and the button each get a line (gradio puts the first two in
# one .form box).
CSS = """<style>
.train-buttons > button, .train-push-row button, .train-push-row label { white-space: nowrap; }
@media (max-width: 640px) {
  .train-pair, .train-pair > .form { flex-direction: row !important; flex-wrap: wrap !important; }
  .train-pair > *, .train-pair > .form > * { flex: 1 1 40% !important; min-width: 40% !important; }
  .train-buttons, .train-push-row { flex-wrap: wrap !important; }
  .train-buttons > button { flex: 1 1 40% !important; min-width: 40% !important; }
  .train-push-row > .form { flex-wrap: wrap !important; }
  .train-push-row > .form > * { flex: 1 1 100% !important; }
}
</style>"""

# What the page itself does (gradio's HTML ``js_on_load``, once the tab is drawn):
# - the run's status and what an action did are ARIA live regions, so a screen reader announces a
#   run's progress, its end and a refusal (gradio's Markdown has no attribute for it);
# - the log box keeps its newest line in view: wrapped lines (a phone wraps each one) make its 12
#   lines taller than the box, and gradio's autoscroll follows only its first update. Only while
#   the reader has not scrolled up to read something.
PAGE_JS = """
const live = (tries) => {
  const found = ["train-run", "train-action", "train-login-note"].map((id) => document.getElementById(id));
  found.forEach((el) => { if (el) { el.setAttribute("role", "status"); el.setAttribute("aria-live", "polite"); } });
  if (found.some((el) => !el) && tries > 0) setTimeout(() => live(tries - 1), 200);
};
live(50);
let pinned = true, watched = null, touched = 0;
setInterval(() => {
  const box = document.querySelector("#train-log textarea");
  if (!box || !box.clientHeight) return;
  if (box !== watched) {  // a scroll counts as the reader's within a second of their wheel, touch, key or click
    watched = box;
    for (const type of ["wheel", "touchmove", "keydown", "mousedown"]) {
      box.addEventListener(type, () => { touched = Date.now(); }, { passive: true });
    }
    box.addEventListener("scroll", () => {
      if (Date.now() - touched < 1000) pinned = box.scrollTop + box.clientHeight >= box.scrollHeight - 8;
    });
  }
  if (pinned && box.scrollTop + box.clientHeight < box.scrollHeight - 8) box.scrollTop = box.scrollHeight;
}, 250);
"""

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
    live: (
        list  # run text, loss plot, BLEU plot, samples, log tail, action line, base-model dropdown (live_view's order)
    )
    review: gr.Accordion  # the feedback review panel, whose label counts the pending rows


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
    # Why a login was refused ("Wrong password.", how long a lockout lasts), where the user looks.
    login_note = gr.Markdown(elem_id="train-login-note")
    if train.auth.oauth:
        gr.LoginButton()
    gr.Markdown(handlers.hardware_note(train.gpus))

    review = review_tab.build(train)  # the chat's feedback, to accept before training on it
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

    # What the run will need (memory per GPU, time per epoch), and why Start will refuse a batch too big.
    estimate = gr.Markdown(
        handlers.preflight_markdown(train, {name: defaults[name] for name in preflight.FIELDS}),
        elem_id="train-preflight",
    )
    lock_note = gr.Markdown(handlers.controls_state(train, None, None)[1], elem_id="train-lock-note")
    with gr.Row(elem_classes="train-buttons"):
        start = gr.Button("Start", variant="primary", elem_id="train-start", **locked)
        stop = gr.Button("Stop", variant="stop", elem_id="train-stop", **locked)
        resume = gr.Button("Resume", elem_id="train-resume", **locked)
        show = gr.Button("Show command", elem_id="train-show-command")
    action = gr.Markdown(elem_id="train-action")
    # Hidden until Show command fills it: empty, it was a tall blank box above the run (~200 px on a phone).
    command = gr.Code(
        language=None,  # plain: the shell highlighting drew flags at 1.56:1 and values at 2-2.84:1 on white
        label="Command",
        interactive=False,
        lines=2,
        max_lines=8,
        visible=False,
        elem_id="train-command",
    )
    run = gr.Markdown(elem_id="train-run")
    with gr.Row():
        loss = gr.LinePlot(
            view.loss_frame(view.RunStatus()),
            x="step",
            y="loss",
            title="Training loss",
            height=PLOT_HEIGHT,
            elem_id="train-loss",
        )
        # Points, not a line: an evaluation comes once per epoch, and a line of one point draws nothing
        # (gradio 6's LinePlot has no point marks), so the first BLEU would stay invisible.
        bleu = gr.ScatterPlot(
            view.bleu_frame(view.RunStatus()),
            x="step",
            y="bleu",
            y_lim=view.values_axis(view.bleu_frame(view.RunStatus()), "bleu"),  # a score from 0
            title="Validation BLEU",
            height=PLOT_HEIGHT,
            elem_id="train-bleu",
        )
        pref = view.pref_plot(PLOT_HEIGHT)  # DPO / KTO runs: held-out preference accuracy
    log_tail = gr.Textbox(
        label="Log (newest lines at the bottom)",
        lines=view.LOG_LINES,
        max_lines=view.LOG_LINES,
        interactive=False,
        autoscroll=True,
        elem_id="train-log",
    )
    with gr.Accordion("Sample replies (validation)", open=False, elem_id="train-samples-panel"):
        samples = gr.Dataframe(
            view.samples_frame(view.RunStatus()),
            show_label=False,
            interactive=False,
            wrap=True,
            column_widths=["50%", "25%", "25%"],
            elem_id="train-samples",
        )
    with gr.Accordion("Push the finished run to the Hub", open=False, elem_id="train-push-panel"):
        with gr.Row(elem_id="train-push-row", elem_classes="train-push-row"):
            push_repo = gr.Textbox(
                label="Push the finished run to", placeholder="user/my-chat-e", max_length=200, scale=3, **locked
            )
            push_private = gr.Checkbox(False, label="Private repo", scale=1, elem_id="train-push-private", **locked)
            push_merged = gr.Checkbox(
                False, label="Merge LoRA into base", scale=1, elem_id="train-push-merged", **locked
            )
            push = gr.Button("Push to Hub", scale=1, elem_id="train-push", **locked)
    gr.HTML(CSS, elem_id="train-css", padding=False, js_on_load=PAGE_JS)
    timer = gr.Timer(handlers.TICK_SECONDS, active=False)  # ticks only while the tab is shown (app.py)
    view.connect_pref(train, timer, pref)
    unlocked = [*(c for name, c in form.items() if name != "num_gpus" or train.gpus), train_file, val_file]
    unlocked += [start, stop, resume, push_repo, push_private, push_merged, push]

    # ---- events: each handler checks the login itself (train_handlers / webui.auth)
    # A refusal raises gr.Error (what API clients get) and is noted for the page: each event's
    # .failure step shows it in the line under its buttons (webui.refusals).
    noted, show_refusal = train.refusals.noted, train.refusals.show

    @noted
    def do_login(token, typed, request: gr.Request):
        with handlers.explained("log in"):
            token, _ = auth.login(train.auth, typed, train.auth.client(request))
        return token, auth.login_markdown(train.auth, token), ""

    def do_logout(token):
        auth.logout(train.auth, token)
        return None, auth.login_markdown(train.auth, None)

    def upload(which):
        def handler(token: str | None, profile: gr.OAuthProfile | None, current, file, prefix):
            return handlers.accept_upload(train, token, profile, current, which, file, prefix)

        return handler

    @noted
    def do_start(token: str | None, profile: gr.OAuthProfile | None, current, request: gr.Request, **values):
        return handlers.start_run(train, token, profile, current, values)

    def do_show(current, **values):
        return handlers.show_command(train, current, values)

    @noted
    def do_stop(token: str | None, profile: gr.OAuthProfile | None, request: gr.Request):
        return handlers.stop_run(train, token, profile)

    @noted
    def do_resume(token: str | None, profile: gr.OAuthProfile | None, request: gr.Request):
        return handlers.resume_run(train, token, profile)

    @noted
    def do_push(token: str | None, profile: gr.OAuthProfile | None, repo, is_private, merged, request: gr.Request):
        return handlers.push_run(train, token, profile, repo, is_private, merged)

    one_at_a_time = {"concurrency_limit": 1, "concurrency_id": "train"}
    quiet = {"queue": False, "show_progress": "hidden", **PRIVATE}
    for trigger in (login.click, password.submit):
        # Not queued: a flood of wrong passwords takes no place in the queue that chat replies use,
        # and a refused login returns at once (auth.Throttle), holding nothing.
        attempt = trigger(do_login, [session, password], [session, auth_md, password], api_name="train_login", **quiet)
        attempt.success(lambda: "", None, login_note, **quiet)
        attempt.failure(show_refusal, None, login_note, **quiet)
    logout.click(do_logout, session, [session, auth_md], api_name="train_logout", queue=False, **PRIVATE)
    for file, which in ((train_file, "train"), (val_file, "validation")):
        for trigger in (file.upload, file.clear):
            trigger(
                upload(which),
                [session, uploads, file, form["source_prefix"]],
                [uploads, preview, file],
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
            do_push,
            [session, push_repo, push_private, push_merged],
            action,
            api_name="train_push",
            **one_at_a_time,
            **PRIVATE,
        ),
    ]
    for event in actions:  # a refusal replaces what the last action said ("Started run …")
        event.failure(show_refusal, None, action, **quiet)
    show.click(lambda: gr.update(visible=True), None, command, queue=False, show_progress="hidden", **PRIVATE).then(
        do_show, uploads, command, inputs_kwargs=form_inputs, api_name="train_command", queue=False, **PRIVATE
    )
    form["data_source"].change(
        lambda source: (gr.update(visible=source == "hub"), *[gr.update(visible=source == "upload")] * 2),
        form["data_source"],
        [form["hub_dataset"], upload_row, preview],
        queue=False,
        **PRIVATE,
    )
    form["use_feedback"].change(
        lambda checked, model: handlers.feedback_toggled(train, checked, model),
        [form["use_feedback"], form["model_name_or_path"]],
        [form["feedback_ratio"], form["model_name_or_path"], form["learning_rate"], form["adapter"]],
        queue=False,
        **PRIVATE,
    )
    mix_fields = [form[name] for name in ("use_feedback", "data_source", "n_train", "feedback_ratio")]
    gr.on(
        [field.change for field in mix_fields],
        lambda checked, source, n_train, ratio: gr.update(
            visible=bool(checked),
            value=preflight.feedback_line(train.feedback_store(), source, n_train, ratio) if checked else "",
        ),
        mix_fields,
        mix,
        queue=False,
        show_progress="hidden",
        **PRIVATE,
    )
    review_tab.connect(review, train, session, form["source_prefix"])
    train_objective.connect(objective, preference_counts, train.feedback_store)
    gr.on(
        [form[name].change for name in preflight.FIELDS],
        lambda *values: handlers.preflight_markdown(train, dict(zip(preflight.FIELDS, values, strict=True))),
        [form[name] for name in preflight.FIELDS],
        estimate,
        queue=False,
        show_progress="hidden",
        **PRIVATE,
    )

    def page_state(token: str | None, profile: gr.OAuthProfile | None):
        # on page load and at each login / logout: what this page may use, and why not
        allowed, why = handlers.controls_state(train, token, profile)
        return (why, *(gr.update(interactive=allowed) for _ in unlocked))

    gr.on(None, page_state, session, [lock_note, *unlocked], queue=False, show_progress="hidden", **PRIVATE)
    form["model_name_or_path"].input(
        handlers.learning_rate_for, form["model_name_or_path"], form["learning_rate"], queue=False, **PRIVATE
    )
    return TrainParts(
        auth=auth_md,
        cache=cache,
        timer=timer,
        actions=actions,
        live=[run, loss, bleu, samples, log_tail, action, form["model_name_or_path"]],
        review=review.panel,
    )
