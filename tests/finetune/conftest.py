"""Fixtures of the finetune/jobs tests (helpers are in jobs_helpers.py)."""

import pytest


@pytest.fixture
def roots(tmp_path, monkeypatch):
    """An isolated runs root and upload dir, as the app would configure them."""
    runs, uploads = tmp_path / "runs", tmp_path / "uploads"
    uploads.mkdir()
    monkeypatch.setenv("PERSONA_CHAT_RUNS", str(runs))
    monkeypatch.setenv("PERSONA_CHAT_DATA", str(uploads))
    return runs, uploads
