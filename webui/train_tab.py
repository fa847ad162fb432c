"""The Train tab: log in, describe a run, start / stop / resume / push it, and watch it live.

Layout and wiring only; what the controls do is in ``webui.train_handlers`` (each handler
checks the login itself) and the runs themselves are ``finetune.jobs``'s. The form's components
are named after the training settings they set (``train_handlers.FORM_FIELDS``) and reach the
handlers by those names, so the layout is free to arrange them.
"""

from __future__ import annotations

from dataclasses import dataclass
from types import SimpleNamespace

import gradio as gr

from webui import auth, review_tab, train_form, train_objective
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
    # live_view's outputs in its order: run text, loss, BLEU and preference plots, samples, log tail,
    # action line, base-model dropdown
    live: list
    review: gr.Accordion  # the feedback review panel, whose label counts the pending rows


def build(train: TrainTab, session: gr.BrowserState) -> TrainParts:
    """The tab's components and events (call inside ``gr.Tab``), section by section; returns the parts
    that app.py wires to the chat tab and the page: live outputs, timer, action events."""
    defaults = handlers.default_form(train)
    uploads = gr.State(handlers.Uploads())  # validated copies' paths, server-side
    cache = gr.State(None)  # what this page shows, to send only changes
    gr.Markdown(INTRO)
    ui = login_section(train)
    ui.review = review_tab.build(train)  # the chat's feedback, to accept before training on it
    ui.__dict__.update(train_form.form_section(train, defaults).__dict__)  # "New run"
    ui.__dict__.update(controls_section(train, defaults).__dict__)
    ui.__dict__.update(live_section().__dict__)
    ui.__dict__.update(push_section().__dict__)
    gr.HTML(CSS, elem_id="train-css", padding=False, js_on_load=PAGE_JS)
    timer = gr.Timer(handlers.TICK_SECONDS, active=False)  # ticks only while the tab is shown (app.py)
    connect_login(train, session, ui)
    actions = connect_actions(train, session, uploads, ui)
    connect_form(train, session, ui)
    return TrainParts(
        auth=ui.auth_md,
        cache=cache,
        timer=timer,
        actions=actions,
        live=[ui.run, ui.loss, ui.bleu, ui.pref, ui.samples, ui.log_tail, ui.action, ui.form["model_name_or_path"]],
        review=ui.review.panel,
    )


# --------------------------------------------------------------------------- sections (layout)


def login_section(train: TrainTab) -> SimpleNamespace:
    """The login line, the password row (a password login) or the Hub login button, the hardware."""
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
    return SimpleNamespace(auth_md=auth_md, password=password, login=login, logout=logout, login_note=login_note)


def controls_section(train: TrainTab, defaults: dict) -> SimpleNamespace:
    """The pre-flight estimate, why the controls are locked, Start / Stop / Resume / Show command."""
    locked = {"interactive": False}
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
    return SimpleNamespace(
        estimate=estimate,
        lock_note=lock_note,
        start=start,
        stop=stop,
        resume=resume,
        show=show,
        action=action,
        command=command,
    )


def live_section() -> SimpleNamespace:
    """What the latest run shows: its text, loss and BLEU plots, log tail, sample replies."""
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
    return SimpleNamespace(run=run, loss=loss, bleu=bleu, pref=pref, log_tail=log_tail, samples=samples)


def push_section() -> SimpleNamespace:
    """Push the finished run to the Hub (repo, private, merged LoRA)."""
    locked = {"interactive": False}
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
    return SimpleNamespace(push_repo=push_repo, push_private=push_private, push_merged=push_merged, push=push)


# --------------------------------------------------------------------------- sections (events)


def _unlocked(train: TrainTab, ui: SimpleNamespace) -> list:
    """The controls a login unlocks."""
    unlocked = [*(c for name, c in ui.form.items() if name != "num_gpus" or train.gpus), ui.train_file, ui.val_file]
    return unlocked + [ui.start, ui.stop, ui.resume, ui.push_repo, ui.push_private, ui.push_merged, ui.push]


def connect_login(train: TrainTab, session: gr.BrowserState, ui: SimpleNamespace) -> None:
    """Log in (not queued) and out."""
    password, login_note, auth_md = ui.password, ui.login_note, ui.auth_md
    noted, show_refusal = train.refusals.noted, train.refusals.show
    quiet = {"queue": False, "show_progress": "hidden", **PRIVATE}

    @noted
    def do_login(token, typed, request: gr.Request):
        with handlers.explained("log in"):
            token, _ = auth.login(train.auth, typed, train.auth.client(request))
        return token, auth.login_markdown(train.auth, token), ""

    def do_logout(token):
        auth.logout(train.auth, token)
        return None, auth.login_markdown(train.auth, None)

    for trigger in (ui.login.click, password.submit):
        # Not queued: a flood of wrong passwords takes no place in the queue that chat replies use,
        # and a refused login returns at once (auth.Throttle), holding nothing.
        attempt = trigger(do_login, [session, password], [session, auth_md, password], api_name="train_login", **quiet)
        attempt.success(lambda: "", None, login_note, **quiet)
        attempt.failure(show_refusal, None, login_note, **quiet)
    ui.logout.click(do_logout, session, [session, auth_md], api_name="train_logout", queue=False, **PRIVATE)


def connect_actions(train: TrainTab, session: gr.BrowserState, uploads: gr.State, ui: SimpleNamespace) -> list:
    """Uploads, Start / Stop / Resume / Push (returned: app.py redraws after each) and Show command."""
    form, form_inputs, action, command = ui.form, ui.form_inputs, ui.action, ui.command
    start, stop, resume, show, push = ui.start, ui.stop, ui.resume, ui.show, ui.push
    push_repo, push_private, push_merged = ui.push_repo, ui.push_private, ui.push_merged
    train_file, val_file, preview = ui.train_file, ui.val_file, ui.preview
    # ---- events: each handler checks the login itself (train_handlers / webui.auth)
    # A refusal raises gr.Error (what API clients get) and is noted for the page: each event's
    # .failure step shows it in the line under its buttons (webui.refusals).
    noted, show_refusal = train.refusals.noted, train.refusals.show

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
    return actions


def connect_form(train: TrainTab, session: gr.BrowserState, ui: SimpleNamespace) -> None:
    """What the form does as it changes (data source, feedback, pre-flight, learning rate), the
    review panel, and the controls' lock at each page load, login and logout."""
    form, upload_row, preview, mix, review = ui.form, ui.upload_row, ui.preview, ui.mix, ui.review
    estimate, lock_note, unlocked = ui.estimate, ui.lock_note, _unlocked(train, ui)
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
    train_objective.connect(ui.objective, ui.preference_counts, train.feedback_store)
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
