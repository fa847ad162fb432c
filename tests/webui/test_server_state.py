"""webui.server_state: what the app keeps across a restart (issue 28, item 13): the key of the values
browsers store (saved chats, their settings, the login token) and the model a trainer chose."""

from __future__ import annotations

import logging
import shutil
import stat

import pytest

from chat.engine import DEMO_DIR, ChatEngine, load_checkpoint
from chat.layout import ROOT
from webui import auth, server_state


@pytest.fixture
def state(tmp_path, monkeypatch):
    folder = tmp_path / "state"
    monkeypatch.setenv(server_state.STATE_ENV, str(folder))
    monkeypatch.delenv(server_state.KEY_ENV, raising=False)
    monkeypatch.delenv("CHAT_MODEL", raising=False)
    return folder


def test_the_browser_key_is_made_once_and_kept_private(state):
    key = server_state.browser_key()
    assert len(key) >= 32 and server_state.browser_key() == key  # the same key at the next start
    path = state / server_state.KEY_FILE
    assert stat.S_IMODE(path.stat().st_mode) == 0o600 and stat.S_IMODE(state.stat().st_mode) == 0o700
    path.chmod(0o644)  # a copy others could read is made private again
    assert server_state.browser_key() == key and stat.S_IMODE(path.stat().st_mode) == 0o600


def test_a_key_from_the_environment_wins(state, monkeypatch):
    monkeypatch.setenv(server_state.KEY_ENV, "a-space-secret-of-some-length")
    assert server_state.browser_key() == "a-space-secret-of-some-length"
    assert not (state / server_state.KEY_FILE).exists()


def test_the_state_folder_is_never_in_the_repository_or_what_gradio_serves(monkeypatch, tmp_path):
    from gradio.utils import get_upload_folder

    for inside in (ROOT / "runs" / "state", f"{get_upload_folder()}/state"):
        monkeypatch.setenv(server_state.STATE_ENV, str(inside))
        with pytest.raises(ValueError, match="inside"):
            server_state.browser_key()
    monkeypatch.delenv(server_state.STATE_ENV)
    monkeypatch.setenv("XDG_STATE_HOME", str(tmp_path / "xdg"))
    assert server_state.state_dir() == (tmp_path / "xdg" / "persona-chat").resolve()


def test_every_browser_store_of_the_app_uses_the_kept_key(state, tmp_path):
    import app

    engine = ChatEngine(load_checkpoint(str(DEMO_DIR), optimize="none"), "serving demo")
    stores = {}
    for build in ("first", "after a restart"):
        config = app.build_demo(engine).get_config_file()
        found = [c["props"] for c in config["components"] if c["type"] == "browserstate"]
        stores[build] = {props["storage_key"]: props["secret"] for props in found}
    # the login token, each saved chat's settings, and ChatInterface's saved chats: the same names and key
    assert set(stores["first"]) == {
        "persona-chat-login",
        "persona-chat-saved-chat-settings",
        "persona-chat-saved-chats",
    }
    assert set(stores["first"].values()) == {server_state.browser_key()}
    assert stores["after a restart"] == stores["first"]


def test_the_served_models_choice_is_kept_unless_chat_model_changed(state, monkeypatch):
    assert server_state.saved_serving() is None
    server_state.save_serving("/srv/runs/r1/final")
    assert server_state.saved_serving() == "/srv/runs/r1/final"
    assert stat.S_IMODE((state / server_state.SERVING_FILE).stat().st_mode) == 0o600
    monkeypatch.setenv("CHAT_MODEL", "someone/new-model")  # the operator's newer choice wins
    assert server_state.saved_serving() is None


def test_a_restart_serves_the_model_a_trainer_loaded(state, tmp_path, caplog):
    import app

    run = tmp_path / "runs" / "r1" / "final"
    shutil.copytree(DEMO_DIR, run)
    server_state.save_serving(str(run))
    with caplog.at_level(logging.INFO, logger="app"):
        engine = app.start_engine()
    assert engine.current.name == str(run) and "loaded by a trainer before the restart" in caplog.text
    shutil.rmtree(run)  # gone since: CHAT_MODEL (here offline: the demo model), and the log says why
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="app"):
        engine = app.start_engine()
    assert engine.current.name != str(run) and f"cannot serve {run}" in caplog.text


def test_a_login_that_ended_says_so():
    config = auth.AuthConfig(password="pw")
    assert "Log in** with the password" in auth.login_markdown(config, None)
    ended = auth.login_markdown(config, "a-token-from-before-the-restart")
    assert "Your login has ended" in ended and "the server restarted" in ended
