"""The app's HTTP edge beside the Gradio UI (``webui/``): the OpenAI-compatible API and the bound
on every request body, installed on gradio's own FastAPI app, so they share its server and port.

gradio builds that FastAPI app in ``launch()`` (a new one each launch), from ``app_kwargs``: the
middleware and routes go in there (``app.launch_options``), which is how ``python app.py``,
``gradio app.py`` and a Space (all three launch through app.py) get them. Nothing here imports
gradio or ``webui/``: the API reaches the bot through ``chat/`` only.
"""

from __future__ import annotations

from starlette.middleware import Middleware

from api.limits import BodyLimit


def app_kwargs() -> dict:
    """``launch(app_kwargs=...)``: what gradio's FastAPI app is built with."""
    return {"middleware": [Middleware(BodyLimit)]}
