"""Shared fixtures: everything offline, the tiny preset built once per session."""

import os
from pathlib import Path

import pytest

# Offline and isolated before any Hugging Face library is imported by a test module.
os.environ["HF_HUB_OFFLINE"] = "1"
os.environ["HF_DATASETS_OFFLINE"] = "1"
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


@pytest.fixture(scope="session", autouse=True)
def _isolated_cache(tmp_path_factory):
    """Build presets into a fresh cache so the tests exercise the build itself."""
    cache = tmp_path_factory.mktemp("persona-chat-cache")
    os.environ["PERSONA_CHAT_CACHE"] = str(cache)
    yield cache


@pytest.fixture(scope="session")
def tiny_path(_isolated_cache):
    from chat.model import resolve

    return Path(resolve("tiny"))


@pytest.fixture(scope="session")
def tiny_tokenizer(tiny_path):
    from chat.model import load_tokenizer

    return load_tokenizer(str(tiny_path))
