"""Issue 28 item 1: a client's address comes from its socket unless the app is told it is behind
a proxy. Against the running app, from loopback clients that forge X-Forwarded-For: the login
lockout, the right password during a lockout and the per-visitor feedback cap hold. Behind a
proxy (the mode a Space runs in) the address is the entry the proxy appended, and only that one.

uvicorn trusts X-Forwarded-For from 127.0.0.1 unless told otherwise, and gradio leaves that on:
before the fix every forged header here was a new client."""

import json

import pytest
from served_app import App, Caller, fn_index, http_from, run_predict

from finetune import feedback
from finetune.feedback import FeedbackStore
from webui import auth, chat_handlers

PASSWORD = "forged-address-tests"
FORGED = [f"198.51.100.{i}" for i in range(1, 250)]  # what an attacker claims to be
SETTINGS = ("fast", *chat_handlers.preset_values("fast")[:4], 16, 0)  # preset, beams, sample, temp, top-p, max, seed


@pytest.fixture(scope="module")
def app(tmp_path_factory):
    served = App(tmp_path_factory.mktemp("forged"), auth.AuthConfig(password=PASSWORD))
    yield served
    served.close()


@pytest.fixture(scope="module")
def proxied(tmp_path_factory):
    """The app told it is behind a proxy (PERSONA_CHAT_BEHIND_PROXY=1, or a Space)."""
    served = App(tmp_path_factory.mktemp("proxied"), auth.AuthConfig(password=PASSWORD, behind_proxy=True))
    yield served
    served.close()


def login(app: App, password: str, source: str = "127.0.0.1", forged: str | None = None) -> str:
    """The login endpoint's whole answer (reply or error) as text."""
    with http_from(app, source) as http:
        return json.dumps(run_predict(http, fn_index(app, "train_login"), [None, password], forged=forged).json())


def test_feedback_cap_is_per_socket_address_whatever_the_header_claims(app, monkeypatch):
    monkeypatch.setattr(feedback, "MAX_PENDING_PER_VISITOR", 2)
    caller = Caller(app.url)  # gradio_client, from 127.0.0.1
    notes = []
    for i in range(4):
        caller.client.headers["x-forwarded-for"] = FORGED[i]  # a "new visitor" for every rating
        caller("chat_ui", f"hello number {i}", "topic", "jazz", *SETTINGS)
        fn = next(d["id"] for d in caller.client.config["dependencies"] if d.get("api_name") == "rate_reply")
        send = caller.client.endpoints[fn].make_end_to_end_fn(caller.client.new_helper(fn, {"x-gradio-user": "api"}))
        notes.append(send(caller.token, event_data={"index": 2 * i + 1, "value": ["x"], "liked": True}))
    assert [n.startswith("Thanks") for n in notes] == [True, True, False, False], notes
    assert "waiting for review" in notes[2]
    rows = FeedbackStore(app.data / "feedback" / "feedback.sqlite3").rows()
    assert len(rows) == 2 and len({r.visitor for r in rows}) == 1  # one visitor: 127.0.0.1


def test_a_lockout_holds_across_forged_addresses_and_refuses_the_right_password(app):
    # Every guess claims another address; all come from 127.0.0.1 (uvicorn's trusted proxy by default).
    answers = [login(app, "guess", forged=FORGED[i]) for i in range(auth.MAX_FAILURES + 20)]
    assert sum("Wrong password" in a for a in answers) == auth.MAX_FAILURES, answers
    assert all("Too many wrong passwords" in a for a in answers[auth.MAX_FAILURES :])
    during = login(app, PASSWORD, forged=FORGED[-1])  # the right password from a "fresh" address
    assert "Too many wrong passwords" in during and "Logged in" not in during
    # The lockout is 127.0.0.1's alone: another socket address logs in at once.
    assert "Logged in" in login(app, PASSWORD, source="127.0.0.2", forged="127.0.0.1")


def test_behind_a_proxy_the_client_is_the_entry_the_proxy_appended(proxied):
    # A proxy appends the address it saw; whatever the client sent before it is the client's to forge.
    visitor, other = "203.0.113.9", "203.0.113.10"
    answers = [login(proxied, "guess", forged=f"{FORGED[i]}, {visitor}") for i in range(auth.MAX_FAILURES + 5)]
    assert sum("Wrong password" in a for a in answers) == auth.MAX_FAILURES
    assert all("Too many wrong passwords" in a for a in answers[auth.MAX_FAILURES :])
    assert "Too many wrong passwords" in login(proxied, PASSWORD, forged=visitor)
    # Another visitor behind the same proxy (same socket address) is not locked out.
    assert "Logged in" in login(proxied, PASSWORD, forged=f"{visitor}, {other}")
