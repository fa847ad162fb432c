"""Chat-E: the persona-chat web app (``python app.py``; also a Hugging Face Space's app file).

Tabs: **Chat** (webui/chat_tab.py: talk to the served checkpoint as a persona / emotion / task
goal / topic / no context, pick the served model), **Compare** (webui/compare_tab.py: the same
message to two models side by side, votes and win rates) and **Train** (webui/train_tab.py: start,
watch, stop, resume and push runs of finetune.jobs). Public API:
``Client(url).predict(message, kind, context, api_name="/chat")`` (README, "API"), and the
OpenAI-compatible ``/v1`` routes of api/ on the same server (``launch_options``). Every other
endpoint is private, and those that change something check the login themselves (webui/auth.py).

``build_demo(engine, train)`` builds the app around any ``ChatEngine`` and Train tab settings (the
tests pass the bundled demo model and their own runs root and login). Importing this module
loads nothing: ``app.demo`` is built on first access.
"""

import logging
import os
import time
import warnings
from dataclasses import replace

import gradio as gr
import transformers
from starlette.middleware import Middleware

import api
from chat import clients
from chat.engine import ChatEngine, load_apart
from chat.stepping import concurrency
from finetune.jobs.uploads import MAX_UPLOAD_BYTES
from webui import (
    auth,
    chat_handlers,
    chat_tab,
    compare_tab,
    look,
    review_handlers,
    runs_handlers,
    runs_tab,
    server_state,
    train_handlers,
    train_tab,
    train_view,
)
from webui import uploads as web_uploads
from webui.request_text import DropLoneSurrogates

log = logging.getLogger("app")

QUEUE_MAX_SIZE = 64
# Replies run at once: the step loop's rows per step, so its steps can fill (16 on a CPU, 64 with a GPU,
# CHAT_CONCURRENCY overrides: chat.stepping.concurrency); the engine batches them (docs/chat-benchmarks.md).
CONCURRENCY = concurrency()
# gradio refuses bigger uploads before they reach a handler (finetune.jobs checks again before parsing).
# gradio keeps ~200 KB of state per browser session (a copy of every component's config), by default
# for 10,000 sessions (~2 GB): 1,000 bounds it to ~200 MB. Nothing that matters lives only there: the
# login is the browser's token, the chat history the browser's, a run's state its folder's.
# show_error: a request that gradio itself rejects (e.g. too few inputs) says why, not {"error": null};
# the app's own handlers turn every failure into a message meant for the user (gr.Error).
# enable_monitoring off: gradio's /monitoring/summary (on unless turned off) tells anonymous visitors every
# endpoint's call counts and timings, the private ones' too; the Runs tab is this app's monitoring.
# max_threads: gradio runs at most this many events at once (its queue's job slots) and steps every sync
# handler's generator in a pool of this many threads, 40 by default: fewer than the 64 replies a GPU
# runs at once (measured on an H100: 64 clients on /chat got 26 replies/s, the engine alone 216). The
# chat's replies, and gradio's default 40 for everything else beside them.
LAUNCH_OPTIONS = {
    "max_file_size": MAX_UPLOAD_BYTES,
    "state_session_capacity": 1000,
    "show_error": True,
    "max_threads": CONCURRENCY + 40,
    "enable_monitoring": False,
}


PRIVATE = {"api_visibility": "private"}

INTRO = """# Chat-E
Give the bot a **persona**, an **emotion**, a **task goal** or a **topic** (or nothing) and chat.
The model is a BlenderBot fine-tuned on MuDoConv; your messages are sent to it in exactly the format it was
trained on. Each browser tab is its own conversation."""


def build_demo(
    engine: ChatEngine, train: train_handlers.TrainTab | None = None, browser_key: str | None = None
) -> gr.Blocks:
    """The whole app around ``engine`` (queue configured, not launched). ``train`` is the Train
    tab's runs root, login settings and hardware (default: from the environment); ``browser_key``
    encrypts what browsers store (default: the state folder's, kept across restarts)."""
    train = train or train_handlers.TrainTab.create()
    browser_key = browser_key or server_state.browser_key()
    train.serving = lambda: engine.current.name  # the Train tab offers the served run to continue from
    # delete_cache: gradio removes the files this process received after 30 min (the cleaner thread,
    # started with the server, also caps the folder's size and removes the app's unused copies).
    # The look (theme, CSS, the page's script) belongs to the app, so it is given here and not to
    # launch(): Spaces and ``gradio app.py`` launch without arguments. Gradio 6 still honours it
    # in the constructor (launch() falls back to it) but warns; the warning is expected.
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", "The parameters have been moved", UserWarning)
        blocks = gr.Blocks(
            title="Chat-E · persona-chat",
            analytics_enabled=False,
            delete_cache=(web_uploads.MAX_AGE_S, web_uploads.MAX_AGE_S),
            theme=look.THEME,
            css=look.CSS,
            js=look.JS,
        )
    with blocks as demo:
        # The login token (webui/auth.py): kept by the browser, encrypted in its local storage, sent
        # with every action and checked against the server's live logins; None when logged out.
        session = gr.BrowserState(None, storage_key="persona-chat-login", secret=browser_key)
        gr.Markdown(INTRO, elem_id="intro")
        status = gr.Markdown(chat_handlers.serving_markdown(engine), elem_id="serving-status")
        with gr.Tabs():
            with gr.Tab("Chat") as chat_page:
                chat = chat_tab.build(engine, train, session, status, browser_key)
            with gr.Tab("Compare") as compare_page:
                compare = compare_tab.build(engine, train, session, compare_page)
            with gr.Tab("Train") as train_page:
                tab = train_tab.build(train, session)
                services = runs_handlers.RunsServices(engine, train.auth, train.manager, train.refusals)
                runs = runs_tab.build(services, session)

        # Public API: Client(url).predict(message, kind, context, api_name="/chat") -> (reply, model id).
        gr.api(chat_handlers.api_chat_fn(engine), api_name="chat")

        # The Train tab's live view, from the run directory, so every page shows the same run; a
        # newly finished run also appears in both model lists.
        def redraw(cache, token: str | None, profile: gr.OAuthProfile | None):
            visitor = auth.who(train.auth, token, profile, touch=False) is None
            return train_view.live_view(
                train,
                cache,
                (
                    lambda: train_handlers.model_list_update(train),
                    lambda: chat_handlers.refresh_models(engine, train.manager.root),
                ),
                visitor=visitor,
            )

        # The runs view: a run served from it shows in the chat's picker and banner; one sent to
        # Compare becomes its model B.
        runs.served.success(
            lambda: (chat_handlers.refresh_models(engine, train.manager.root), chat_handlers.serving_markdown(engine)),
            None,
            [chat.picker, status],
            **PRIVATE,
        )
        runs.compared.success(
            lambda spec: gr.update(
                choices=chat_handlers.picker_choices(train.manager.root, current=engine.current.name), value=spec
            ),
            runs.chosen,
            compare.pickers[1],
            **PRIVATE,
        )

        live = [tab.cache, *tab.live, chat.picker]
        # Poll only while the Train tab is shown: a page left on the chat costs the server nothing.
        # Opening the Train tab also recounts the chat feedback waiting for review (the panel's label).
        train_page.select(
            lambda: (gr.Timer(active=True), review_handlers.panel_label(train)),
            None,
            [tab.timer, tab.review],
            queue=False,
            **PRIVATE,
        )
        # Opening the Chat or Compare tab shows the model serving now (another page may have swapped it).
        for page in (chat_page, compare_page):
            page.select(
                lambda: (gr.Timer(active=False), chat_handlers.serving_markdown(engine)),
                None,
                [tab.timer, status],
                queue=False,
                **PRIVATE,
            )
        tab.timer.tick(redraw, [tab.cache, session], live, queue=False, show_progress="hidden", **PRIVATE)
        for event in tab.actions:  # show what an action did at once, not at the next tick
            event.success(redraw, [tab.cache, session], live, queue=False, show_progress="hidden", **PRIVATE)

        def on_page_load(token: str | None, profile: gr.OAuthProfile | None):
            # The model is shared: show what is serving now whenever a page opens, and re-attach
            # to the latest run.
            return (
                chat_handlers.serving_markdown(engine),
                auth.login_markdown(train.auth, token, profile),
                review_handlers.panel_label(train),
                *redraw(None, token, profile),
            )

        demo.load(on_page_load, session, [status, tab.auth, tab.review, *live], queue=False, **PRIVATE)
    # After every event gradio's queue recomputes its monitoring dashboard's summary with pandas over its
    # last 10,000 events, monitoring on or off: 21 ms of the server's time per event once 10,000 have run
    # (8 ms for the first hundred; 2-core Xeon), paid by every reply through /chat (docs/chat-benchmarks.md).
    # Its one knob, read when the queue is made: events between two summaries. Monitoring is off
    # (LAUNCH_OPTIONS), so nothing reads them; an operator's own value wins.
    os.environ.setdefault("GRADIO_ANALYTICS_CACHE_FREQUENCY", str(2**62))
    demo.queue(max_size=QUEUE_MAX_SIZE, default_concurrency_limit=CONCURRENCY)
    demo.chat_interface = chat.chat  # for tests and for code that wires more events to the chat
    demo.compare = compare  # the Compare tab's model slot and components (tests)
    return demo


def launch_options(engine: ChatEngine, behind_proxy: bool, api_config: api.ApiConfig | None = None) -> dict:
    """``demo.launch()``'s arguments wherever the app is launched: ``python app.py``, ``gradio
    app.py`` (which runs ``python app.py`` and reloads into the same server) and a Space (which
    runs app.py too). ``behind_proxy``: the login settings' switch (``auth.AuthConfig``).

    Adds the HTTP edge (api/), installed on gradio's FastAPI app: the OpenAI-compatible routes on
    ``engine`` (keys from PERSONA_CHAT_API_KEYS unless ``api_config`` gives them; one proxy switch
    for both) and a bound on
    every request body. Server-side rendering stays off: it puts a Node server in front that
    passes only gradio's own paths to Python, so /v1 would never arrive (gradio turns it on when
    GRADIO_SSR_MODE=true, as Spaces may set it)."""
    clients.socket_addresses_only()  # uvicorn must not take a client's own X-Forwarded-For as its address
    config = replace(api_config, behind_proxy=behind_proxy) if api_config else api.ApiConfig.from_env(behind_proxy)
    app_kwargs = api.app_kwargs(engine, config)  # a fresh dict each launch: gradio writes into it
    # Inside the body bound (outermost): no lone surrogate in a request reaches gradio or the API.
    app_kwargs["middleware"].append(Middleware(DropLoneSurrogates))
    return {**LAUNCH_OPTIONS, "ssr_mode": False, "app_kwargs": app_kwargs}


_demo: gr.Blocks | None = None


def __getattr__(name: str):
    """``app.demo`` (what Spaces and ``gradio app.py`` look for), built with the engine on first use."""
    global _demo
    if name == "demo":
        if _demo is None:
            _demo = build_demo(start_engine())
            web_uploads.start_cleaner()
        return _demo
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def start_engine() -> ChatEngine:
    """The served model, said in one line: what serves and how fast it was ready, or (offline)
    why the demo model serves instead. The model a trainer loaded before a restart serves again
    (webui/server_state.py). No progress bars: a model on disk loads in a second."""
    transformers.utils.logging.disable_progress_bar()  # "Loading weights: 100%|██████████|" per load
    started = time.perf_counter()
    saved = server_state.saved_serving()
    if saved:
        try:
            engine = ChatEngine(load_apart(saved), f"serving {saved}")
            engine.warm_up()
            log.info(
                "serving %s, loaded by a trainer before the restart (%.1f s)", saved, time.perf_counter() - started
            )
            return engine
        except Exception as err:  # noqa: BLE001 - e.g. the run was deleted: serve CHAT_MODEL, and say why
            log.warning("cannot serve %s, loaded by a trainer before the restart (%s); serving CHAT_MODEL", saved, err)
    engine = ChatEngine.start()
    ready = f"(model ready in {time.perf_counter() - started:.1f} s)"
    if engine.fallback:
        log.warning("%s %s", engine.fallback, ready)
    else:
        log.info("%s %s", engine.status, ready)
    return engine


if __name__ == "__main__":
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    logging.getLogger("httpx").setLevel(logging.WARNING)  # gradio's own start-up requests, one line each
    engine = start_engine()
    demo = build_demo(engine)
    web_uploads.start_cleaner()  # gradio's upload folder and the app's copies, every 10 s
    # GRADIO_SERVER_NAME / GRADIO_SERVER_PORT are read by gradio itself
    demo.launch(**launch_options(engine, clients.behind_proxy()))
