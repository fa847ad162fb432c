"""chat/clients.py: the client address per-visitor limits count, and uvicorn kept from rewriting it."""

import logging
from types import SimpleNamespace

import uvicorn

from chat import clients


def request(host: str | None, forwarded: str | None = None):
    return SimpleNamespace(
        client=SimpleNamespace(host=host) if host else None,
        headers={"x-forwarded-for": forwarded} if forwarded is not None else {},
    )


def test_the_address_is_the_sockets_unless_behind_a_proxy():
    assert clients.client_address(request("127.0.0.1", "198.51.100.4"), proxied=False) == "127.0.0.1"
    # Behind a proxy: the entry the proxy appended (the last); what the client sent before it is forged.
    assert clients.client_address(request("10.0.0.1", "1.1.1.1, 203.0.113.9"), proxied=True) == "203.0.113.9"
    assert clients.client_address(request("10.0.0.1", " "), proxied=True) == "10.0.0.1"
    assert clients.client_address(request("10.0.0.1", "x" * 500), proxied=True) == "x" * clients.MAX_ADDRESS_CHARS
    assert clients.client_address(request(None), proxied=False) == "unknown"
    assert clients.client_address(None, proxied=True) == "unknown"


def test_the_proxy_switch():
    assert not clients.behind_proxy({})
    assert clients.behind_proxy({clients.PROXY_ENV: "1"})
    assert not clients.behind_proxy({clients.PROXY_ENV: "yes"})
    assert clients.behind_proxy({"SYSTEM": "spaces", "SPACE_ID": "me/chat-e"})
    assert not clients.behind_proxy({"SYSTEM": "spaces"})


def test_uvicorn_as_gradio_configures_it_then_trusts_no_forwarded_header(monkeypatch, caplog):
    async def app(scope, receive, send):  # pragma: no cover - never called
        pass

    def trusted(env_value: str | None) -> bool:
        if env_value is None:
            monkeypatch.delenv(clients.UVICORN_TRUSTED_PROXIES, raising=False)
        else:
            monkeypatch.setenv(clients.UVICORN_TRUSTED_PROXIES, env_value)
        config = uvicorn.Config(app=app, host="127.0.0.1", port=0, log_level="warning")  # gradio's arguments
        config.load()
        middleware = config.loaded_app
        while not hasattr(middleware, "trusted_hosts"):  # uvicorn's ProxyHeadersMiddleware, under any wrappers
            middleware = middleware.app
        return "127.0.0.1" in middleware.trusted_hosts

    assert trusted(None)  # uvicorn's default: a loopback client's X-Forwarded-For becomes its address
    env = {}
    clients.socket_addresses_only(env)
    assert not trusted(env[clients.UVICORN_TRUSTED_PROXIES])
    with caplog.at_level(logging.WARNING, logger="chat.clients"):
        env = {clients.UVICORN_TRUSTED_PROXIES: "*"}
        clients.socket_addresses_only(env)
    assert env[clients.UVICORN_TRUSTED_PROXIES] == "" and clients.PROXY_ENV in caplog.text
