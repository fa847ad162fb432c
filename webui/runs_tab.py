"""The runs view (in the Train tab): every run in a table, curves of the chosen ones overlaid,
the settings that differ, and per-run actions.

Layout and wiring only; what it shows and does is ``webui.runs_handlers`` (each action checks the
login). It gets its services handed in (``RunsServices``: engine, auth, run manager); what it
means for other tabs (a served run: the chat's picker; a run for Compare) app.py wires from the
events this returns (``RunsParts``).
"""

from __future__ import annotations

from dataclasses import dataclass

import gradio as gr

from webui import runs_handlers as handlers
from webui.runs_handlers import RunsServices
from webui.train_handlers import explained

PRIVATE = {"api_visibility": "private"}
QUIET = {"queue": False, "show_progress": "hidden", **PRIVATE}
STATE_CHOICES = ["all", "running", "stopping", "finished", "stopped", "failed", "incomplete", "corrupt", "foreign"]
PLOT_HEIGHT = 240


@dataclass
class RunsParts:
    """What app.py wires to the other tabs."""

    panel: gr.Accordion
    served: gr.events.Dependency  # a run now serves: refresh the chat's picker and banner
    compared: gr.events.Dependency  # a run chosen for Compare: put ``chosen`` in its B menu
    chosen: gr.State  # the model (final folder) the last "Send to Compare" chose
    refresh: gr.Button


def build(services: RunsServices, session: gr.BrowserState) -> RunsParts:
    """The view's components and events (call inside the Train tab)."""
    noted, show_refusal = services.refusals.noted, services.refusals.show
    with gr.Accordion("Runs: history, comparison, actions", open=False, elem_id="runs-panel") as panel:
        with gr.Row(elem_classes="train-pair"):
            query = gr.Textbox(label="Filter", placeholder="name, state, base, data …", max_length=200, scale=3)
            state = gr.Dropdown(STATE_CHOICES, value="all", label="State", scale=1, elem_id="runs-state")
            sort = gr.Dropdown(list(handlers.SORTS), value="newest", label="Sort by", scale=1, elem_id="runs-sort")
            refresh = gr.Button("Refresh", scale=1, elem_id="runs-refresh")
        note = gr.Markdown(elem_id="runs-summary")
        table = gr.Dataframe(
            handlers.table([], []),
            interactive=False,
            wrap=True,
            show_label=False,
            column_widths=["210px", "170px", *["110px"] * (len(handlers.COLUMNS) - 2)],  # scrolls sideways
            elem_id="runs-table",
        )
        selected = gr.Dropdown(
            [], value=[], multiselect=True, label="Overlay runs (two or more)", elem_id="runs-select"
        )
        compare_note = gr.Markdown(elem_id="runs-compare-note")
        diff = gr.Dataframe(
            handlers.differences([]), interactive=False, wrap=True, label="Settings that differ", elem_id="runs-diff"
        )
        plots = {}
        for pair in (("loss", "eval_loss"), ("bleu", "context_hits")):
            with gr.Row():
                for name in pair:
                    # Evaluations as points: a run evaluated once has one, and a line of one point draws nothing.
                    kind = gr.LinePlot if name == "loss" else gr.ScatterPlot
                    plots[name] = kind(
                        None,
                        x="step",
                        y="value",
                        color="run",
                        title=handlers.CURVES[name],
                        height=PLOT_HEIGHT,
                        elem_id=f"runs-plot-{name.replace('_', '-')}",
                    )
        gr.Markdown("**One run** (actions need the login)")
        with gr.Row(elem_classes="train-pair"):
            target = gr.Dropdown([], value=None, label="Run", scale=2, elem_id="runs-target")
            label = gr.Textbox(label="New name", max_length=handlers.MAX_LABEL, scale=2, elem_id="runs-label")
            rename = gr.Button("Rename", scale=1, elem_id="runs-rename")
        with gr.Row(elem_classes="train-buttons"):
            serve = gr.Button("Serve in chat", variant="primary", elem_id="runs-serve")
            compare = gr.Button("Send to Compare", elem_id="runs-compare")
            show = gr.Button("Show command", elem_id="runs-command-button")
            delete = gr.Button("Delete", variant="stop", elem_id="runs-delete")
        with gr.Row(visible=False, elem_id="runs-confirm-row") as confirm_row:
            confirm = gr.Button("Yes, delete it", variant="stop", elem_id="runs-confirm")
            cancel = gr.Button("Cancel", elem_id="runs-cancel")
        with gr.Row(elem_classes="train-push-row"):
            repo = gr.Textbox(label="Push to Hub repo", placeholder="user/my-chat-e", max_length=200, scale=3)
            private = gr.Checkbox(False, label="Private repo", scale=1)
            push = gr.Button("Push", scale=1, elem_id="runs-push")
        action = gr.Markdown(elem_id="runs-action")
        command = gr.Code(language=None, label="Command", interactive=False, visible=False, elem_id="runs-command")
    pending = gr.State(None)  # the run a first Delete asked about
    chosen = gr.State(None)

    # ---- watching: open to everyone
    def draw(query_text, state_value, sort_value, selection, current):
        found = handlers.records(services)
        shown = handlers.filtered(found, query_text, state_value, sort_value)
        menu = handlers.choices(found)
        ids = {run_id for _, run_id in menu}
        keep = [i for i in (selection or []) if i in ids]
        return (
            handlers.table(found, shown),
            handlers.summary(found, shown),
            gr.update(choices=menu, value=keep),
            gr.update(choices=menu, value=current if current in ids else None),
        )

    listed = [table, note, selected, target]
    view_inputs = [query, state, sort, selected, target]
    gr.on([refresh.click, query.submit, state.change, sort.change, panel.expand], draw, view_inputs, listed, **QUIET)

    def overlay(selection):
        diff_frame, frames, line = handlers.compare_view(services, selection)
        last = selection[-1] if selection else None
        return (diff_frame, line, *(frames[name] for name in plots), gr.update(value=last))

    selected.change(overlay, selected, [diff, compare_note, *plots.values(), target], **QUIET)

    # ---- acting: each handler checks the login
    @noted
    def do_serve(token, profile: gr.OAuthProfile | None, run_id, request: gr.Request):
        with explained("serve a run"):
            return handlers.serve(services, token, profile, run_id)

    @noted
    def do_compare(token, profile: gr.OAuthProfile | None, run_id, request: gr.Request):
        with explained("send a run to Compare"):
            return handlers.to_compare(services, token, profile, run_id)

    @noted
    def do_command(token, profile: gr.OAuthProfile | None, run_id, request: gr.Request):
        with explained("show a run's command"):
            return gr.update(value=handlers.command(services, token, profile, run_id), visible=True)

    @noted
    def do_rename(token, profile: gr.OAuthProfile | None, run_id, text, request: gr.Request):
        with explained("rename a run"):
            return handlers.rename(services, token, profile, run_id, text)

    @noted
    def do_ask(token, profile: gr.OAuthProfile | None, run_id, request: gr.Request):
        with explained("delete a run"):
            run, question = handlers.ask_delete(services, token, profile, run_id)
        return run, question, gr.update(visible=True)

    @noted
    def do_delete(token, profile: gr.OAuthProfile | None, run_id, asked, request: gr.Request):
        with explained("delete a run"):
            return handlers.delete(services, token, profile, run_id, asked), None, gr.update(visible=False)

    @noted
    def do_push(token, profile: gr.OAuthProfile | None, run_id, repo_id, is_private, request: gr.Request):
        with explained("push a run"):
            return handlers.push(services, token, profile, run_id, repo_id, is_private)

    one = {"concurrency_limit": 1, "concurrency_id": "runs", **PRIVATE}
    served = serve.click(do_serve, [session, target], action, **one)
    compared = compare.click(do_compare, [session, target], [chosen, action], **one)
    shown = show.click(do_command, [session, target], command, **one)
    renamed = rename.click(do_rename, [session, target, label], action, **one)
    asked = delete.click(do_ask, [session, target], [pending, action, confirm_row], **one)
    deleted = confirm.click(do_delete, [session, target, pending], [action, pending, confirm_row], **one)
    pushed = push.click(do_push, [session, target, repo, private], action, **one)
    cancel.click(lambda: (None, "", gr.update(visible=False)), None, [pending, action, confirm_row], **QUIET)
    for event in (served, compared, shown, renamed, asked, deleted, pushed):
        event.failure(show_refusal, None, action, **QUIET)
    for event in (renamed, deleted, pushed):  # the table shows what changed
        event.success(draw, view_inputs, listed, **QUIET)
    return RunsParts(panel=panel, served=served, compared=compared, chosen=chosen, refresh=refresh)
