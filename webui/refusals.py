"""Why the last action of a page was refused, for a line on the page itself.

A handler refuses with ``gr.Error`` (API clients get it as their error), but a browser shows the
error of an unqueued event (the login) only as a red "Error" badge, without the reason, and that
of a queued one (Start, Stop, a review action) in a toast that goes away while the line that
says what the last action did stays as it was ("Started run ..."). So the tab's wrapper of each
such handler notes the refusal here, keyed by the page's session, before it raises; the event's
``.failure`` step reads it back into the line under the button (``show``).

Bounded: the newest ``capacity`` pages' refusals are kept, each until it is shown.
"""

from __future__ import annotations

import functools
import threading
from collections import OrderedDict

import gradio as gr

MAX_PAGES = 1000


def text(err: gr.Error) -> str:
    """A refusal as the page shows it: "⚠️ **Cannot start a run:** the reason"."""
    if err.title and err.title != "Error":  # gr.Error's default title says nothing
        return f"⚠️ **{err.title}:** {err.message}"
    return f"⚠️ {err.message}"


class Refusals:
    """Each page's latest refusal (thread-safe, bounded)."""

    def __init__(self, capacity: int = MAX_PAGES):
        self.capacity = capacity
        self._by_page: OrderedDict[str, str] = OrderedDict()
        self._lock = threading.Lock()

    @staticmethod
    def _page(request) -> str | None:
        page = getattr(request, "session_hash", None)
        return page if isinstance(page, str) and page else None

    def note(self, request: gr.Request | None, message: str) -> None:
        page = self._page(request)
        if page is None:
            return
        with self._lock:
            self._by_page.pop(page, None)
            self._by_page[page] = message
            while len(self._by_page) > self.capacity:
                self._by_page.popitem(last=False)

    def show(self, request: gr.Request) -> str:
        """The page's latest refusal, once ("" when there is none, e.g. an error gradio raised itself)."""
        page = self._page(request)
        with self._lock:
            return self._by_page.pop(page, "") if page else ""

    def noted(self, handler):
        """``handler`` (one of whose parameters is a ``gr.Request``) noting any ``gr.Error`` it
        raises, which it raises still. The signature is kept: gradio reads it."""

        @functools.wraps(handler)
        def wrapper(*args, **kwargs):
            try:
                return handler(*args, **kwargs)
            except gr.Error as err:
                request = next((a for a in (*args, *kwargs.values()) if isinstance(a, gr.Request)), None)
                self.note(request, text(err))
                raise

        return wrapper
