"""No lone surrogate gets past the door: request bodies are cleaned before gradio or a handler reads them.

JSON can carry ``"\\ud800"``, half of a UTF-16 surrogate pair with no other half. Python decodes it
into a ``str`` that no encoder takes back, and gradio's event stream ends on the first output that
echoes it (orjson refuses to encode it): that page's events stop answering. A browser sends one when
a text box cuts an emoji in half at its ``max_length``; anyone can send one on purpose. Every handler
that shows text back (a corrected reply, the context box, a model name, gradio's own ChatInterface
steps) would need its own guard; this ASGI middleware is the one place instead: a JSON body that holds
a surrogate escape is parsed, its strings lose their lone surrogates (a surrogate pair is one
character once parsed, and stays), and the cleaned body goes on. Other requests pass untouched.

Bodies over MAX_BYTES pass as they came: bounding bodies is the job of the app's body limit, and an
event that big is refused there or never holds a chat message.
"""

from __future__ import annotations

import json
import re

MAX_BYTES = 16 * 2**20
_ESCAPE = re.compile(rb"\\u[dD][89a-fA-F][0-9a-fA-F]{2}")  # a UTF-16 surrogate written as a JSON escape
_LONE = re.compile("[\ud800-\udfff]")  # what is left of one after parsing: a lone surrogate


def without_lone_surrogates(value):
    """``value`` (parsed JSON) with every lone surrogate removed from its strings, keys too."""
    if isinstance(value, str):
        return _LONE.sub("", value)
    if isinstance(value, list):
        return [without_lone_surrogates(v) for v in value]
    if isinstance(value, dict):
        return {without_lone_surrogates(k): without_lone_surrogates(v) for k, v in value.items()}
    return value


def clean_body(body: bytes) -> bytes:
    """A JSON body without lone surrogates; anything else (no surrogate escape, not JSON) as it is."""
    if not _ESCAPE.search(body):
        return body
    try:
        parsed = json.loads(body)
    except ValueError:  # not JSON after all: gradio answers it as it would have
        return body
    return json.dumps(without_lone_surrogates(parsed), ensure_ascii=False).encode("utf-8")


def _is_json(scope) -> bool:
    for name, value in scope.get("headers", ()):
        if name == b"content-type":
            return value.split(b";")[0].strip().lower() == b"application/json"
    return False


class DropLoneSurrogates:
    """ASGI middleware: ``clean_body`` on every JSON POST body of at most MAX_BYTES."""

    def __init__(self, app, max_bytes: int = MAX_BYTES):
        self.app, self.max_bytes = app, max_bytes

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http" or scope.get("method") != "POST" or not _is_json(scope):
            return await self.app(scope, receive, send)
        received, size = [], 0
        while True:
            message = await receive()
            received.append(message)
            if message["type"] != "http.request":  # the client left: let the app see it
                break
            size += len(message.get("body", b""))
            if not message.get("more_body", False) or size > self.max_bytes:
                break
        last = received[-1]
        if last["type"] == "http.request" and not last.get("more_body", False):
            body = clean_body(b"".join(m.get("body", b"") for m in received))
            received = [{"type": "http.request", "body": body, "more_body": False}]
            headers = [(k, v) for k, v in scope["headers"] if k != b"content-length"]
            scope = {**scope, "headers": [*headers, (b"content-length", str(len(body)).encode())]}

        async def replay():
            return received.pop(0) if received else await receive()

        await self.app(scope, replay, send)
