"""Who may use the API and how much of the server it takes (api/access.py), against the running
app: API keys (right, wrong, none; never logged), the per-address fair share and the total with
429 + Retry-After (a forged X-Forwarded-For changes nothing), and 32 streamed API clients at once
while a browser visitor's chat is still answered."""

import json
import logging
import statistics
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import openai
import pytest
from gradio_client import Client
from served_app import http_from
from transformers.generation.streamers import BaseStreamer

from api.access import MAX_ACTIVE, PER_ADDRESS
from api.models import DEMO_ID
from chat.engine import GENERATION_PRESETS, Conversation

ASK = {"model": DEMO_ID, "messages": [{"role": "user", "content": "hi! what do you do for fun?"}]}


def test_keys_are_required_when_set_and_never_logged(keyed, keys, caplog):
    caplog.set_level(logging.DEBUG)
    for key in keys:
        api = openai.OpenAI(base_url=keyed.url + "v1", api_key=key, max_retries=0)
        assert [m.id for m in api.models.list()] == [DEMO_ID]
        assert api.chat.completions.create(**ASK).choices[0].message.content
    wrong = openai.OpenAI(base_url=keyed.url + "v1", api_key=keys[0] + "x", max_retries=0)
    with pytest.raises(openai.AuthenticationError) as err:
        wrong.chat.completions.create(**ASK)
    assert err.value.status_code == 401 and err.value.body["code"] == "invalid_api_key"
    assert keys[0] not in json.dumps(err.value.body)  # a refusal never repeats the key
    with pytest.raises(openai.AuthenticationError):
        wrong.models.list()
    for headers in ({}, {"authorization": "Basic " + keys[0]}, {"authorization": "Bearer"}):
        refused = httpx.post(keyed.url + "v1/chat/completions", json=ASK, headers=headers)
        assert refused.status_code == 401 and refused.json()["error"]["code"] == "missing_api_key"
        assert refused.json()["error"]["type"] == "invalid_request_error"
    assert all(key not in caplog.text for key in keys)
    # The chat itself stays open: the keys guard the API only.
    assert Client(keyed.url, verbose=False).predict("hello!", "none", "", api_name="/chat")[0].strip()


class Gate(BaseStreamer):
    """Holds the engine's batcher in its first decoding step until opened: every reply behind it
    waits (and holds its share of the API's capacity) for as long as the test needs."""

    def __init__(self):
        self.open = threading.Event()

    def put(self, value):
        self.open.wait(60)

    def end(self):
        pass


def hold_the_batcher(app) -> Gate:
    gate = Gate()
    loaded = app.engine.current
    encoded, _ = app.engine.build_input(Conversation(turns=["hold on"]), loaded)
    app.engine._batcher.submit(loaded, encoded, GENERATION_PRESETS["fast"].generate_kwargs(), gate)
    return gate


def open_stream(http: httpx.Client, forged: str | None = None) -> httpx.Response:
    """A streamed completion's response, headers only (the body waits for the reply)."""
    headers = {"x-forwarded-for": forged} if forged else {}
    request = http.build_request("POST", "v1/chat/completions", json={**ASK, "stream": True}, headers=headers)
    return http.send(request, stream=True)


def test_one_address_gets_a_fair_share_and_the_total_is_bounded(app):
    clients = [http_from(app, f"127.0.0.{10 + i}") for i in range(MAX_ACTIVE)]
    gate = hold_the_batcher(app)
    try:
        mine = [open_stream(clients[0]) for _ in range(PER_ADDRESS)]
        assert [r.status_code for r in mine] == [200] * PER_ADDRESS
        # One more from the same socket address is refused, whatever address it claims to be.
        for forged in (None, "198.51.100.7"):
            refused = open_stream(clients[0], forged)
            assert refused.status_code == 429 and int(refused.headers["retry-after"]) >= 1
            error = json.loads(refused.read())["error"]
            assert (error["type"], error["code"]) == ("rate_limit_error", "rate_limit_exceeded")
        others = [open_stream(c) for c in clients[1 : MAX_ACTIVE - PER_ADDRESS + 1]]  # other addresses: in
        assert [r.status_code for r in others] == [200] * len(others)
        busy = open_stream(clients[-1])  # the total is reached: a new address waits too
        assert busy.status_code == 429 and "busy" in json.loads(busy.read())["error"]["message"]
    finally:
        gate.open.set()
    for response in [*mine, *others]:  # every admitted stream is answered once the batcher moves
        body = response.read().decode()
        assert body.rstrip().endswith("data: [DONE]") and '"content"' in body
    # The shares come back as the replies end: the first address is admitted again.
    again = open_stream(clients[0])
    assert again.status_code == 200 and again.read().decode().rstrip().endswith("data: [DONE]")
    for c in clients:
        c.close()


def test_a_client_that_hangs_up_keeps_its_share_until_its_generation_ends(app):
    """Hanging up and asking again cannot pile up work behind the API's bounds."""
    with http_from(app, "127.0.0.60") as http:
        gate = hold_the_batcher(app)
        try:
            for _ in range(PER_ADDRESS):
                open_stream(http).close()  # admitted, then the client hangs up
            assert open_stream(http).status_code == 429  # the generations it started still run
        finally:
            gate.open.set()
        deadline = time.monotonic() + 60
        while (again := open_stream(http)).status_code == 429 and time.monotonic() < deadline:
            again.close()
            time.sleep(0.2)
        assert again.status_code == 200 and again.read().decode().rstrip().endswith("data: [DONE]")


def test_32_api_streams_at_once_and_a_browser_visitor_still_gets_a_reply(app, capsys):
    """Each API client on its own address, retrying 429s as the openai client does (Retry-After)."""
    statuses = []
    start = threading.Barrier(33)

    def api_client(i: int) -> str:
        http = httpx.Client(
            transport=httpx.HTTPTransport(local_address=f"127.0.0.{100 + i}"),
            event_hooks={"response": [lambda r: statuses.append(r.status_code)]},
            timeout=120,
        )
        api = openai.OpenAI(base_url=app.url + "v1", api_key="unused", http_client=http, max_retries=30)
        start.wait(60)
        stream = api.chat.completions.create(
            model=DEMO_ID, messages=[{"role": "user", "content": f"hello number {i}, how are you?"}], stream=True
        )
        return "".join(c.choices[0].delta.content or "" for c in stream if c.choices)

    def visitor() -> tuple[str, float]:
        chat = Client(app.url, verbose=False)
        start.wait(60)
        started = time.perf_counter()
        reply, _ = chat.predict("hi! are you there?", "none", "", api_name="/chat")
        return reply, time.perf_counter() - started

    alone = []
    for _ in range(3):
        t0 = time.perf_counter()
        Client(app.url, verbose=False).predict("hi! are you there?", "none", "", api_name="/chat")
        alone.append(time.perf_counter() - t0)
    with ThreadPoolExecutor(33) as pool:
        streams = [pool.submit(api_client, i) for i in range(32)]
        chat = pool.submit(visitor)
        reply, waited = chat.result(timeout=300)
        texts = [s.result(timeout=300) for s in streams]
    assert reply.strip()  # the visitor was answered
    assert all(t.strip() for t in texts)  # and every API client, in its turn
    refused = statuses.count(429)
    assert refused > 0 and statuses.count(200) == 32  # the API took its share, not the server
    with capsys.disabled():
        print(
            f"\nchat {waited:.2f} s under 32 API streams (alone: median {statistics.median(alone):.2f} s); "
            f"{refused} API requests got 429 + Retry-After and retried"
        )
