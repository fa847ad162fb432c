"""The OpenAI-compatible API (issue 26) through the official openai client against the running
app: the model list, a non-streamed and a streamed completion for each kind (the chat's own
reply, real usage), a continued conversation equal to the /chat endpoint's, stop and length,
and every refusal with its status and error type."""

from dataclasses import replace

import httpx
import openai
import pytest
from gradio_client import Client

from api.limits import MAX_BODY_BYTES
from api.mapping import MAX_MESSAGES
from api.models import DEMO_ID, model_id
from chat.engine import GENERATION_PRESETS, MAX_MESSAGE_CHARS, Conversation
from chat.layout import DEMO_DIR
from chat.prompt import KINDS

CONTEXTS = {
    "persona": "I love dogs. I work as a nurse.",
    "emotion": "joyful",
    "task": "vacation ideas",
    "topic": "jazz",
}
HISTORY = ["hi there!", "hello! how are you today?"]


def client(app, **kwargs) -> openai.OpenAI:
    return openai.OpenAI(base_url=app.url + "v1", api_key="unused", max_retries=0, **kwargs)


def messages(kind: str, message: str, history=HISTORY) -> list[dict]:
    system = [{"role": "system", "content": CONTEXTS[kind]}] if kind != "none" else []
    roles = ["user", "assistant"] * len(history)
    return [*system, *({"role": r, "content": t} for r, t in zip(roles, history, strict=False))] + [
        {"role": "user", "content": message}
    ]


def test_the_served_model_is_listed(app):
    assert model_id(str(DEMO_DIR)) == DEMO_ID and model_id(app.engine.current.name) == DEMO_ID
    models = client(app).models.list()
    assert [(m.id, m.object, m.owned_by) for m in models.data] == [(DEMO_ID, "model", "persona-chat")]
    assert client(app).models.retrieve(DEMO_ID).id == DEMO_ID
    with pytest.raises(openai.NotFoundError) as err:
        client(app).models.retrieve("gpt-4o")
    assert err.value.body["code"] == "model_not_found"


@pytest.mark.parametrize("kind", KINDS)
def test_each_kind_non_streamed_and_streamed_is_the_chats_reply(app, kind):
    message = "what do you like to do on weekends?"
    extra = {"kind": kind, "preset": "fast"}
    whole = client(app).chat.completions.create(model=DEMO_ID, messages=messages(kind, message), extra_body=extra)
    (choice,) = whole.choices
    conv = Conversation(kind, CONTEXTS.get(kind, ""), HISTORY)
    expected, budget = app.engine.reply(conv, message, GENERATION_PRESETS["fast"])  # what the chat answers
    assert choice.message.content == expected and expected
    assert (choice.message.role, choice.finish_reason, whole.model) == ("assistant", "stop", DEMO_ID)
    assert whole.usage.prompt_tokens == budget.total_tokens
    assert 0 < whole.usage.completion_tokens <= GENERATION_PRESETS["fast"].max_new_tokens
    assert whole.usage.total_tokens == whole.usage.prompt_tokens + whole.usage.completion_tokens

    stream = client(app).chat.completions.create(
        model=DEMO_ID,
        messages=messages(kind, message),
        extra_body=extra,
        stream=True,
        stream_options={"include_usage": True},
    )
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    pieces = [c.choices[0].delta.content for c in chunks[1:] if c.choices and c.choices[0].delta.content]
    assert "".join(pieces) == expected
    assert len(pieces) >= min(3, len(expected.split()))  # piece by piece as it is generated, as in the chat
    assert [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason] == ["stop"]
    assert chunks[-1].choices == [] and chunks[-1].usage == whole.usage
    assert len({c.id for c in chunks}) == 1 and chunks[0].object == "chat.completion.chunk"


def test_the_faithful_preset_streams_its_whole_beam_reply_at_once(app):
    message = "tell me about your family"
    stream = client(app).chat.completions.create(
        model=DEMO_ID,
        messages=messages("topic", message),
        extra_body={"kind": "topic", "preset": "faithful"},
        stream=True,
    )
    pieces = [c.choices[0].delta.content for c in stream if c.choices and c.choices[0].delta.content]
    expected, _ = app.engine.reply(Conversation("topic", "jazz", HISTORY), message, GENERATION_PRESETS["faithful"])
    assert pieces == [expected]


def test_a_continued_conversation_equals_the_chat_endpoints_reply(app):
    """Seeded sampling, three turns: the API and gradio's /chat give the same reply to the same input."""
    api, chat = client(app), Client(app.url, verbose=False)
    sampling = {"do_sample": True, "temperature": 0.9, "top_p": 0.8, "seed": 1234, "max_new_tokens": 30}
    conversation = [{"role": "system", "content": CONTEXTS["persona"]}]
    history = []
    for message in ("hi! who are you?", "what is your job like?", "do you have a dog?"):
        conversation.append({"role": "user", "content": message})
        reply = api.chat.completions.create(
            model=DEMO_ID, messages=conversation, temperature=0.9, top_p=0.8, seed=1234, max_tokens=30
        )
        text = reply.choices[0].message.content
        same, _ = chat.predict(message, "persona", CONTEXTS["persona"], "fast", history, sampling, api_name="/chat")
        assert text == same and text
        conversation.append(reply.choices[0].message.model_dump())  # as SDK users echo it back
        history += [message, text]
    # The seed decides: another seed, another sampled reply (for at least one of a few tries).
    others = {
        api.chat.completions.create(model=DEMO_ID, messages=conversation[:-1], temperature=0.9, seed=s, max_tokens=30)
        .choices[0]
        .message.content
        for s in (1, 2, 3)
    }
    assert others != {text}


def test_stop_strings_and_the_length_limit(app):
    message = "what do you like to do on weekends?"
    base = client(app).chat.completions.create(model=DEMO_ID, messages=messages("none", message))
    words = base.choices[0].message.content.split()
    assert len(words) >= 3, words
    stop = " " + words[2]
    cut = client(app).chat.completions.create(model=DEMO_ID, messages=messages("none", message), stop=[stop, "zzz"])
    assert cut.choices[0].message.content == base.choices[0].message.content.split(stop)[0]
    assert cut.choices[0].finish_reason == "stop"
    assert 0 < cut.usage.completion_tokens < base.usage.completion_tokens
    streamed = client(app).chat.completions.create(
        model=DEMO_ID,
        messages=messages("none", message),
        stop=stop,
        stream=True,
        stream_options={"include_usage": True},
    )
    chunks = list(streamed)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == cut.choices[0].message.content and chunks[-1].usage == cut.usage
    short = client(app).chat.completions.create(model=DEMO_ID, messages=messages("none", message), max_tokens=3)
    assert short.choices[0].finish_reason == "length" and short.usage.completion_tokens == 3
    settings = replace(GENERATION_PRESETS["fast"], max_new_tokens=3)
    assert short.choices[0].message.content == app.engine.reply(Conversation(turns=HISTORY), message, settings)[0]


USER = [{"role": "user", "content": "hi"}]
REFUSALS = [
    # (what the request asks, status, error type, param or code it names)
    ({"n": 2}, 400, "invalid_request_error", "n"),
    (
        {"tools": [{"type": "function", "function": {"name": "f", "parameters": {}}}]},
        400,
        "invalid_request_error",
        "tools",
    ),
    ({"logprobs": True}, 400, "invalid_request_error", "logprobs"),
    ({"response_format": {"type": "json_object"}}, 400, "invalid_request_error", "response_format"),
    ({"presence_penalty": 0.5}, 400, "invalid_request_error", "presence_penalty"),
    ({"frobnicate": 1}, 400, "invalid_request_error", "frobnicate"),
    ({"model": "gpt-4o"}, 404, "invalid_request_error", "model_not_found"),
    ({"kind": "villain"}, 400, "invalid_request_error", "kind"),
    ({"preset": "turbo"}, 400, "invalid_request_error", "preset"),
    ({"kind": "persona"}, 400, "invalid_request_error", "messages"),  # a persona needs a system message
    ({"max_tokens": 500}, 400, "invalid_request_error", "max_tokens"),
    ({"temperature": 3}, 400, "invalid_request_error", "temperature"),
    ({"seed": 1.5}, 400, "invalid_request_error", "seed"),
    ({"stop": ["a", "b", "c", "d", "e"]}, 400, "invalid_request_error", "stop"),
    ({"stream_options": {"include_usage": True}}, 400, "invalid_request_error", "stream_options"),
    ({"messages": []}, 400, "invalid_request_error", "messages"),
    (
        {"messages": [{"role": "user", "content": "x" * (MAX_MESSAGE_CHARS + 1)}]},
        400,
        "invalid_request_error",
        "message_too_long",
    ),
    (
        {"messages": [{"role": "user", "content": "hi"}] * (MAX_MESSAGES + 1)},
        400,
        "invalid_request_error",
        "too_many_messages",
    ),
    ({"messages": [{"role": "system", "content": "x" * 601}, *USER]}, 400, "invalid_request_error", "context_too_long"),
    (
        {"messages": [{"role": "user", "content": "a"}, {"role": "user", "content": "b"}]},
        400,
        "invalid_request_error",
        "messages[1].role",
    ),
    ({"messages": [*USER, {"role": "assistant", "content": "hello"}]}, 400, "invalid_request_error", "messages"),
    (
        {"messages": [*USER, {"role": "system", "content": "late"}, *USER]},
        400,
        "invalid_request_error",
        "messages[1].role",
    ),
    (
        {"messages": [{"role": "tool", "content": "42", "tool_call_id": "x"}, *USER]},
        400,
        "invalid_request_error",
        "messages[0].role",
    ),
    (
        {"messages": [{"role": "user", "name": "bob", "content": "hi"}]},
        400,
        "invalid_request_error",
        "messages[0].name",
    ),
    (
        {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "http://x/y.png"}}]}]},
        400,
        "invalid_request_error",
        "unsupported_content",
    ),
    (
        {"messages": [{"role": "user", "content": "<s></s>"}]},
        400,
        "invalid_request_error",
        None,
    ),  # the engine's own check
]


@pytest.mark.parametrize(("change", "status", "kind", "names"), REFUSALS, ids=lambda v: str(v)[:40])
def test_refusals_in_openais_shape(app, change, status, kind, names):
    request = {"model": DEMO_ID, "messages": USER, **change}
    model, messages_ = request.pop("model"), request.pop("messages")
    with pytest.raises(openai.APIStatusError) as err:
        client(app).chat.completions.create(model=model, messages=messages_, extra_body=request)
    error = err.value.body
    assert err.value.status_code == status and set(error) == {"message", "type", "param", "code"}
    assert error["type"] == kind and error["message"]
    assert names is None or names in (error["param"], error["code"]), error


def test_refusals_outside_the_json_fields(app):
    url = app.url + "v1/chat/completions"
    bad_json = httpx.post(url, content=b"{not json", headers={"content-type": "application/json"})
    assert bad_json.status_code == 400 and bad_json.json()["error"]["type"] == "invalid_request_error"
    too_big = httpx.post(url, content=b"x" * (MAX_BODY_BYTES + 1), timeout=30)
    assert too_big.status_code == 413 and too_big.json()["error"]["code"] == "request_too_large"
    wrong_method = httpx.get(url)
    assert wrong_method.status_code == 405 and wrong_method.json()["error"]["code"] == "method_not_allowed"
    # Nothing else is reachable under /v1: no training, no model switching.
    for path in ("v1/fine_tuning/jobs", "v1/models/load", "v1/completions"):
        assert httpx.post(app.url + path, json={}).status_code in (404, 405)
    assert app.engine.current.name == str(DEMO_DIR)
