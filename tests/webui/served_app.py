"""The app launched in-process for tests (offline, 127.0.0.1, the bundled demo model), and a
client session that can call its private endpoints."""

from __future__ import annotations

import os
from pathlib import Path

from gradio_client import Client

from chat.engine import DEMO_DIR, ChatEngine, load_apart
from finetune.jobs.command import free_port
from webui import auth, train_handlers


class App:
    """A launched app with its own runs root, data root and engine."""

    def __init__(self, root: Path, config: auth.AuthConfig, port: int | None = None, as_started: bool = False):
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
        _, self.url, _ = self.demo.launch(
            server_name="127.0.0.1",
            server_port=port or free_port(),
            prevent_thread_lock=True,
            quiet=True,
            **app.LAUNCH_OPTIONS,
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
        out = self.client.predict(*args, fn_index=fn_index)
        if api_name in ("train_login", "train_logout"):
            self.token, *rest = out
            return tuple(rest)
        return out
