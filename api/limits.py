"""Every request body is bounded before it is read (issue 28 item 2).

gradio bounds only its upload route; any other body (the unqueued login endpoint, the queue's
``join``, the REST ``/gradio_api/...`` routes, the API's) was read whole into memory: four
150 MB bodies to the login endpoint took the server from 0.5 to 2.4 GB, for good. ``BodyLimit`` is
an ASGI middleware on the whole app: a declared ``Content-Length`` over the bound is refused before
any byte is read, and a streamed (chunked) body is counted as it arrives and refused at the first
byte over it. Either way the answer is 413 (OpenAI's error shape on the API's ``/v1`` routes) and
the connection is closed, so the rest of the body is never read.

The bound: the largest body the app legitimately receives is the browser's list of saved chats
(sent whole when a chat is saved; the browser's local storage holds ~5 MB at most) or a
1,000-turn conversation of 1,000-character messages (~1 MB of ASCII); 4 MiB covers both.
gradio's own upload route is left to its limit (``max_file_size``, 50 MB: it streams to disk).
"""

from __future__ import annotations

import json

from api.errors import APIError

MAX_BODY_BYTES = 4 * 2**20
UPLOAD_PATHS = frozenset({"/gradio_api/upload"})  # gradio streams these to disk under max_file_size
API_PREFIX = "/v1/"


class BodyTooLarge(Exception):
    """Raised into the app by ``receive`` when a streamed body passes the bound."""


class BodyLimit:
    """ASGI middleware: refuse request bodies over ``max_bytes`` with 413, before reading them."""

    def __init__(self, app, max_bytes: int = MAX_BODY_BYTES, exempt: frozenset[str] = UPLOAD_PATHS):
        self.app, self.max_bytes, self.exempt = app, max_bytes, exempt

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http" or scope["path"] in self.exempt:
            return await self.app(scope, receive, send)
        declared = next((v for k, v in scope["headers"] if k == b"content-length"), None)
        if declared is not None and declared.strip().isdigit() and int(declared) > self.max_bytes:
            return await self.refuse(scope, send)  # nothing read
        received, over, started = 0, False, False

        async def counted():
            nonlocal received, over
            message = await receive()
            if message["type"] == "http.request":
                received += len(message.get("body", b""))
                if received > self.max_bytes:
                    over = True
                    raise BodyTooLarge
            return message

        async def guarded(message):
            nonlocal started
            if over:  # the app's own answer to the failed read (often a 400) gives way to the 413
                return
            started = started or message["type"] == "http.response.start"
            await send(message)

        try:
            await self.app(scope, counted, guarded)
        except BodyTooLarge:
            pass
        if over and not started:
            await self.refuse(scope, send)

    async def refuse(self, scope, send) -> None:
        message = f"Request body too large: the limit is {self.max_bytes} bytes."
        if scope["path"].startswith(API_PREFIX):
            body = APIError(413, message, code="request_too_large").body()
        else:
            body = {"detail": message}
        payload = json.dumps(body).encode()
        headers = [
            (b"content-type", b"application/json"),
            (b"content-length", str(len(payload)).encode()),
            (b"connection", b"close"),  # the unread rest of the body is not waited for
        ]
        await send({"type": "http.response.start", "status": 413, "headers": headers})
        await send({"type": "http.response.body", "body": payload})
