"""Which models the API serves, by public id (``GET /v1/models``, the ``model`` of a request).

The ids are the chat's own (``chat.loading.model_id``, never a server path): the base serving now,
then the LoRA adapters loaded on it (``ChatEngine.model_ids``). A request naming an adapter is
answered by that adapter on the shared base, as a chat that started with it is.
"""

from __future__ import annotations

from chat.layout import DEMO_DIR
from chat.loading import model_id

DEMO_ID = model_id(str(DEMO_DIR))  # the bundled tiny demo model (served offline): "demo-model"

__all__ = ["DEMO_ID", "model_id", "servable"]


def servable(engine) -> list[str]:
    """The model ids a request may name (a ``chat.engine.ChatEngine``), first the one serving now."""
    ids = engine.model_ids()
    current = engine.current.id
    return [current, *(i for i in ids if i != current)]
