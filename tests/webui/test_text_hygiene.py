"""Text hygiene at the server (issue 28 item 4), against the launched app: what a crafted request can
send that a page never would.

- A lone surrogate ("\\ud800") in any text input: every event is answered and the session's event
  stream lives on (it ended at the first output echoing the text: a corrected reply, the context
  box, gradio's own ChatInterface steps). webui/request_text.py removes them at the door.
- Terminal escape sequences and bidirectional overrides in a correction: stored and shown without.
- Events without their event data: a message meant for the user, never Python's.
- The login-only feedback export: never in a folder gradio serves to anyone who asks for its path.
"""

from __future__ import annotations

from pathlib import Path

import httpx
import pytest
from gradio_client.exceptions import AppError
from served_app import App, Caller, raw_event

from chat.prompt import CONTROL_RE
from finetune.feedback import FeedbackStore
from webui import auth, chat_handlers
from webui.request_text import clean_body, without_lone_surrogates
from webui.uploads import upload_folder

PERSONA = chat_handlers.CHAT_E_PERSONA
SETTINGS = ("fast", *chat_handlers.preset_values("fast")[:4], 24, 0)  # preset, beams, sample, temp, top-p, max, seed
PASSWORD = "hygiene-pw"
LONE = "x\ud800y\udfffz"
PYTHON_ERRORS = ("NoneType", "subscriptable", "previous_value", "KeyError", "TypeError", "Traceback")


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    app = App(tmp_path_factory.mktemp("hygiene"), auth.AuthConfig(password=PASSWORD))
    yield app
    app.close()


def chat(caller: Caller, message: str) -> str:
    return caller("chat_ui", message, "persona", PERSONA, *SETTINGS)[0]


def store(app: App) -> FeedbackStore:
    return FeedbackStore(Path(app.data) / "feedback" / "feedback.sqlite3")


def shown(chatbot) -> list[str]:
    return [part["text"] for message in chatbot for part in message["content"]]


def test_the_door_removes_lone_surrogates_and_keeps_everything_else():
    assert without_lone_surrogates({"a\ud800": ["b\udc00c", 1, None, {"d": "😀\udbff"}]}) == {
        "a": ["bc", 1, None, {"d": "😀"}]
    }
    assert clean_body(b'{"data": ["x\\ud800y", "\\ud83d\\ude00"]}') == '{"data": ["xy", "😀"]}'.encode()
    for body in (b'{"data": ["plain", "\\u00e9"]}', b"not json \\ud800", b'{"data": ["\\\\ud800 as text"]}'[:0]):
        assert clean_body(body) == body  # no surrogate escape, or not JSON: untouched


def test_a_lone_surrogate_in_a_reply_edit_keeps_the_session_answering(served):
    caller = Caller(served.url)
    first = chat(caller, "hi! who are you?")
    dirty = f"i am {LONE} \x1b[31mChat-E\x1b[0m \u202esdrawkcab\u202c"
    ok, (chatbot, _, _, note, *_) = raw_event(
        caller, "edit_message", None, event_data={"index": 1, "value": dirty, "previous_value": first}
    )
    assert ok, note
    assert shown(chatbot)[1] == "i am xyz Chat-E sdrawkcab"  # what is stored is what is shown
    row = store(served).rows()[0]
    assert row.response == "i am xyz Chat-E sdrawkcab" and row.turns == ["hi! who are you?"]
    assert chat(caller, "nice to meet you!")  # the same session goes on


def test_no_text_input_with_a_lone_surrogate_ends_an_event_stream(served):
    """Every queued endpoint of the page that takes text, each text input set to a lone surrogate."""
    caller = Caller(served.url)
    chat(caller, "hello there")
    config = caller.client.config
    components = {c["id"]: c for c in config["components"]}
    tried = []
    for dependency in config["dependencies"]:
        kinds = [components[i].get("type") for i in dependency.get("inputs") or []]
        if not dependency.get("api_name") or not {"textbox", "dropdown", "chatbot"} & set(kinds):
            continue
        args = [
            LONE if kind in ("textbox", "dropdown") else components[i].get("props", {}).get("value")
            for i, kind in zip(dependency["inputs"], kinds)
            if kind != "state"
        ]
        ok, answer = raw_event(caller, dependency["api_name"], *args, timeout=60)  # raises if the stream ends
        assert "\ud800" not in repr(answer) and "surrogates not allowed" not in str(answer), dependency["api_name"]
        tried.append(dependency["api_name"])
    assert {"chat_ui", "_append_message_to_history", "compare_send", "load_model", "train_login"} <= set(tried)
    assert chat(caller, "still here?")


def test_events_without_their_data_get_a_message_not_a_python_error(served):
    caller = Caller(served.url)
    reply = chat(caller, "do you like dogs?")
    for api_name, event, expected in (
        ("rate_reply", None, None),  # no rating at all: nothing to do, nothing said
        ("rate_reply", {"liked": True}, "that reply is not in this chat"),
        ("edit_message", None, "that message is not in this chat"),
        ("edit_message", {"index": "one", "value": None}, "that message is not in this chat"),
        ("edit_message", {"index": 1}, "a reply cannot be empty"),
    ):
        ok, answer = raw_event(caller, api_name, None, event_data=event)
        assert ok and not any(e in repr(answer) for e in PYTHON_ERRORS), answer
        note = answer[0] if api_name == "rate_reply" else answer[3]
        assert note == {"__type__": "update"} if expected is None else expected in note.lower(), note
    # an edit without previous_value (the handler never needed it) saves the correction
    ok, answer = raw_event(caller, "edit_message", None, event_data={"index": 1, "value": "i love dogs!"})
    assert ok and answer[3].startswith("Thanks — ✏️ correction saved"), answer
    assert store(served).rows()[0].original == reply
    # the review table's row selection, logged in, without event data or with a forged row
    caller("train_login", PASSWORD)
    for event in (None, {"row_value": None}, {"row_value": ["abc"]}, {"row_value": "7"}):
        ok, message = raw_event(caller, "review_row", caller.token, "chatbot: ", event_data=event)
        assert not ok and "select a row" in message and not any(e in message for e in PYTHON_ERRORS), message


def test_what_the_page_shows_of_a_stored_row_has_no_control_text(served):
    caller = Caller(served.url)
    chat(caller, "tell me a secret \x1b]0;owned\x07 \u2066now\u2069")
    ok, answer = raw_event(caller, "edit_message", None, event_data={"index": 1, "value": "\x1b[2Jcleared?"})
    assert ok and shown(answer[0])[1] == "cleared?"
    row = store(served).rows()[0]
    assert row.turns == ["tell me a secret now"]
    assert not any(CONTROL_RE.search(text) for text in (*row.turns, row.response, row.context))


def test_the_export_reaches_the_logged_in_trainer_and_no_anonymous_request(served):
    rows = store(served)
    secret = "a correction only the trainer may read"
    for i in range(3):
        rows.add(kind="none", context="", turns=[f"hi {i}"], response=f"{secret} {i}", rating="like",
                 visitor="v", status="accepted")  # fmt: skip
    visitor, trainer = Caller(served.url), Caller(served.url)
    with pytest.raises(AppError, match="log in first"):
        visitor("review_export")
    trainer("train_login", PASSWORD)
    download, note = trainer("review_export")
    assert f"{secret} 2" in download["text"] and len(download["text"].splitlines()) == 3
    assert note.startswith("Exported 3 accepted rows") and download["name"] in note
    # The rows' file on the server: under the data root, which gradio never serves.
    (kept,) = (served.data / "feedback" / "exports").glob("accepted-*/train.jsonl")
    assert kept.read_text() == download["text"]
    files = served.url.rstrip("/") + "/gradio_api/file="
    refused = httpx.get(files + str(kept.resolve()), timeout=10)
    assert refused.status_code == 403 and secret not in refused.text
    # ... and no copy of the rows in gradio's folders, whose files it serves to any request that
    # names one (which is why an export written there was readable by anyone with its path).
    served_dirs = [upload_folder(), Path(".gradio").resolve()]
    leaked = [
        p for d in served_dirs if d.is_dir() for p in d.rglob("*") if p.is_file() and secret.encode() in p.read_bytes()
    ]
    assert leaked == []
    control = upload_folder() / "control" / "probe.txt"  # the route serves that folder: the 403 is meaningful
    control.parent.mkdir(parents=True, exist_ok=True)
    control.write_text("served")
    try:
        assert httpx.get(files + str(control), timeout=10).text == "served"
    finally:
        control.unlink()
