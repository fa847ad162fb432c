"""Replies in OpenAI's shapes: a ``chat.completion`` object, or ``chat.completion.chunk`` events.

The text is the chat's own (``ChatEngine.replies``: the same input building, history fitting,
special-token safety and clean-up as the UI), cut at the first ``stop`` string if the request gave
any. ``finish_reason``: "stop" when the model ended the reply (or a stop string did), "length"
when it reached ``max_tokens``. ``usage`` counts real tokens: the encoder input the model read
(prefix, context and the turns that fit) and the tokens it generated, up to the end token, or up
to the token that completed a stop string.
"""

from __future__ import annotations

import secrets
import time

from api.mapping import Completion
from api.models import model_id
from chat.engine import Reply


class Answer:
    """One request's answer as it is written: its id, and the text sent so far, never a stop string."""

    def __init__(self, request: Completion):
        self.request = request
        self.id = f"chatcmpl-{secrets.token_hex(12)}"
        self.created = int(time.time())
        self.sent = ""
        self.opened = False  # (streamed) the first event, naming the speaker, went out
        self.stopped = False  # a stop string ended the text
        self._model: str | None = None

    def model(self, reply: Reply) -> str:
        """The public id of the model that writes this answer (one model writes a whole reply)."""
        if self._model is None:
            self._model = reply.model.id or model_id(reply.model.name)
        return self._model

    def delta(self, reply: Reply) -> str:
        """The text of ``reply`` not sent yet. A stop string ends it; while it streams, text that may
        be the start of one is held back until the next piece shows whether it is."""
        text, stops = reply.text, self.request.stop
        if self.stopped or not text.startswith(self.sent):  # (clean-up never changes sent text)
            return ""
        found = [i for i in (text.find(s, max(0, len(self.sent) - len(s) + 1)) for s in stops) if i >= 0]
        if found:
            self.stopped, end = True, max(min(found), len(self.sent))
        else:
            held = 0 if reply.tokens is not None else _partial_stop(text, stops)
            end = len(text) - held
        new = text[len(self.sent) : end] if end > len(self.sent) else ""
        self.sent += new
        return new

    def finish_reason(self, final: Reply) -> str:
        return "length" if final.cut and not self.stopped else "stop"

    def usage(self, final: Reply) -> dict:
        completion = len(final.tokens)
        if self.stopped:  # the tokens up to the one that completed the first stop string
            completion = next(
                (n for n in range(1, completion + 1) if any(s in final.text_of(n) for s in self.request.stop)),
                completion,
            )
        prompt = final.budget.total_tokens
        return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}

    def completion(self, final: Reply) -> dict:
        """The whole answer (``stream`` false)."""
        self.delta(final)
        return {
            "id": self.id,
            "object": "chat.completion",
            "created": self.created,
            "model": self.model(final),
            "system_fingerprint": None,
            "choices": [
                {
                    "index": 0,
                    "message": {"role": "assistant", "content": self.sent, "refusal": None, "annotations": []},
                    "logprobs": None,
                    "finish_reason": self.finish_reason(final),
                }
            ],
            "usage": self.usage(final),
        }

    def chunk(self, reply: Reply, delta: dict, finish: str | None = None, usage: dict | None = None) -> dict:
        """One streamed event; with ``usage``, the last one (no choices), as OpenAI sends it."""
        body = {
            "id": self.id,
            "object": "chat.completion.chunk",
            "created": self.created,
            "model": self.model(reply),
            "system_fingerprint": None,
            "choices": [] if usage else [{"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish}],
        }
        if self.request.include_usage:
            body["usage"] = usage
        return body


def _partial_stop(text: str, stops: tuple[str, ...]) -> int:
    """How many characters at the end of ``text`` could be the start of a stop string."""
    return max((k for s in stops for k in range(1, len(s)) if text.endswith(s[:k])), default=0)
