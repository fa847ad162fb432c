"""webui.refusals: why a page's last action was refused, kept for the line the page shows it in."""

from __future__ import annotations

import inspect

import gradio as gr
import pytest

from webui.refusals import Refusals, text


def page(name: str) -> gr.Request:
    return gr.Request(session_hash=name)  # what gradio hands a handler of that page


def test_a_refusal_is_shown_once_on_its_own_page():
    refusals = Refusals()
    a, b = page("a"), page("b")
    refusals.note(a, "⚠️ Wrong password.")
    assert refusals.show(b) == ""  # another page sees nothing
    assert refusals.show(a) == "⚠️ Wrong password."
    assert refusals.show(a) == ""  # once: a later success does not show it again
    refusals.note(None, "nobody")  # no page (a call without a request) is ignored
    assert refusals.show(None) == ""


def test_refusals_are_bounded():
    refusals = Refusals(capacity=3)
    for i in range(5):
        refusals.note(page(str(i)), f"refused {i}")
    assert [refusals.show(page(str(i))) for i in range(5)] == ["", "", "refused 2", "refused 3", "refused 4"]


def test_noted_keeps_the_signature_notes_and_raises():
    refusals = Refusals()

    @refusals.noted
    def handler(token, value, request: gr.Request):
        if value < 0:
            raise gr.Error("must be at least 0", title="Cannot start a run")
        return value

    assert list(inspect.signature(handler).parameters) == ["token", "value", "request"]  # what gradio reads
    request = page("p")
    assert handler(None, 1, request) == 1 and refusals.show(request) == ""
    with pytest.raises(gr.Error):
        handler(None, -1, request=request)
    assert refusals.show(request) == "⚠️ **Cannot start a run:** must be at least 0"


def test_text_drops_gradios_default_title():
    assert text(gr.Error("Wrong password.")) == "⚠️ Wrong password."
    assert text(gr.Error("Wrong password.", title="Cannot log in")) == "⚠️ **Cannot log in:** Wrong password."
