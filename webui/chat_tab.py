"""The Chat tab: who the bot is, generation settings, the chat itself, and the model picker.

Layout and wiring only; what the controls do is in ``webui.chat_handlers`` (the chat, the model
picker) and ``webui.feedback_handlers`` (👍 / 👎 and ✏️ on a reply become training rows).
"""

from __future__ import annotations

from dataclasses import dataclass

import gradio as gr

from chat.engine import MAX_MESSAGE_CHARS, ChatEngine
from webui import auth, bot_identity, chat_handlers, feedback_handlers, model_scores, saved_chats
from webui.train_handlers import TrainTab

PRIVATE = {"api_visibility": "private"}  # not a security boundary: handlers that change things check the login

PLACEHOLDER = "Pick who the bot is (Persona, Emotion…), then say hi."

# Sends the message box's text, as the Send button does (the example event's last step).
SEND_JS = "() => { document.querySelector('#chat-input .submit-button')?.click(); }"


@dataclass
class ChatParts:
    """What the rest of the app wires to: the chat and the model picker."""

    chat: gr.ChatInterface
    picker: gr.Dropdown


def build(
    engine: ChatEngine, train: TrainTab, session: gr.BrowserState, status: gr.Markdown, browser_key: str | None = None
) -> ChatParts:
    """The tab's components and events (call inside ``gr.Tab``). ``status`` is the page's
    serving banner, which a model swap updates; ``browser_key`` encrypts the saved chats in the
    browser (webui.server_state: kept across restarts; None: gradio's own, new at each start)."""
    # The chat comes first (on a phone it is the first thing under the tabs); who the bot is and
    # the generation settings follow it (on the right on a wide screen).
    with gr.Row(elem_id="chat-row"):
        chat_column = gr.Column(scale=3, min_width=320, elem_id="chat-column")
        with gr.Column(scale=1, min_width=300, elem_id="bot-settings"):
            bot = bot_identity.build("The bot has a…", emotion_id="context-emotion", elem_prefix="chat")
            kind, context, contexts = bot.kind, bot.context, bot.contexts
            preset = gr.Radio(chat_handlers.PRESET_CHOICES, value="fast", label="Preset")
            beams0, sample0, temperature0, top_p0, max_new0 = chat_handlers.preset_values("fast")
            ranges = saved_chats.RANGES  # also what a saved chat's settings must fit to be restored
            with gr.Accordion("Generation settings", open=False):
                beams = gr.Slider(
                    *ranges["beams"][:2],
                    value=beams0,
                    step=ranges["beams"][2],
                    label="Beams",
                    info="1 streams word by word; beam search answers at the end.",
                )
                sample = gr.Checkbox(value=sample0, label="Sampling")
                temperature = gr.Slider(
                    *ranges["temperature"][:2],
                    value=temperature0,
                    step=ranges["temperature"][2],
                    label="Temperature (with sampling)",
                )
                top_p = gr.Slider(
                    *ranges["top_p"][:2], value=top_p0, step=ranges["top_p"][2], label="Top-p (with sampling)"
                )
                max_new_tokens = gr.Slider(
                    *ranges["max_new_tokens"][:2],
                    value=max_new0,
                    step=ranges["max_new_tokens"][2],
                    label="Max new tokens",
                )
                seed = gr.Number(0, precision=0, minimum=0, maximum=chat_handlers.SEED_MAX, label="Seed (0 = random)")
            meter = gr.Markdown(chat_handlers.meter_text(None), elem_id="token-meter")
        # Per bot message index: the model, kind and context that wrote it (feedback_handlers.chat_fn),
        # so a rating records them as they were, whatever is served or typed when it is given.
        replies = gr.State({})
        written = gr.State(None)  # the settings of the chat's latest reply (webui.saved_chats)
        with chat_column:
            chat = gr.ChatInterface(
                saved_chats.recording(feedback_handlers.chat_fn(engine)),
                # editable="all" and the like event show ✏️ and 👍 / 👎 on the messages.
                chatbot=gr.Chatbot(
                    label="Chat-E",
                    height=460,
                    placeholder=PLACEHOLDER,
                    elem_id="chat-log",
                    editable="all",
                    feedback_options=("Like", "Dislike"),
                ),
                textbox=gr.Textbox(
                    placeholder="Type a message…",
                    label="Message",  # the box's accessible name (its label is not shown)
                    show_label=False,
                    max_length=MAX_MESSAGE_CHARS,
                    submit_btn=True,
                    stop_btn=True,
                    elem_id="chat-input",
                ),
                additional_inputs=[
                    kind,
                    context,
                    preset,
                    beams,
                    sample,
                    temperature,
                    top_p,
                    max_new_tokens,
                    seed,
                    replies,
                ],
                # The banner follows the model that wrote each reply (a swap on another page shows here).
                additional_outputs=[meter, status, replies, written],
                # The examples are the chatbot's own (set below), not ChatInterface's: its click
                # sends the message with whatever kind and context the page holds at that moment.
                examples=None,
                cache_examples=False,  # Spaces would otherwise run every example at start-up
                # Not ChatInterface's own editing: it resends any edited message as the user's. The
                # chatbot's edit event is wired below (a bot reply edited is a correction).
                editable=False,
                save_history=True,  # in the browser's local storage: stays with its user
                fill_height=False,
                # The UI's own endpoint (history kept in the session, returns reply and meter) is
                # not public: the API is the stateless /chat (app.py).
                api_name="chat_ui",
                api_visibility="private",
            )
            note = gr.Markdown(feedback_handlers.HINT, elem_id="feedback-note")
    # ChatInterface's store of the saved chats: its key and name were its own, the key new at each
    # start and the name numbered after the components made before it; both kept across restarts.
    chat.saved_conversations.storage_key = saved_chats.CHATS_STORAGE_KEY
    if browser_key:
        chat.saved_conversations.secret = browser_key
    picker = _model_panel(engine, train, session, status)
    _feedback_events(chat, train, session, replies, note)

    # An example is sent like a typed message, after its kind and context are set: a click puts the
    # kind, context and message on the page, then presses Send. (ChatInterface's own example event
    # read the kind and context in a race with the event that set them, and sent the old ones.)
    chat.chatbot.examples = [
        {"text": message, "display_text": label}
        for (message, _, _), label in zip(chat_handlers.EXAMPLES, chat_handlers.EXAMPLE_LABELS, strict=True)
    ]

    def pick_example(saved: dict, box: str, event: gr.SelectData):
        index = event.index if isinstance(event.index, int) else -1
        if not 0 <= index < len(chat_handlers.EXAMPLES):
            return gr.skip(), gr.skip(), gr.skip(), gr.skip()
        return *bot_identity.pick_example(saved, index, box), chat_handlers.EXAMPLES[index][0]

    chat.chatbot.example_select(
        pick_example,
        [contexts, context],
        [kind, context, contexts, chat.textbox],
        queue=False,
        show_progress="hidden",
        **PRIVATE,
    ).success(None, js=SEND_JS, **PRIVATE)
    settings = [kind, context, preset, beams, sample, temperature, top_p, max_new_tokens, seed]
    _saved_chat_events(chat, settings, contexts, written, [meter, replies, note], browser_key)
    # .input, not .change: a saved chat's restored preset must not reset its restored beams etc.
    preset.input(
        chat_handlers.preset_values, preset, [beams, sample, temperature, top_p, max_new_tokens], queue=False, **PRIVATE
    )
    return ChatParts(chat=chat, picker=picker)


def _saved_chat_events(
    chat: gr.ChatInterface, settings: list, contexts: gr.State, written: gr.State, visit: list, key: str | None
) -> None:
    """Who the bot was in each saved chat (webui.saved_chats), in a browser-stored value beside
    ChatInterface's saved chats: stored whenever those change (each save after a reply, retry,
    undo or edit, and a deletion), restored when the user opens a saved chat. ``settings`` are the
    controls (kind, context, preset, beams, sample, temperature, top_p, max new tokens, seed);
    ``written`` what the chat's latest reply was written with (the controls may have changed
    since); ``visit`` (meter, reply records, note) starts afresh with a new or a saved chat: it
    has no last reply to measure, nor replies of this visit to rate."""
    store = gr.BrowserState({}, storage_key=saved_chats.STORAGE_KEY, secret=key)
    kind, context = settings[:2]

    def remember(conversation_id, saved, stored, latest, *values):
        # No reply this visit (a reopened chat without stored settings, edited): the page's settings.
        chat_settings = saved_chats.checked(latest) if latest else saved_chats.ChatSettings.from_inputs(*values)
        return saved_chats.remember(stored, conversation_id, saved, chat_settings)

    chat.saved_conversations.change(
        remember,
        [chat.conversation_id, chat.saved_conversations, store, written, *settings],
        store,
        queue=False,
        show_progress="hidden",
        **PRIVATE,
    )

    def fresh() -> tuple:
        return chat_handlers.meter_text(None), {}, feedback_handlers.HINT, None

    def reopen(index, saved, stored, kept, box):
        # New chat keeps the settings on the page; a saved chat gets back its own.
        return (*fresh()[:-1], *saved_chats.restore(stored, index, saved, kept, box))

    options = {"queue": False, "show_progress": "hidden", **PRIVATE}
    chat.new_chat_button.click(fresh, None, [*visit, written], **options)
    # Which saved chat is open (ChatInterface's conversation id: None for a new chat), for the page's
    # script to mark in the list: gradio's zebra stripes made the first row look open after a reload.
    # A save tells it here (the id's own change event is not sent for an unqueued event's state, and
    # a hidden component sends none); a click on a saved chat or on New chat, the script itself.
    open_chat = gr.Number(None, visible=False, elem_id="open-chat")
    chat.saved_conversations.change(lambda index: index, chat.conversation_id, open_chat, **options).then(
        None, open_chat, None, js="(index) => { window.personaChatOpen = index; window.personaTidy?.(); }", **PRIVATE
    )
    chat.chat_history_dataset.click(
        reopen,
        [chat.chat_history_dataset, chat.saved_conversations, store, contexts, context],
        [*visit, kind, context, contexts, *settings[2:], written],
        **options,
    )


def _feedback_events(
    chat: gr.ChatInterface, train: TrainTab, session: gr.BrowserState, replies: gr.State, note: gr.Markdown
) -> None:
    """👍 / 👎 and ✏️ on the chat's messages (webui.feedback_handlers). Both read the chat's server-side
    history (chatbot_state, what the next message is sent with) and an edit updates it too. Queued
    (not queue=False): gr.Warning reaches the page only from a queued event."""

    # gr.EventData, not gr.LikeData / gr.EditData: see feedback_handlers.event_fields.
    def on_like(
        token: str | None, history, saved, event: gr.EventData, request: gr.Request, profile: gr.OAuthProfile | None
    ):
        who, data = feedback_handlers.rater(train.auth, token, profile, request), feedback_handlers.event_fields(event)
        return feedback_handlers.like(who, history, saved, data.get("index"), data.get("liked"), train.feedback_store())

    def on_edit(
        token: str | None, history, saved, event: gr.EventData, request: gr.Request, profile: gr.OAuthProfile | None
    ):
        who, data = feedback_handlers.rater(train.auth, token, profile, request), feedback_handlers.event_fields(event)
        return feedback_handlers.edit(who, history, saved, data.get("index"), data.get("value"), train.feedback_store())

    options = {"concurrency_id": "feedback", "show_progress": "hidden", **PRIVATE}
    chat.chatbot.like(
        on_like, [session, chat.chatbot_state, replies], [note, replies], api_name="rate_reply", **options
    )
    chat.chatbot.edit(
        on_edit,
        [session, chat.chatbot_state, replies],
        [chat.chatbot, chat.chatbot_state, chat.textbox, note, replies],
        api_name="edit_message",
        **options,
    ).then(  # the browser's saved copy of this chat follows the edit (as after a reply)
        chat._save_conversation,
        [chat.conversation_id, chat.chatbot_state, chat.saved_conversations],
        [chat.conversation_id, chat.saved_conversations],
        queue=False,
        **PRIVATE,
    )


def _model_panel(engine: ChatEngine, train: TrainTab, session: gr.BrowserState, status: gr.Markdown) -> gr.Dropdown:
    """The "Model" accordion: pick a finished run, the demo model or a Hub id, and serve it."""
    runs = train.manager.root  # the picker lists the Train tab's finished runs
    choices = chat_handlers.picker_choices(runs, current=engine.current.name)
    with gr.Accordion("Model", open=False):
        with gr.Row():
            picker = gr.Dropdown(
                choices,
                value=chat_handlers.current_choice(engine, choices),
                label="Model",
                elem_id="model-picker",
                info="Base model, bundled demo model, and finished runs (newest first).",
                scale=3,
            )
            hub_id = gr.Textbox(
                label="…or a Hub model id", placeholder="user/my-blenderbot-chat", scale=2, max_length=200
            )
        # The picked model's BLEU by kind (and on held-out chat feedback), when it was saved with them.
        scores = gr.Markdown(model_scores.bleu_note(picker.value, engine.current.name), elem_id="model-bleu")
        with gr.Row():
            load = gr.Button("Load", variant="primary", elem_id="model-load")
            refresh = gr.Button("Refresh")
        # What Load did or why not, where the user looks (not as badges over the picker or banner).
        note = gr.Markdown(elem_id="model-load-note")
        pending = gr.State(None)  # the model a warning asked to confirm with a second Load
        gr.Markdown(
            "Loading a model switches it for everyone using this app, so it needs the Train tab's login; "
            "replies already being written finish on the old one. If loading fails, the current model "
            "keeps serving."
        )

    def load_model(token: str | None, profile: gr.OAuthProfile | None, choice, hub, confirmed):
        # Swapping the model changes it for everyone: a login is needed, checked here.
        try:
            auth.require(train.auth, token, profile, "switch the served model (it changes it for everyone)")
        except auth.AuthError as err:
            yield f"🔒 {err}", None
            return
        yield from chat_handlers.load_model(engine, choice, hub, runs, confirmed)

    load.click(
        load_model,
        [session, picker, hub_id, pending],
        [note, pending],
        concurrency_limit=1,
        concurrency_id="load",
        api_name="load_model",
        **PRIVATE,
    ).then(
        lambda: (chat_handlers.serving_markdown(engine), chat_handlers.refresh_models(engine, runs, keep_value=True)),
        None,
        [status, picker],
        queue=False,
        **PRIVATE,
    )

    def picked(choice: str | None) -> str:
        # Only a listed model's results are read (the value comes from the browser).
        listed = {spec for _, spec in chat_handlers.picker_choices(runs, current=engine.current.name)}
        return model_scores.bleu_note(choice, serving=engine.current.name) if choice in listed else ""

    picker.change(picked, picker, scores, queue=False, show_progress="hidden", **PRIVATE)
    # The banner changes when this page learns of another model (a reply written by it, opening the
    # tab, a load): the list then shows the model serving now (it kept the one served when drawn).
    status.change(
        lambda: chat_handlers.refresh_models(engine, runs), None, picker, queue=False, show_progress="hidden", **PRIVATE
    )
    refresh.click(
        lambda: chat_handlers.refresh_models(engine, runs),
        None,
        picker,
        api_name="refresh_models",
        queue=False,
        **PRIVATE,
    )
    return picker
