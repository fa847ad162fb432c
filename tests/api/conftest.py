"""The API's tests launch the real app (tests/webui/served_app.py: in-process, 127.0.0.1, the
bundled demo model) and drive it with the official openai client."""

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "webui"))  # served_app

from served_app import App  # noqa: E402

from api.access import ApiConfig, ApiKeys  # noqa: E402
from webui import auth  # noqa: E402

KEYS = ("sk-persona-first-key", "sk-persona-second-key")


def serve(tmp_path_factory, name: str, config: ApiConfig):
    served = App(tmp_path_factory.mktemp(name), auth.AuthConfig(password="api-tests"), config)
    yield served
    served.close()


@pytest.fixture(scope="module")
def app(tmp_path_factory):
    """Open, as the chat is (no PERSONA_CHAT_API_KEYS), with the default capacity."""
    yield from serve(tmp_path_factory, "api", ApiConfig())


@pytest.fixture(scope="session")
def keys() -> tuple[str, ...]:
    return KEYS


@pytest.fixture(scope="module")
def keyed(tmp_path_factory):
    """With API keys, as PERSONA_CHAT_API_KEYS sets them."""
    yield from serve(tmp_path_factory, "api-keys", ApiConfig(keys=ApiKeys(KEYS)))
