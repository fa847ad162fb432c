"""ChatEngine.replies (what the OpenAI-compatible API reads): the chat's own reply as it streams,
then the whole reply with its generated token ids and whether the token limit ended it."""

from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace

import pytest

from chat.engine import DEMO_DIR, GENERATION_PRESETS, ChatEngine, Conversation, InputError, load_checkpoint

CONV = Conversation("persona", "I love dogs. I work as a nurse.", ["hi there!", "hello! how are you?"])


@pytest.fixture(scope="module")
def engine():
    return ChatEngine(load_checkpoint(str(DEMO_DIR), optimize="none"), "serving demo")


@pytest.mark.parametrize("preset", ["fast", "faithful"])
def test_replies_are_the_chats_reply_with_its_tokens(engine, preset):
    settings = GENERATION_PRESETS[preset]
    *partial, final = engine.replies(CONV, "do you have pets?", settings)
    text, budget = engine.reply(CONV, "do you have pets?", settings)
    streamed = [t for t, _ in engine.stream(CONV, "do you have pets?", settings)]
    assert [r.text for r in partial] == streamed and final.text == text == streamed[-1]
    assert all(r.tokens is None for r in partial) and final.budget == budget and final.model is engine.current
    eos = engine.current.tokenizer.eos_token_id
    assert final.tokens[-1] == eos and eos not in final.tokens[:-1] and not final.cut
    assert final.text_of(len(final.tokens)) == text
    assert text.startswith(final.text_of(3)) and final.text_of(3) != text


def test_the_token_limit_cuts_a_reply(engine):
    settings = replace(GENERATION_PRESETS["fast"], max_new_tokens=4)
    final = list(engine.replies(CONV, "do you have pets?", settings))[-1]
    assert final.cut and len(final.tokens) == 4
    assert final.text == engine.reply(CONV, "do you have pets?", settings)[0]


def test_rows_batched_together_keep_their_own_tokens(engine):
    """A batch pads the rows that ended early; a row's tokens stop at its own end token."""
    messages = ["hi", "what is your favourite thing about working as a nurse in a big hospital?"] * 3
    with ThreadPoolExecutor(6) as pool:
        finals = list(pool.map(lambda m: list(engine.replies(CONV, m))[-1], messages))
    pad = engine.current.tokenizer.pad_token_id
    for message, final in zip(messages, finals, strict=True):
        assert final.text == engine.reply(CONV, message)[0]
        assert pad not in final.tokens and final.text_of(len(final.tokens)) == final.text


def test_bad_input_is_refused_at_the_call(engine):
    with pytest.raises(InputError, match="Type a message first"):
        engine.replies(CONV, "<s>")
