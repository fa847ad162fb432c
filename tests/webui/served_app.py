"""The app launched in-process for tests (offline, 127.0.0.1, the bundled demo model), and a
client session that can call its private endpoints."""

from __future__ import annotations

import json
import os
import uuid
from pathlib import Path

import httpx
from gradio_client import Client

from chat.engine import DEMO_DIR, ChatEngine, load_apart
from finetune.jobs.command import free_port
from webui import auth, train_handlers


class App:
    """A launched app with its own runs root, data root and engine; ``api_config``: the API's
    settings (``api.ApiConfig``; default: from the environment, as the app reads them)."""

    def __init__(
        self, root: Path, config: auth.AuthConfig, api_config=None, port: int | None = None, as_started: bool = False
    ):
        """``port``: a given one (a restart keeps the address, and with it the browsers' storage);
        ``as_started``: the served model chosen as ``python app.py`` chooses it (app.start_engine:
        the one a trainer loaded before a restart), else the demo model."""
        import app

        self.runs, self.data = root / "runs", root / "uploads"
        self.saved = {k: os.environ.get(k) for k in ("PERSONA_CHAT_RUNS", "PERSONA_CHAT_DATA")}
        os.environ.update(PERSONA_CHAT_RUNS=str(self.runs), PERSONA_CHAT_DATA=str(self.data))
        # Loaded as the app loads (chat.engine.load_apart), not in the test's long-lived thread.
        if as_started:
            self.engine = app.start_engine()
        else:
            self.engine = ChatEngine(load_apart(str(DEMO_DIR), optimize="none"), f"serving {DEMO_DIR}")
        self.tab = train_handlers.TrainTab.create(auth=config, runs_root=self.runs)
        self.demo = app.build_demo(self.engine, self.tab)
        options = app.launch_options(self.engine, config.behind_proxy, api_config)
        _, self.url, _ = self.demo.launch(
            server_name="127.0.0.1", server_port=port or free_port(), prevent_thread_lock=True, quiet=True, **options
        )

    def close(self):
        self.demo.close()
        for key, value in self.saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value


def serve(tmp_path_factory, name: str, password: str):
    """A module fixture's body: the app in a fresh folder ``name`` with TRAIN_PASSWORD ``password``,
    closed when the fixture ends."""
    served = App(tmp_path_factory.mktemp(name), auth.AuthConfig(password=password))
    yield served
    served.close()


class Caller:
    """A gradio_client session that also calls private endpoints (what a crafted request can do).

    Like a browser, it keeps the login token (the app's gr.BrowserState) and sends it as the first
    input of every endpoint that takes it; train_login / train_logout update it and return the rest."""

    TIMEOUT = 300  # seconds an event may take: a model load on a slow CI minute fits

    def __init__(self, url: str, token: str | None = None):
        self.client = Client(url, verbose=False)
        self.token = token
        for endpoint in self.client.endpoints.values():
            endpoint.is_valid = True  # the client-side check only; the server decides
        types = {c["id"]: c.get("type") for c in self.client.config["components"]}
        self._takes_token = {
            d["id"]
            for d in self.client.config["dependencies"]
            if d.get("inputs") and types.get(d["inputs"][0]) == "browserstate"
        }

    def __call__(self, api_name: str, *args):
        fn_index = next(d["id"] for d in self.client.config["dependencies"] if d.get("api_name") == api_name)
        if fn_index in self._takes_token:
            args = (self.token, *args)
        job = self.client.submit(*args, fn_index=fn_index)
        try:
            out = job.result(timeout=self.TIMEOUT)
        except TimeoutError:  # a stalled event fails its test, saying which, instead of hanging the suite
            raise TimeoutError(f"{api_name} gave no answer in {self.TIMEOUT} s") from None
        if api_name in ("train_login", "train_logout"):
            self.token, *rest = out
            return tuple(rest)
        return out


def raw_event(caller: Caller, api_name: str, *args, event_data=None, timeout: float = 60) -> tuple[bool, object]:
    """One queued event of ``caller``'s session, sent as a page's script sends it: JSON with \\u
    escapes, so text a client library refuses to encode (a lone surrogate) arrives as written, and
    with the event data the browser adds (``event_data``). ``args`` are the inputs without the
    session's State components (the server keeps those), the login token first where the endpoint
    takes one. Returns (success, the outputs or the error message); an event stream that ends
    without answering raises (httpx.RemoteProtocolError when the server dropped it)."""
    client = caller.client
    dependency = next(d for d in client.config["dependencies"] if d.get("api_name") == api_name)
    types = {c["id"]: c.get("type") for c in client.config["components"]}
    given = iter(args)
    data = [None if types.get(i) == "state" else next(given) for i in dependency["inputs"]]
    body = {"data": data, "event_data": event_data, "fn_index": dependency["id"], "session_hash": client.session_hash}
    base = client.src.rstrip("/") + "/gradio_api"
    with httpx.Client(timeout=timeout) as http:
        joined = http.post(
            f"{base}/queue/join", content=json.dumps(body).encode("ascii"), headers={"content-type": "application/json"}
        )
        joined.raise_for_status()
        event_id = joined.json()["event_id"]
        with http.stream("GET", f"{base}/queue/data", params={"session_hash": client.session_hash}) as stream:
            for line in stream.iter_lines():
                message = json.loads(line[5:]) if line.startswith("data:") else {}
                if message.get("event_id") == event_id and message.get("msg") == "process_completed":
                    output = message.get("output") or {}
                    return bool(message.get("success")), output.get("data") if message.get("success") else output.get(
                        "error"
                    )
    raise AssertionError(f"{api_name}: the event stream ended without an answer")


def http_from(app: App, address: str = "127.0.0.1", **kwargs) -> httpx.Client:
    """An HTTP client of ``app`` whose connections come from ``address`` (any 127.0.0.x is this
    machine): as many distinct clients as a test needs, each with its own socket address."""
    transport = httpx.HTTPTransport(local_address=address)
    return httpx.Client(base_url=app.url, transport=transport, timeout=30, **kwargs)


def fn_index(app: App, api_name: str) -> int:
    config = httpx.get(app.url + "config", timeout=10).json()
    return next(d["id"] for d in config["dependencies"] if d.get("api_name") == api_name)


def run_predict(http: httpx.Client, fn: int, data: list, forged: str | None = None, session: str | None = None):
    """One unqueued event as a browser sends it (login, page load); ``forged``: the address it
    claims in X-Forwarded-For."""
    headers = {"x-forwarded-for": forged} if forged else {}
    return http.post(
        "gradio_api/run/predict",
        headers=headers,
        json={"fn_index": fn, "data": data, "session_hash": session or uuid.uuid4().hex[:11]},
    )
