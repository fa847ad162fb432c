"""The Chat tab: who the bot is, generation settings, the chat itself, and the model picker.

Layout and wiring only; what the controls do is in ``webui.chat_handlers``.
"""

from __future__ import annotations

from dataclasses import dataclass

import gradio as gr

from chat.engine import MAX_CONTEXT_CHARS, MAX_MESSAGE_CHARS, ChatEngine
from chat.prompt import EMOTIONS
from webui import auth, chat_handlers
from webui.train_handlers import TrainTab, explained

PRIVATE = {"api_visibility": "private"}  # not a security boundary: handlers that change things check the login


@dataclass
class ChatParts:
    """What the rest of the app wires to: the chat and the model picker."""

    chat: gr.ChatInterface
    picker: gr.Dropdown


def build(engine: ChatEngine, train: TrainTab, session: gr.BrowserState, status: gr.Markdown) -> ChatParts:
    """The tab's components and events (call inside ``gr.Tab``). ``status`` is the page's
    serving banner, which a model swap updates."""
    with gr.Row():
        with gr.Column(scale=1, min_width=300):
            kind = gr.Radio(chat_handlers.KIND_CHOICES, value="persona", label="The bot has a…")
            label, info = chat_handlers.CONTEXT_LABELS["persona"]
            # The context string sent with every message. For emotions it is hidden and set from
            # the dropdown below, so the chat always gets one string.
            context = gr.Textbox(
                chat_handlers.CHAT_E_PERSONA, label=label, info=info, lines=2, max_lines=6, max_length=MAX_CONTEXT_CHARS
            )
            emotion = gr.Dropdown(
                list(EMOTIONS),
                value=chat_handlers.KIND_DEFAULTS["emotion"],
                allow_custom_value=True,
                label="Emotion",
                visible=False,
                elem_id="context-emotion",
                info="One of the 32 emotions the model was trained on (or type one).",
            )
            preset = gr.Radio(chat_handlers.PRESET_CHOICES, value="fast", label="Preset")
            beams0, sample0, temperature0, top_p0, max_new0 = chat_handlers.preset_values("fast")
            with gr.Accordion("Generation settings", open=False):
                beams = gr.Slider(
                    1,
                    16,
                    value=beams0,
                    step=1,
                    label="Beams",
                    info="1 streams word by word; beam search answers at the end.",
                )
                sample = gr.Checkbox(value=sample0, label="Sampling")
                temperature = gr.Slider(0.05, 2.0, value=temperature0, step=0.05, label="Temperature (with sampling)")
                top_p = gr.Slider(0.05, 1.0, value=top_p0, step=0.05, label="Top-p (with sampling)")
                max_new_tokens = gr.Slider(1, 128, value=max_new0, step=1, label="Max new tokens")
                seed = gr.Number(0, precision=0, minimum=0, maximum=chat_handlers.SEED_MAX, label="Seed (0 = random)")
            meter = gr.Markdown(chat_handlers.meter_text(None))
        with gr.Column(scale=3):
            chat = gr.ChatInterface(
                chat_handlers.chat_fn(engine),
                chatbot=gr.Chatbot(
                    label="Chat-E", height=460, placeholder="Pick who the bot is on the left, then say hi."
                ),
                textbox=gr.Textbox(
                    placeholder="Type a message…",
                    show_label=False,
                    max_length=MAX_MESSAGE_CHARS,
                    submit_btn=True,
                    stop_btn=True,
                    elem_id="chat-input",
                ),
                additional_inputs=[kind, context, preset, beams, sample, temperature, top_p, max_new_tokens, seed],
                additional_outputs=[meter],
                examples=chat_handlers.EXAMPLES,
                cache_examples=False,  # Spaces would otherwise run every example at start-up
                editable=True,
                save_history=True,  # in the browser's local storage: stays with its user
                fill_height=False,
                # The UI's own endpoint (history kept in the session, returns reply and meter) is
                # not public: the API is the stateless /chat (app.py).
                api_name="chat_ui",
                api_visibility="private",
            )
    picker = _model_panel(engine, train, session, status)

    kind.change(chat_handlers.context_visibility, kind, [context, emotion], queue=False, **PRIVATE)
    kind.input(chat_handlers.context_for_kind, [kind, context], context, queue=False, **PRIVATE)
    emotion.input(lambda value: value or "", emotion, context, queue=False, **PRIVATE)
    context.change(
        lambda k, c: gr.update(value=c) if k == "emotion" else gr.skip(),
        [kind, context],
        emotion,
        queue=False,
        **PRIVATE,
    )
    preset.change(
        chat_handlers.preset_values, preset, [beams, sample, temperature, top_p, max_new_tokens], queue=False, **PRIVATE
    )
    return ChatParts(chat=chat, picker=picker)


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
        with gr.Row():
            load = gr.Button("Load", variant="primary", elem_id="model-load")
            refresh = gr.Button("Refresh")
        gr.Markdown(
            "Loading a model switches it for everyone using this app, so it needs the Train tab's login; "
            "replies already being written finish on the old one. If loading fails, the current model "
            "keeps serving."
        )

    def load_model(token: str | None, profile: gr.OAuthProfile | None, choice, hub):
        # Swapping the model changes it for everyone: a login is needed, checked here.
        with explained("switch the served model"):
            auth.require(train.auth, token, profile, "switch the served model (it changes it for everyone)")
        yield from chat_handlers.load_model(engine, choice, hub, runs)

    load.click(
        load_model,
        [session, picker, hub_id],
        [status, picker],
        concurrency_limit=1,
        concurrency_id="load",
        api_name="load_model",
        **PRIVATE,
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
