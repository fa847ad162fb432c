"""Who a request comes from: the client address that per-visitor limits count.

The login throttle, the feedback and vote caps (webui/) and the API's fair share (api/) all key
on one address, computed here. It is the socket's peer address, unless the app is told it is
behind a proxy (``PROXY_ENV=1``, or on a Hugging Face Space, whose proxy every request passes):
then every connection comes from the proxy, and the client is the entry the proxy appended to
``X-Forwarded-For`` (the last one; anything before it is whatever the client sent, so forged).

The server must not rewrite the socket's address first: uvicorn (the server gradio runs) does
that by default for connections from 127.0.0.1, taking the client's own X-Forwarded-For as its
address, so any loopback client (the default bind, an ``ssh -L`` tunnel) could claim to be anyone.
``socket_addresses_only`` turns that off before the server starts.

Works on anything with ``.headers`` and ``.client.host`` (a starlette request, a ``gr.Request``).
"""

from __future__ import annotations

import logging
import os
from collections.abc import Mapping, MutableMapping

log = logging.getLogger(__name__)

PROXY_ENV = "PERSONA_CHAT_BEHIND_PROXY"  # 1: trust the proxy's X-Forwarded-For (automatic on a Space)
UVICORN_TRUSTED_PROXIES = "FORWARDED_ALLOW_IPS"  # uvicorn's list of proxies whose X-Forwarded-For it trusts
MAX_ADDRESS_CHARS = 64  # an IPv6 address with a port fits; a longer "address" is not one


def on_space(env: Mapping[str, str] | None = None) -> bool:
    env = os.environ if env is None else env
    return env.get("SYSTEM") == "spaces" and bool(env.get("SPACE_ID"))


def behind_proxy(env: Mapping[str, str] | None = None) -> bool:
    """Is the app told it runs behind a proxy that appends the client to X-Forwarded-For?"""
    env = os.environ if env is None else env
    return on_space(env) or env.get(PROXY_ENV, "") == "1"


def client_address(request, proxied: bool) -> str:
    """The address ``request`` comes from ("unknown" without one); ``proxied``: ``behind_proxy()``."""
    if request is None:
        return "unknown"
    if proxied:
        forwarded = (request.headers.get("x-forwarded-for") or "").split(",")[-1].strip()
        if forwarded:
            return forwarded[:MAX_ADDRESS_CHARS]
    client = getattr(request, "client", None)
    return getattr(client, "host", None) or "unknown"


def socket_addresses_only(env: MutableMapping[str, str] | None = None) -> None:
    """Make the server leave every request's client address as the socket's (call before launch).

    gradio builds uvicorn's config without ``forwarded_allow_ips``, so uvicorn reads
    FORWARDED_ALLOW_IPS, by default "127.0.0.1,::1": from those it replaces the address with the
    request's own X-Forwarded-For. An empty list trusts no one. Behind a proxy ``client_address``
    reads the header itself, so uvicorn never needs to."""
    env = os.environ if env is None else env
    if env.get(UVICORN_TRUSTED_PROXIES):
        log.warning(
            "%s=%s is ignored: this app reads X-Forwarded-For itself, and only when %s=1 (or on a Space)",
            UVICORN_TRUSTED_PROXIES,
            env[UVICORN_TRUSTED_PROXIES],
            PROXY_ENV,
        )
    env[UVICORN_TRUSTED_PROXIES] = ""
