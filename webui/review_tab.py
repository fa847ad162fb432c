"""The Train tab's "Feedback from the chat" panel: review the chat's ratings and corrections.

Layout and wiring only; what the controls do is in ``webui.review_handlers`` (each checks the
login itself). ``build`` lays the panel out where it is called; ``connect`` wires its events once
the form's source prefix exists (the encoder text shown uses it).
"""

from __future__ import annotations

from dataclasses import dataclass

import gradio as gr

from webui import review_handlers as handlers
from webui.feedback_handlers import event_fields
from webui.train_handlers import TrainTab

PRIVATE = {"api_visibility": "private"}  # not a security boundary: every handler checks the login

# The export's rows arrive in the answer to the logged-in export event; the page saves them as a file.
SAVE_JS = """(data) => {
  if (!data || typeof data.text !== "string") return;
  const link = document.createElement("a");
  link.href = URL.createObjectURL(new Blob([data.text], {type: "application/x-ndjson"}));
  link.download = data.name || "feedback.jsonl";
  document.body.appendChild(link);
  link.click();
  link.remove();
  setTimeout(() => URL.revokeObjectURL(link.href), 60000);
}"""

HELP = """Every 👍 like, 👎 dislike and ✏️ correction in the chat, and every ⚖️ vote in Compare, waits here as a
**pending** row. Select a row to see exactly what the model reads, fix the response if needed, then **Accept** it or
**Reject** it. Accepted likes and corrections train the bot to say them (**Add accepted chat feedback** under **New
run**); as preference rows (**Objective** DPO or KTO under **New run**), a correction teaches "this, rather than what
the bot said", a vote "the winner's reply rather than the loser's" (ties teach nothing), a like or dislike "a good
reply" or "a bad reply"."""


@dataclass
class ReviewParts:
    panel: gr.Accordion
    counts: gr.Markdown
    status: gr.Radio
    refresh: gr.Button
    table: gr.Dataframe
    selected: gr.State  # the selected row's id
    newest: gr.State  # the newest pending row and vote ids this page counted (Accept all stops there)
    detail: gr.Markdown
    response: gr.Textbox
    accept: gr.Button
    reject: gr.Button
    save: gr.Button
    accept_all: gr.Button
    export: gr.Button
    export_dpo: gr.Button  # the accepted feedback as DPO pairs
    export_kto: gr.Button  # ... as KTO rows
    download: gr.JSON  # the export the browser saves (never a file gradio would serve to anyone)
    note: gr.Markdown


def build(train: TrainTab) -> ReviewParts:
    label, _ = handlers.counts_text(train)
    with gr.Accordion(label, open=False, elem_id="review") as panel:
        gr.Markdown(HELP)
        counts = gr.Markdown(elem_id="review-counts")
        with gr.Row():
            status = gr.Radio(handlers.FILTERS, value="pending", label="Show", scale=3, elem_id="review-filter")
            refresh = gr.Button("Refresh", scale=1, elem_id="review-refresh")
        table = gr.Dataframe(
            handlers.rows_frame([]),
            interactive=False,
            wrap=True,
            max_height=360,
            label="Rows (newest first): select one",
            elem_id="review-rows",
        )
        selected, newest = gr.State(None), gr.State((0, 0))
        detail = gr.Markdown(elem_id="review-detail")
        response = gr.Textbox(
            label="Response: what the bot should say", lines=2, max_length=1000, elem_id="review-response"
        )
        with gr.Row(elem_classes="train-buttons"):
            accept = gr.Button("Accept", variant="primary", elem_id="review-accept")
            reject = gr.Button("Reject", variant="stop", elem_id="review-reject")
            save = gr.Button("Save edit", elem_id="review-save")
        with gr.Row(elem_classes="train-buttons"):
            accept_all = gr.Button("Accept all pending", elem_id="review-accept-all")
            export = gr.Button("Export accepted (.jsonl)", elem_id="review-export")
        with gr.Row(elem_classes="train-buttons"):
            export_dpo = gr.Button("Export DPO pairs (.jsonl)", elem_id="review-export-dpo")
            export_kto = gr.Button("Export KTO rows (.jsonl)", elem_id="review-export-kto")
        download = gr.JSON(None, visible=False, elem_id="review-download")  # {"name", "text"}: SAVE_JS saves it
        note = gr.Markdown(elem_id="review-note")
    return ReviewParts(
        panel, counts, status, refresh, table, selected, newest, detail, response, accept, reject, save, accept_all,
        export, export_dpo, export_kto, download, note,
    )  # fmt: skip


def connect(parts: ReviewParts, train: TrainTab, session: gr.BrowserState, source_prefix: gr.Textbox) -> None:
    """The panel's events: a redraw when it opens, on Refresh, a filter change and after each action."""

    def redraw(token: str | None, profile: gr.OAuthProfile | None, status):
        label, counts, rows = handlers.refresh(train, token, profile, status)
        newest = handlers.newest_pending(train)
        pending = train.feedback_store().counts()["pending"] + train.feedback_store().vote_counts()["pending"]
        return label, counts, rows, newest, gr.update(value=f"Accept all pending ({pending})")

    # A refusal raises gr.Error (API clients get it) and is noted for the page: each event's
    # .failure step shows it in the panel's note (or the row's details), where the user looks.
    noted, show_refusal = train.refusals.noted, train.refusals.show

    @noted
    def select(token: str | None, profile: gr.OAuthProfile | None, prefix, event: gr.EventData, request: gr.Request):
        row = event_fields(event).get("row_value")  # gr.EventData: see feedback_handlers.event_fields
        return handlers.details(train, token, profile, row[0] if isinstance(row, list) and row else None, prefix)

    def mark(status):
        @noted
        def handler(token: str | None, profile: gr.OAuthProfile | None, row_id, request: gr.Request):
            return handlers.set_status(train, token, profile, row_id, status)

        return handler

    @noted
    def save(token: str | None, profile: gr.OAuthProfile | None, row_id, response, request: gr.Request):
        return handlers.save_edit(train, token, profile, row_id, response)

    @noted
    def accept_all(token: str | None, profile: gr.OAuthProfile | None, up_to, request: gr.Request):
        return handlers.accept_all(train, token, profile, up_to)

    @noted
    def export(token: str | None, profile: gr.OAuthProfile | None, request: gr.Request):
        return handlers.export_file(train, token, profile)

    view = [parts.panel, parts.counts, parts.table, parts.newest, parts.accept_all]
    quick = {"queue": False, "show_progress": "hidden", **PRIVATE}
    triggers = ((parts.panel.expand, None), (parts.refresh.click, "review_refresh"), (parts.status.change, None))
    for trigger, name in triggers:
        trigger(redraw, [session, parts.status], view, api_name=name, **quick)
    parts.table.select(
        select, [session, source_prefix], [parts.selected, parts.detail, parts.response], api_name="review_row", **quick
    ).failure(show_refusal, None, parts.detail, **quick)
    one = {"concurrency_limit": 1, "concurrency_id": "review", **PRIVATE}  # one review change at a time
    row = [session, parts.selected]
    events = [
        parts.accept.click(mark("accepted"), row, parts.note, api_name="review_accept", **one),
        parts.reject.click(mark("rejected"), row, parts.note, api_name="review_reject", **one),
        parts.save.click(save, [*row, parts.response], parts.note, api_name="review_save", **one),
        parts.accept_all.click(accept_all, [session, parts.newest], parts.note, api_name="review_accept_all", **one),
    ]
    for event in events:
        event.success(redraw, [session, parts.status], view, **quick)
        event.failure(show_refusal, None, parts.note, **quick)

    def preferences(objective):
        @noted
        def handler(token: str | None, profile: gr.OAuthProfile | None, request: gr.Request):
            return handlers.export_preference_file(train, token, profile, objective)

        return handler

    for button, handler, name in (
        (parts.export, export, "review_export"),
        (parts.export_dpo, preferences("dpo"), "review_export_dpo"),
        (parts.export_kto, preferences("kto"), "review_export_kto"),
    ):
        exported = button.click(handler, session, [parts.download, parts.note], api_name=name, **one)
        exported.success(None, parts.download, None, js=SAVE_JS, **PRIVATE)
        exported.failure(show_refusal, None, parts.note, **quick)
