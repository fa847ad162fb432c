"""Which models the API serves, by public id (``GET /v1/models``, the ``model`` of a request)."""

from __future__ import annotations

from pathlib import Path

from chat.layout import DEMO_DIR, FINAL

DEMO_ID = "persona-chat-demo"  # the bundled tiny demo model (served offline)


def model_id(spec: str) -> str:
    """A model's public id, never a server path: a Hub id or preset as it is, a run's ``RUN/final``
    folder as ``RUN``, another folder by its name, the bundled demo model as ``DEMO_ID``."""
    path = Path(spec)
    if not (path.is_absolute() or path.exists()):
        return spec
    path = path.resolve()
    if path == DEMO_DIR:
        return DEMO_ID
    return path.parent.name if path.name == FINAL else path.name


def servable(engine) -> list[str]:
    """The model ids a request may name, first the one serving now (a ``chat.engine.ChatEngine``).
    Today that is the served model alone; LoRA adapters loaded on it (issue 25) belong here too."""
    return [model_id(engine.current.name)]
