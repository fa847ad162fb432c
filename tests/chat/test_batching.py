"""chat.batching: a model that no request uses any more is not kept alive by the batcher; CUDA-graph
decoding pads sources to length buckets without changing replies."""

from __future__ import annotations

import gc
import threading
import time
import weakref

import pytest
import torch
from transformers import AutoTokenizer, TextIteratorStreamer

from chat import graphs
from chat.batching import SOURCE_BUCKET, Batcher, ReaderTextStreamer, _pad
from chat.engine import DEMO_DIR, ChatEngine, Conversation, GenerationSettings, load_checkpoint
from chat.model import load_model


def test_a_swapped_out_model_is_freed_without_waiting_for_another_reply(tiny_path):
    engine = ChatEngine(load_checkpoint(str(DEMO_DIR), optimize="none"), "test")
    engine.reply(Conversation("none", "", []), "hello there", GenerationSettings(max_new_tokens=4))
    old = weakref.ref(engine.current.model)
    engine.swap(str(tiny_path))
    gc.collect()
    # The batcher's loop used to hold its last request (and so the demo model) until the next
    # reply on any model.
    assert old() is None


def _encoded(n: int, token: int = 7) -> dict:
    return {"input_ids": torch.full((1, n), token), "attention_mask": torch.ones(1, n, dtype=torch.long)}


@pytest.mark.parametrize(
    ("lengths", "width"), [([5], 16), ([16], 16), ([17, 3], 32), ([125], 128), ([128], 128), ([129], 129)]
)
def test_sources_are_padded_to_a_bucket_never_past_the_positions(lengths, width):
    batch = _pad([_encoded(n) for n in lengths], pad_id=1, multiple=16, limit=128)
    assert batch["input_ids"].shape == (len(lengths), width)
    for row, n in enumerate(lengths):
        assert batch["attention_mask"][row].tolist() == [1] * n + [0] * (width - n)
        assert batch["input_ids"][row].tolist() == [7] * n + [1] * (width - n)


def test_unbucketed_padding_is_the_longest_source():
    assert _pad([_encoded(5), _encoded(9)], pad_id=1)["input_ids"].shape == (2, 9)


@pytest.mark.parametrize("beams", [1, 4])
def test_a_source_padded_to_its_bucket_gets_the_unpadded_reply(tiny_path, beams):
    tokenizer = AutoTokenizer.from_pretrained(tiny_path)
    model = load_model(tiny_path).eval()
    kwargs = dict(num_beams=beams, max_new_tokens=12, min_new_tokens=4, no_repeat_ngram_size=3)
    texts = ["chatbot: hi", "chatbot: your persona: i like jazz and long walks. </s>  <s> hello there, how are you?"]
    for text in texts:
        encoded = dict(tokenizer([text], return_tensors="pt"))
        padded = _pad([encoded], tokenizer.pad_token_id, SOURCE_BUCKET, model.config.max_position_embeddings)
        n = encoded["input_ids"].shape[1]
        assert n % SOURCE_BUCKET and padded["input_ids"].shape[1] == -(-n // SOURCE_BUCKET) * SOURCE_BUCKET
        with torch.no_grad():
            assert torch.equal(model.generate(**padded, **kwargs), model.generate(**encoded, **kwargs))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_replies_of_one_bucket_share_graphs_and_match_plain_generate(tiny_path):
    # The static batcher's graphs (on a GPU the engine's step loop takes greedy replies itself).
    engine = ChatEngine(load_checkpoint(str(tiny_path), optimize="none"), "test", batcher=Batcher())
    model = engine.current.model
    settings = GenerationSettings(max_new_tokens=12, min_new_tokens=12)
    conv = Conversation("none", "", [])
    messages = ["hi", "hi there", "hi there, my friend"]
    lengths = [engine.build_input(Conversation("none", "", [m]))[0]["input_ids"].shape[1] for m in messages]
    assert len(set(lengths)) == 3 and len({-(-n // SOURCE_BUCKET) for n in lengths}) == 1
    expected = []
    for message in messages:  # plain generate() on the unpadded source, as bench.chat's baseline
        loaded, encoded, _, kwargs = engine._prepare(conv, message, settings)
        with torch.inference_mode():
            out = model.generate(**{k: v.to(model.device) for k, v in encoded.items()}, **kwargs)
        expected.append(engine._clean_reply(loaded.tokenizer.decode(out[0], skip_special_tokens=True)))
    for _ in range(2):
        assert [engine.reply(conv, m, settings)[0] for m in messages] == expected
    step_graphs = graphs.for_model(model)
    assert {key[1] for key in step_graphs._entries if key[0] == 1} == {-(-lengths[0] // SOURCE_BUCKET) * SOURCE_BUCKET}
    assert step_graphs.replays > 0


def test_the_reader_side_streamer_gives_text_iterator_streamers_text(tiny_tokenizer):
    """ReaderTextStreamer decodes in the reading thread: after the puts nothing is decoded yet; its
    pieces are exactly TextIteratorStreamer's for the same ids (spaces, a new line, a word split over
    tokens, a piece of punctuation held back until the next space), whether the reader keeps up or
    reads them all at once; with an interval, ids that arrived together are read in one decode
    (longer pieces, the same text)."""
    text = "hello there, how are you?\nfine. unbelievably good! 12 dogs and 3.5 cats."
    ids = [1, *tiny_tokenizer(text, add_special_tokens=False)["input_ids"], 2]

    def read(kind, together: bool, interval: float = 0.0) -> list[str]:
        extra = {"interval": interval} if interval else {}
        streamer = kind(tiny_tokenizer, skip_prompt=False, skip_special_tokens=True, timeout=5, **extra)
        pieces: list[str] = []
        reader = threading.Thread(target=lambda: pieces.extend(streamer))
        if not together:  # a reader keeping up: it has taken each id before the next is put
            reader.start()
        for token in ids:
            streamer.put(torch.tensor([token]))
            while kind is ReaderTextStreamer and not together and streamer._ids:
                time.sleep(0.001)
        if together and kind is ReaderTextStreamer:
            assert streamer.text_queue.empty()  # put only keeps the ids
        streamer.end()
        if together:
            reader.start()
        reader.join(10)
        return [p for p in pieces if p]

    expected = read(TextIteratorStreamer, together=False)
    assert len(expected) > 5 and "".join(expected).strip().startswith("hello")
    assert read(ReaderTextStreamer, together=False) == expected
    assert read(ReaderTextStreamer, together=True) == expected
    joined = read(ReaderTextStreamer, together=True, interval=3600)
    assert "".join(joined) == "".join(expected) and len(joined) == 2  # one decode to the last space; the rest


def test_the_reader_side_streamer_wakes_its_reader_at_most_every_interval(tiny_tokenizer):
    """With an interval, the reader is woken for the first two puts (the decoder's start token and
    the first new one: the first text is not held back), then at most once per interval, and at the
    end; without one, at every put. The text read is the same."""
    ids = [1, *tiny_tokenizer("one two three four five six seven", add_special_tokens=False)["input_ids"], 2]
    texts, wakes = {}, {}
    for interval in (0.0, 3600.0):
        streamer = ReaderTextStreamer(tiny_tokenizer, interval, skip_prompt=False, skip_special_tokens=True, timeout=5)
        notify, count = streamer._ready.notify, []
        streamer._ready.notify = lambda *a, notify=notify, count=count: (count.append(1), notify(*a))[1]
        for token in ids:
            streamer.put(torch.tensor([token]))
        streamer.end()
        texts[interval], wakes[interval] = "".join(streamer), len(count)
    assert texts[0.0] == texts[3600.0] and texts[0.0].strip().startswith("one two")
    assert wakes == {0.0: len(ids) + 1, 3600.0: 3}


def test_the_reader_side_streamer_takes_one_rows_ids(tiny_tokenizer):
    streamer = ReaderTextStreamer(tiny_tokenizer)
    with pytest.raises(ValueError, match="batch size 1"):
        streamer.put(torch.tensor([[1, 2], [3, 4]]))
    streamer.put(torch.tensor([[5, 6]]))  # one row, as generate() hands its first ids over
    streamer.put_ids([7])
    assert streamer._ids == [5, 6, 7]
    with pytest.raises(ValueError, match="skip_prompt"):
        ReaderTextStreamer(tiny_tokenizer, skip_prompt=True)
