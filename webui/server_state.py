"""What the app keeps across a restart: the key of the values it stores in browsers, and the served
model a trainer chose.

Gradio encrypts every ``gr.BrowserState`` (the saved chats, their settings, the login token) with a
key made at each server start unless one is given, so a restart silently emptied every visitor's
saved chats and logged the trainer out; and the model a trainer loaded gave way to ``CHAT_MODEL``
again. Both now live in the state folder: ``PERSONA_CHAT_STATE``, by default
``$XDG_STATE_HOME/persona-chat`` (``~/.local/state/persona-chat``), made 0700 with files 0600, and
refused inside the repository (a Space serves its files; a clone could commit them) or inside the
folder gradio serves uploads from. On a Space, whose disk a restart resets, set the secret
``PERSONA_CHAT_BROWSER_KEY`` to keep the key.

The key is no secret from visitors: gradio hands it to every page, which decrypts in the browser.
It keeps stored values readable across restarts, nothing more (the login token it carries is checked
against the server's live logins, which a restart ends: the page then says so).
"""

from __future__ import annotations

import json
import logging
import os
import secrets
from pathlib import Path

from chat.layout import ROOT

log = logging.getLogger(__name__)

STATE_ENV = "PERSONA_CHAT_STATE"
KEY_ENV = "PERSONA_CHAT_BROWSER_KEY"
KEY_FILE = "browser-state.key"
SERVING_FILE = "serving.json"


def state_dir() -> Path:
    """The state folder (made 0700 when missing); ValueError where it must not be."""
    from gradio.utils import get_upload_folder

    default = Path(os.environ.get("XDG_STATE_HOME") or Path.home() / ".local" / "state") / "persona-chat"
    folder = Path(os.environ.get(STATE_ENV) or default).expanduser().resolve()
    for forbidden, what in ((ROOT, "the repository"), (Path(get_upload_folder()).resolve(), "gradio's upload folder")):
        if folder.is_relative_to(forbidden):
            raise ValueError(f"{STATE_ENV} ({folder}) is inside {what}: choose a folder outside it")
    folder.mkdir(mode=0o700, parents=True, exist_ok=True)
    return folder


def _write_private(path: Path, text: str) -> None:
    """``text`` into ``path``, whole (a rename) and readable by this user only."""
    tmp = path.with_name(f".{path.name}.{secrets.token_hex(4)}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        with os.fdopen(fd, "w") as fh:
            fh.write(text)
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)


def browser_key() -> str:
    """The key of the app's browser-stored values: ``PERSONA_CHAT_BROWSER_KEY``, else the state
    folder's key file (made on first use; a copy others could read is made private again)."""
    if os.environ.get(KEY_ENV):
        return os.environ[KEY_ENV]
    path = state_dir() / KEY_FILE
    if not path.is_file():
        _write_private(path, secrets.token_urlsafe(32))
        log.info("made the key of the browser-stored values (saved chats, logins): %s", path)
    if path.stat().st_mode & 0o077:
        path.chmod(0o600)
    key = path.read_text().strip()
    if len(key) < 16:
        raise ValueError(f"{path}: not a key (delete it to make a new one; saved chats in browsers are then lost)")
    return key


def save_serving(spec: str) -> None:
    """Remember the model a trainer loaded (with the CHAT_MODEL it replaced: a deployment that
    changes CHAT_MODEL means its own choice, see ``saved_serving``). A failure only costs the memory."""
    record = {"model": spec, "chat_model": os.environ.get("CHAT_MODEL")}
    try:
        _write_private(state_dir() / SERVING_FILE, json.dumps(record))
    except (OSError, ValueError) as err:
        log.warning("cannot remember the served model (%s): a restart serves CHAT_MODEL again", err)


def saved_serving() -> str | None:
    """The model a trainer loaded before the last restart, unless CHAT_MODEL changed since (the
    operator's newer choice), or nothing was saved."""
    try:
        record = json.loads((state_dir() / SERVING_FILE).read_text())
    except (OSError, ValueError):
        return None
    if not isinstance(record, dict) or not isinstance(record.get("model"), str):
        return None
    return record["model"] if record.get("chat_model") == os.environ.get("CHAT_MODEL") else None
