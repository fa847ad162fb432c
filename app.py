"""Chat-E: the persona-chat web app (``python app.py``; also a Hugging Face Space's app file).

Tabs: **Chat** (talk to the served checkpoint as a persona / emotion / task goal / topic / no
context, with presets, generation settings, a token meter and a model picker) and **Train**.
Public API: ``Client(url).predict(message, kind, context, api_name="/chat")`` (see README, "API").

``build_demo(engine)`` builds the app around any ``ChatEngine`` (the tests pass the bundled demo
model). ``python app.py`` starts the engine (``CHAT_MODEL`` or the 400M base model; offline, the
demo model) and serves on GRADIO_SERVER_NAME / GRADIO_SERVER_PORT. Importing this module loads
nothing: ``app.demo`` is built on first access.
"""

import logging
import time

import gradio as gr

from chat import ui
from chat.engine import MAX_CONTEXT_CHARS, MAX_MESSAGE_CHARS, ChatEngine
from chat.prompt import EMOTIONS

log = logging.getLogger("app")

QUEUE_MAX_SIZE = 64
# Up to 8 replies run at once; the engine batches concurrent ones into one generate() call.
CONCURRENCY = 8
# The secret that will unlock the Train tab (see TRAIN_PLACEHOLDER).
TRAIN_PASSWORD_ENV = "TRAIN_PASSWORD"

INTRO = """# Chat-E
Give the bot a **persona**, an **emotion**, a **task goal** or a **topic** (or nothing) and chat.
The model is a BlenderBot fine-tuned on MuDoConv; your messages are sent to it in exactly the format it was
trained on. Each browser tab is its own conversation."""

TRAIN_PLACEHOLDER = f"""### Training
For now, training is launched from the command line: see the README, section **Train**
(`accelerate launch --config_file configs/accelerate/... -m finetune ...`, or
`python -m finetune --model_name_or_path tiny --dataset_name sample --output_dir runs/NAME` on a CPU).
A finished run's `runs/NAME/final/` shows up in the Chat tab's model picker (open **Model**, press **Refresh**).

Starting, watching and stopping runs from this tab is coming. It will be enabled by setting the
`{TRAIN_PASSWORD_ENV}` environment variable (on a Hugging Face Space: a **secret**); the tab then asks for that
password before it starts anything, so visitors of a public Space cannot launch training."""


def build_demo(engine: ChatEngine) -> gr.Blocks:
    """The whole app around ``engine`` (queue configured, not launched)."""
    choices = ui.model_choices(current=engine.current.name)
    with gr.Blocks(title="Chat-E · persona-chat", analytics_enabled=False) as demo:
        gr.Markdown(INTRO)
        status = gr.Markdown(ui.status_markdown(engine))
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
                                               max_length=MAX_MESSAGE_CHARS, submit_btn=True, stop_btn=True),
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
                                             info="Base model, bundled demo model, and finished runs (newest first).",
                                             scale=3)
                        hub_id = gr.Textbox(label="…or a Hub model id", placeholder="user/my-blenderbot-chat", scale=2,
                                            max_length=200)
                    with gr.Row():
                        load = gr.Button("Load", variant="primary")
                        refresh = gr.Button("Refresh")
                    gr.Markdown("Loading a model switches it for everyone using this app; replies already "
                                "being written finish on the old one. If loading fails, the current model "
                                "keeps serving.")
            with gr.Tab("Train"):
                # TEMPORARY: the Train tab's logic (finetune/runner.py's RunManager: start, watch and
                # stop runs, password-gated) is being written separately. Until it lands this tab only
                # explains how to train from the CLI. Replace this Markdown with the real tab here.
                gr.Markdown(TRAIN_PLACEHOLDER)

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

        def load_model(choice, hub):
            yield from ui.load_model(engine, choice, hub)

        load.click(load_model, [picker, hub_id], [status, picker], concurrency_limit=1, concurrency_id="load",
                   **private)
        refresh.click(lambda: ui.refresh_models(engine), None, picker, queue=False, **private)
        # The model is shared: show what is serving now whenever a page opens.
        demo.load(lambda: (ui.status_markdown(engine), ui.refresh_models(engine)), None, [status, picker],
                  queue=False, **private)
    demo.queue(max_size=QUEUE_MAX_SIZE, default_concurrency_limit=CONCURRENCY)
    demo.chat_interface = chat  # for tests and for code that wires more events to the chat
    return demo


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
    demo.launch()  # GRADIO_SERVER_NAME / GRADIO_SERVER_PORT are read by gradio itself
