"""The OpenAI-compatible routes: ``GET /v1/models``, ``GET /v1/models/{id}``, ``POST /v1/chat/completions``.

Each request: the key (``api.access``), the body parsed and checked (``api.mapping``: bounded
already by ``api.limits``), a share of the capacity for its client address (``chat.clients``),
then the chat's own engine: ``ChatEngine.replies`` builds the input as the chat does and runs in
the same batcher, so an API reply is the chat's reply to the same conversation and settings.
The engine blocks, so it runs in worker threads; a streamed reply goes out as server-sent events,
piece by piece as the chat shows it (token by token for the streaming presets), then ``[DONE]``.

A client that hangs up does not free its share at once: the generation it started goes on (the
batcher cannot drop one row of a batch), so the share is released when that generation ends.
Nothing here trains or switches models.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import threading
import time

from starlette.concurrency import run_in_threadpool
from starlette.responses import JSONResponse, StreamingResponse
from starlette.routing import Route

from api.access import ApiConfig, Capacity
from api.errors import APIError, bad_request
from api.mapping import parse
from api.models import servable
from api.responses import Answer
from chat.clients import client_address
from chat.engine import InputError, Reply

log = logging.getLogger(__name__)

METHODS = ["GET", "POST", "PUT", "PATCH", "DELETE"]  # any other than the route's own gets OpenAI's 405


class Api:
    """The routes around one engine (``chat.engine.ChatEngine``) and its settings."""

    def __init__(self, engine, config: ApiConfig):
        self.engine, self.config = engine, config
        self.capacity = Capacity(config.max_active, config.per_address)
        self.created = int(time.time())

    def routes(self) -> list[Route]:
        return [
            Route("/v1/models", self._endpoint(self.models, "GET"), methods=METHODS),
            Route("/v1/models/{model:path}", self._endpoint(self.model, "GET"), methods=METHODS),
            Route("/v1/chat/completions", self._endpoint(self.completions, "POST"), methods=METHODS),
        ]

    def _endpoint(self, handler, method: str):
        """``handler`` behind the key check, with every failure answered in OpenAI's error shape."""

        async def endpoint(request):
            try:
                if request.method != method:
                    raise APIError(405, f"Use {method} for {request.url.path}.", code="method_not_allowed")
                self.config.keys.check(request.headers.get("authorization"))
                return await handler(request)
            except APIError as err:
                if err.status >= 429:
                    log.warning("API %s refused (%d): %s", request.url.path, err.status, err.message)
                return err.response()
            except Exception as err:
                log.exception("API %s failed", request.url.path)
                message = f"The model could not reply ({type(err).__name__})."
                return APIError(500, message, type="server_error").response()

        return endpoint

    def _model(self, name: str) -> dict:
        return {"id": name, "object": "model", "created": self.created, "owned_by": "persona-chat"}

    async def models(self, request):
        return JSONResponse({"object": "list", "data": [self._model(m) for m in servable(self.engine)]})

    async def model(self, request):
        name = request.path_params["model"]
        if name not in servable(self.engine):
            raise APIError(404, f"The model `{name}` does not exist here.", param="model", code="model_not_found")
        return JSONResponse(self._model(name))

    async def completions(self, request):
        address = client_address(request, self.config.behind_proxy)
        raw = await request.body()
        # Parsing and checking a body of up to 4 MiB takes milliseconds: not on the event loop.
        completion = await run_in_threadpool(_parse, raw, servable(self.engine))
        self.capacity.acquire(address)
        started = time.monotonic()

        def release():
            self.capacity.release(address, time.monotonic() - started)

        try:
            replies = await run_in_threadpool(
                self.engine.replies, completion.conversation, completion.message, completion.settings
            )
        except InputError as err:  # the engine's own checks, before any generation
            release()
            raise bad_request(str(err)) from None
        except BaseException:
            release()
            raise
        answer = Answer(completion)
        if not completion.stream:
            try:
                final = await run_in_threadpool(_last, replies)
            finally:
                release()
            return JSONResponse(answer.completion(final))
        headers = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}
        return StreamingResponse(_events(answer, replies, release), media_type="text/event-stream", headers=headers)


def _parse(raw: bytes, models: list[str]):
    try:
        body = json.loads(raw)
    except (ValueError, UnicodeDecodeError):
        raise bad_request("We could not parse the JSON body of your request.") from None
    return parse(body, models)


def _last(replies):
    """Run the reply to its end: the whole ``Reply``."""
    final = None
    for reply in replies:
        final = reply
    return final


def _sse(data) -> str:
    return f"data: {json.dumps(data, ensure_ascii=False)}\n\n"


_END = object()  # the generation has ended


async def _events(answer: Answer, replies, release):
    """The server-sent events of one streamed answer.

    One thread per stream runs the engine's reply to its end, whoever still listens, and then
    ``release``s the share (a client that hangs up keeps it until then). It hands each piece to
    the event loop; the loop sends what arrived since its last event as one delta, so a busy
    machine sends fewer, larger pieces instead of falling behind."""
    loop, pieces = asyncio.get_running_loop(), asyncio.Queue()

    def produce():
        end = _END
        try:
            for reply in replies:
                loop.call_soon_threadsafe(pieces.put_nowait, reply)
        except Exception as err:  # the generation failed
            end = err
        finally:
            release()
            with contextlib.suppress(RuntimeError):  # the server closed its loop meanwhile
                loop.call_soon_threadsafe(pieces.put_nowait, end)

    threading.Thread(target=produce, daemon=True, name="api-stream").start()
    reply, finish_sent = None, False
    while True:
        items = [await pieces.get()]
        while not pieces.empty():
            items.append(pieces.get_nowait())
        news = [item for item in items if isinstance(item, Reply)]
        if news:
            reply = news[-1]
            if not answer.opened:  # the first event names the speaker, as OpenAI's do
                answer.opened = True
                yield _sse(answer.chunk(reply, {"role": "assistant", "content": "", "refusal": None}))
            stopped = answer.stopped
            delta = answer.delta(reply)
            if delta:
                yield _sse(answer.chunk(reply, {"content": delta}))
            if answer.stopped and not stopped:  # a stop string: the text ends now, the usage with the generation
                yield _sse(answer.chunk(reply, {}, "stop"))
                finish_sent = True
        end = items[-1]
        if isinstance(end, Exception):
            log.error("API stream failed", exc_info=end)
            yield _sse(APIError(500, f"The model could not reply ({type(end).__name__}).", type="server_error").body())
            return
        if end is _END:
            if not finish_sent:
                yield _sse(answer.chunk(reply, {}, answer.finish_reason(reply)))
            if answer.request.include_usage:
                yield _sse(answer.chunk(reply, {}, usage=answer.usage(reply)))
            yield "data: [DONE]\n\n"
            return
