"""api/mapping.py and api/responses.py without a server: how a request becomes the chat's terms,
and how a streamed text is cut at a stop string that arrives in pieces."""

from dataclasses import replace

import pytest

from api.errors import APIError
from api.mapping import parse
from api.responses import Answer
from chat.engine import GENERATION_PRESETS, Budget, Conversation, Reply

MODELS = ["demo-model"]


def ask(*messages, **fields):
    return parse({"model": MODELS[0], "messages": list(messages), **fields}, MODELS)


def test_messages_become_the_conversation():
    c = ask(
        {"role": "system", "content": "I love dogs."},
        {"role": "developer", "content": [{"type": "text", "text": "I am a nurse."}]},
        {"role": "assistant", "content": "hi! want to talk?"},  # the bot may speak first
        {"role": "user", "content": "sure"},
        # A previous reply echoed back as the SDK returns it: its empty fields ask for nothing.
        {
            "role": "assistant",
            "content": "great",
            "refusal": None,
            "annotations": [],
            "tool_calls": None,
            "audio": None,
        },
        {"role": "user", "content": "tell me more"},
    )
    assert c.conversation == Conversation(
        "persona", "I love dogs. I am a nurse.", ["hi! want to talk?", "sure", "great"], model=MODELS[0]
    )
    assert c.message == "tell me more" and c.settings == GENERATION_PRESETS["fast"] and not c.stream
    assert ask({"role": "user", "content": "hi"}).conversation == Conversation("none", "", [], MODELS[0])
    emotion = ask({"role": "system", "content": "joyful"}, {"role": "user", "content": "hi"}, kind="emotion")
    assert emotion.conversation.kind == "emotion" and emotion.conversation.context == "joyful"


def test_parameters_override_the_preset_as_the_chat_does():
    user = {"role": "user", "content": "hi"}
    faithful = GENERATION_PRESETS["faithful"]
    assert ask(user, preset="faithful").settings == faithful
    assert ask(user, preset="faithful", max_tokens=10).settings == replace(
        faithful, max_new_tokens=10, min_new_tokens=10
    )
    sampled = ask(user, temperature=0.9, top_p=0.8, seed=7, max_completion_tokens=30).settings
    assert sampled == replace(
        GENERATION_PRESETS["fast"], do_sample=True, temperature=0.9, top_p=0.8, seed=7, max_new_tokens=30
    )
    assert ask(user, temperature=0).settings.do_sample is False
    assert ask(user, top_p=0.5).settings.do_sample is True  # at the preset's temperature
    off = ask(user, n=1, tools=[], logprobs=False, presence_penalty=0, response_format={"type": "text"}, user="u1")
    assert off.settings == GENERATION_PRESETS["fast"]
    assert (
        ask(user, stop="bye").stop == ("bye",)
        and ask(user, stream=True, stream_options={"include_usage": True}).include_usage
    )


@pytest.mark.parametrize("body", [[], "hi", None, {"messages": [{"role": "user", "content": "hi"}]}])
def test_not_a_request(body):
    with pytest.raises(APIError) as err:
        parse(body, MODELS)
    assert err.value.status == 400


def reply(text: str, tokens=None) -> Reply:
    return Reply(text, Budget(1, 1, 2, 128, 0), model=None, tokens=tokens)


def test_a_stop_string_arriving_in_pieces_is_never_sent():
    answer = Answer(ask({"role": "user", "content": "hi"}, stop=["STOP here"]))
    sent = [
        answer.delta(reply(t)) for t in ("i like", "i like jazz ST", "i like jazz STOP", "i like jazz STOP here and")
    ]
    assert "".join(sent) == "i like jazz " and answer.stopped
    assert sent[1] == " jazz "  # "ST" held back: it may start the stop string
    held = Answer(ask({"role": "user", "content": "hi"}, stop="STOP"))
    assert held.delta(reply("a ST")) == "a " and held.delta(reply("a STAR", tokens=(1, 2))) == "STAR"
    assert not held.stopped
