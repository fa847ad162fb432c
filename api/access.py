"""Who may use the API, and how much of the server one address may take.

- Keys: ``PERSONA_CHAT_API_KEYS`` (comma-separated; a Space secret) makes every ``/v1`` call need
  ``Authorization: Bearer <key>``; without it the API is open, exactly as the chat is. Keys are
  kept as SHA-256 digests and compared in constant time against all of them; they are never
  logged, and a refusal never repeats the key it was sent.
- Capacity: the API shares the chat's engine and batcher, so it gets a bounded share of them: at
  most ``max_active`` API replies in progress at once (the chat's own concurrent slots keep
  theirs: a browser visitor's reply waits behind at most that many API replies), and at most
  ``per_address`` for one client address (``chat.clients``: the socket's, or the proxy's entry on
  a Space). Past either, 429 with ``Retry-After``: about one reply's time (a running average).
"""

from __future__ import annotations

import hashlib
import hmac
import math
import os
import threading
from collections.abc import Mapping
from dataclasses import dataclass, field

from api.errors import APIError
from chat.stepping import concurrency

KEYS_ENV = "PERSONA_CHAT_API_KEYS"
MAX_ACTIVE = concurrency()  # API replies in progress at once: the chat's own (16 on a CPU, 64 with a GPU)
PER_ADDRESS = 2  # of which one client address may hold this many


def _digest(key: str) -> bytes:
    return hashlib.sha256(key.encode()).digest()


class ApiKeys:
    """The accepted bearer keys (digests only); none: the API is open."""

    def __init__(self, keys=()):
        self._digests = tuple(_digest(k) for k in keys if k)

    @classmethod
    def from_env(cls, env: Mapping[str, str] | None = None) -> ApiKeys:
        env = os.environ if env is None else env
        return cls(k.strip() for k in env.get(KEYS_ENV, "").split(","))

    @property
    def required(self) -> bool:
        return bool(self._digests)

    def __repr__(self) -> str:
        return f"ApiKeys({len(self._digests)} keys)"

    def check(self, authorization: str | None) -> None:
        """Refuse (401) a request whose ``Authorization`` header has no accepted key."""
        if not self.required:
            return
        scheme, _, key = (authorization or "").strip().partition(" ")
        if scheme.lower() != "bearer" or not key.strip():
            raise APIError(
                401,
                "You didn't provide an API key: send it as 'Authorization: Bearer <key>' "
                "(the openai client's api_key).",
                code="missing_api_key",
            )
        sent, match = _digest(key.strip()), False
        for digest in self._digests:  # every key compared, whichever matches
            match |= hmac.compare_digest(digest, sent)
        if not match:
            raise APIError(401, "Incorrect API key provided.", code="invalid_api_key")


@dataclass(frozen=True)
class ApiConfig:
    """The API's settings (read once at start-up)."""

    keys: ApiKeys = field(default_factory=ApiKeys)
    behind_proxy: bool = False  # the app's proxy switch (chat.clients.behind_proxy)
    max_active: int = MAX_ACTIVE
    per_address: int = PER_ADDRESS

    def __post_init__(self):
        if not 1 <= self.per_address <= self.max_active:
            raise ValueError("per_address must be between 1 and max_active")

    @classmethod
    def from_env(cls, behind_proxy: bool, env: Mapping[str, str] | None = None) -> ApiConfig:
        return cls(keys=ApiKeys.from_env(env), behind_proxy=behind_proxy)


class Capacity:
    """API replies in progress, in total and per address; ``acquire`` refuses (429) past a share."""

    def __init__(self, max_active: int, per_address: int):
        self.max_active, self.per_address = max_active, per_address
        self._active: dict[str, int] = {}
        self._lock = threading.Lock()
        self._reply_s = 1.0  # running average of a reply's seconds, for Retry-After

    @property
    def active(self) -> int:
        with self._lock:
            return sum(self._active.values())

    def acquire(self, address: str) -> None:
        with self._lock:
            mine, total = self._active.get(address, 0), sum(self._active.values())
            retry = {"Retry-After": str(max(1, math.ceil(self._reply_s)))}
            if mine >= self.per_address:
                raise APIError(
                    429,
                    f"Too many requests from your address: {mine} replies are in progress "
                    f"(at most {self.per_address} at once). Retry when one has finished.",
                    type="rate_limit_error",
                    code="rate_limit_exceeded",
                    headers=retry,
                )
            if total >= self.max_active:
                raise APIError(
                    429,
                    f"The server is busy ({total} API replies in progress). Retry in a moment.",
                    type="rate_limit_error",
                    code="rate_limit_exceeded",
                    headers=retry,
                )
            self._active[address] = mine + 1

    def release(self, address: str, seconds: float | None = None) -> None:
        with self._lock:
            left = self._active.get(address, 0) - 1
            if left > 0:
                self._active[address] = left
            else:
                self._active.pop(address, None)
            if seconds is not None:
                self._reply_s = 0.8 * self._reply_s + 0.2 * seconds
