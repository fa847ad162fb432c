"""The app's HTTP edge beside the Gradio UI (``webui/``): the OpenAI-compatible API (issue 26) and
the bound on every request body, installed on gradio's own FastAPI app, so they share its server
and port.

gradio builds that FastAPI app in ``launch()`` (a new one each launch), from ``app_kwargs``: the
middleware and routes go in there (``app.launch_options``), which is how ``python app.py``,
``gradio app.py`` and a Space (all three launch through app.py) get them. The routes are matched
before gradio's own. Nothing here imports gradio or ``webui/``: the API reaches the bot through
``chat/`` only.
"""

from __future__ import annotations

from starlette.middleware import Middleware

from api.access import ApiConfig
from api.limits import BodyLimit
from api.routes import Api

__all__ = ["Api", "ApiConfig", "app_kwargs"]


def app_kwargs(engine, config: ApiConfig) -> dict:
    """``launch(app_kwargs=...)`` for an app around ``engine`` (a ``chat.engine.ChatEngine``): a
    fresh dict each time (gradio adds to it)."""
    return {"middleware": [Middleware(BodyLimit)], "routes": Api(engine, config).routes()}
