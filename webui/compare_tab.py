"""The Compare tab: the same message to two models side by side, a vote, the win rates.

Layout and wiring only; what the controls do is in ``webui.compare_handlers``, the second model
is held by ``chat.compare.CompareSlot`` (freed when idle by its reaper thread).
"""

from __future__ import annotations

from dataclasses import dataclass

import gradio as gr
import pandas as pd

from chat.compare import IDLE_SECONDS, CompareSlot
from chat.engine import MAX_MESSAGE_CHARS, ChatEngine
from webui import bot_identity
from webui import compare_handlers as handlers
from webui.train_handlers import TrainTab

PRIVATE = {"api_visibility": "private"}  # not a security boundary: choosing checks the login itself

INTRO = f"""Send the same message to two models, **A** and **B**, and vote for the better reply (once per
message); the votes give each pair of models a win rate. Each pane keeps its own conversation. Anyone can chat
and vote; choosing the models needs the Train tab's login. The second model is unloaded after
{IDLE_SECONDS // 60} minutes unused (and loaded again by the next message)."""


@dataclass
class CompareParts:
    """What the app and the tests reach: the model slot and the components."""

    slot: CompareSlot
    pair: gr.Markdown
    panes: tuple[gr.Chatbot, gr.Chatbot]
    votes: tuple[gr.Button, gr.Button, gr.Button]
    table: gr.Dataframe
    pickers: tuple[gr.Dropdown, gr.Dropdown]


def build(engine: ChatEngine, train: TrainTab, session: gr.BrowserState, page: gr.Tab | None = None) -> CompareParts:
    """The tab's components and events (call inside ``gr.Tab``; pass that tab as ``page`` so the
    pair, the win rates and the model lists are redrawn whenever it is opened)."""
    slot = CompareSlot(engine)
    slot.start_reaper()
    runs = train.manager.root

    gr.Markdown(INTRO, elem_id="compare-intro")
    pair = gr.Markdown(handlers.pair_markdown(slot), elem_id="compare-pair")
    # Who the bots are and the message come first, then the two replies and the vote: on a phone the
    # message box was at ~1,340 px of an 844 px screen, under the panes and the votes, and who the
    # bots are further down still.
    with gr.Row(elem_id="compare-bot"):
        bot = bot_identity.build("The bots have a…", kind_scale=2, elem_prefix="compare")  # as in the Chat tab
        kind, context = bot.kind, bot.context
    with gr.Row(elem_id="compare-message-row"):
        message = gr.Textbox(
            placeholder="Type a message for both models…",
            label="Message",
            show_label=False,
            max_length=MAX_MESSAGE_CHARS,
            scale=4,
            elem_id="compare-input",
        )
        send = gr.Button("Send", variant="primary", scale=1, elem_id="compare-send")
        clear = gr.Button("New chat", scale=1, elem_id="compare-clear")
    with gr.Row(equal_height=True, elem_id="compare-panes"):
        pane_a = gr.Chatbot(label="A", height=300, elem_id="compare-a", feedback_options=None)
        pane_b = gr.Chatbot(label="B", height=300, elem_id="compare-b", feedback_options=None)
    with gr.Row(elem_id="compare-votes"):
        votes = tuple(
            gr.Button(label, interactive=False, elem_id=f"compare-vote-{winner}")
            for winner, label in handlers.VOTE_LABELS.items()
        )
    note = gr.Markdown(elem_id="compare-note")
    pending = gr.State(None)  # the last reply pair to vote on (server-side: a request cannot set it)
    table = gr.Dataframe(
        pd.DataFrame(columns=handlers.TABLE_COLUMNS),
        label="Votes per pair of models (the win rate counts a tie as half a win)",
        interactive=False,
        wrap=True,  # a model's name takes two lines rather than pushing the last columns off a phone's screen
        elem_id="compare-table",
    )
    choices = handlers.model_choices(slot, runs)
    first_a, first_b = handlers.default_choices(slot, choices, runs)
    with gr.Accordion("Models", open=False):
        with gr.Row():
            picker_a = gr.Dropdown(choices, value=first_a, label="A", elem_id="compare-model-a", scale=2)
            picker_b = gr.Dropdown(choices, value=first_b, label="B", elem_id="compare-model-b", scale=2)
            hub_b = gr.Textbox(label="…or a Hub model id for B", placeholder="user/my-blenderbot-chat", max_length=200)
        load = gr.Button("Load", variant="primary", elem_id="compare-load")
        load_note = gr.Markdown(elem_id="compare-load-note")
        gr.Markdown(
            "LoRA adapters of the served model's base (and that base) compare on it, with no other model "
            "in memory; anything else must fit on one more base (the app holds two base models at most). "
            "Choosing needs the Train tab's login; the chat above is open to everyone."
        )

    def send_both(text, bot_kind, bot_context, history_a, history_b):
        yield from handlers.send(slot, text, bot_kind, bot_context, history_a, history_b)

    outputs = [message, pane_a, pane_b, pending, note, *votes]
    for trigger, name in ((send.click, "compare_send"), (message.submit, "compare_submit")):
        trigger(send_both, [message, kind, context, pane_a, pane_b], outputs, api_name=name, **PRIVATE)
    clear.click(
        lambda: ([], [], None, "", *handlers.votes_enabled(False)),
        None,
        [pane_a, pane_b, pending, note, *votes],
        queue=False,
        **PRIVATE,
    )

    for (winner, _), button in zip(handlers.VOTE_LABELS.items(), votes):

        def cast(last, request: gr.Request, winner=winner):
            return handlers.vote(train.feedback_store(), train, last, winner, request)

        button.click(
            cast, pending, [table, pending, note, *votes], api_name=f"compare_vote_{winner}", queue=False, **PRIVATE
        )

    def choose(token, profile: gr.OAuthProfile | None, choice_a, choice_b, hub):
        yield from handlers.choose_models(slot, train, token, profile, choice_a, choice_b, hub)

    def redraw():
        listed = handlers.model_choices(slot, runs)
        a, b = handlers.default_choices(slot, listed, runs)
        return (
            handlers.pair_markdown(slot),
            *handlers.pane_labels(slot),
            handlers.win_rate_frame(train.feedback_store(), slot.pair),
            gr.update(choices=listed, value=a),
            gr.update(choices=listed, value=b),
        )

    shown = [pair, pane_a, pane_b, table, picker_a, picker_b]
    # Loading shares the Chat tab's "load" queue: one model load at a time in the whole app.
    load.click(
        choose,
        [session, picker_a, picker_b, hub_b],
        load_note,
        concurrency_limit=1,
        concurrency_id="load",
        api_name="compare_load",
        **PRIVATE,
    ).then(lambda: (handlers.pair_markdown(slot), *handlers.pane_labels(slot)), None, shown[:3], queue=False, **PRIVATE)
    if page is not None:
        page.select(redraw, None, shown, queue=False, show_progress="hidden", **PRIVATE)
    return CompareParts(slot, pair, (pane_a, pane_b), votes, table, (picker_a, picker_b))
