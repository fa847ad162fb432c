"""chat.stepping: requests join a running batch at the next decoder step and leave it at their own
end, each with its own settings and stream, and each reply is the one ``generate()`` gives the
request alone (the static batcher serving it by itself is the reference), on the demo model.

Joining is made deterministic with a streamer that submits the next request when its own row has
produced a given number of tokens: the worker admits it before the following step."""

from __future__ import annotations

import threading
from dataclasses import replace

import pytest
from adapter_files import make_adapter
from transformers import TextIteratorStreamer
from transformers.generation.streamers import BaseStreamer

from chat.batching import Batcher
from chat.engine import DEMO_DIR, GENERATION_PRESETS, ChatEngine, Conversation, load_checkpoint
from chat.stepping import StepBatcher, make_batcher, scheduler

FAST = GENERATION_PRESETS["fast"]
TALKS = [
    Conversation("persona", "i love dogs.", ["hi! what do you like to do?"]),
    Conversation("emotion", "angry", ["my neighbour parked in my spot again"]),
    Conversation("topic", "jazz", ["who is your favourite musician and why?"]),
    Conversation("none", "", ["hello"]),
    Conversation("task", "restaurant table", ["i need a table for four tonight, somewhere quiet please"]),
]
SETTINGS = [
    FAST,
    replace(FAST, max_new_tokens=5),  # leaves early
    replace(FAST, repetition_penalty=1.0, no_repeat_ngram_size=0, min_new_tokens=12),
    replace(FAST, do_sample=True, temperature=0.9, top_p=0.8, seed=11),
    replace(FAST, max_new_tokens=20, encoder_no_repeat_ngram_size=2),
]


@pytest.fixture(scope="module")
def demo():
    return load_checkpoint(str(DEMO_DIR), optimize="none")


@pytest.fixture(scope="module")
def static():
    return Batcher()


def alone(static: Batcher, loaded, encoded, kwargs) -> list[int]:
    """The reference: the request served by itself, one generate() (seeded as the engine seeds it)."""
    return static.submit(loaded, encoded, kwargs).result()[0].tolist()


class Tokens(BaseStreamer):
    """Collects a row's streamed ids; after ``after`` new tokens it calls ``then`` once."""

    def __init__(self, after: int | None = None, then=None):
        self.ids, self.ended, self.after, self.then = [], False, after, then

    def put(self, value):
        assert not self.ended
        self.ids += value.reshape(-1).tolist()
        if self.then is not None and len(self.ids) - 1 >= self.after:
            then, self.then = self.then, None
            then()

    def end(self):
        self.ended = True


def inputs(engine: ChatEngine, i: int):
    encoded, _ = engine.build_input(TALKS[i % len(TALKS)])
    kwargs = SETTINGS[i % len(SETTINGS)].generate_kwargs()
    if SETTINGS[i % len(SETTINGS)].seed is not None:
        kwargs["generator_seed"] = SETTINGS[i % len(SETTINGS)].seed
    return encoded, kwargs


def test_requests_join_a_running_batch_and_leave_it_with_their_own_replies(demo, static):
    engine = ChatEngine(demo, "test", batcher=static)
    stepper = StepBatcher(max_batch=4)
    n = 7  # more than max_batch: some wait for a row to leave
    futures, streams = {}, {}

    def submit(i: int) -> None:
        # Request i+1 arrives when request i has made 2 tokens: it joins mid-reply.
        streams[i] = Tokens(2, (lambda: submit(i + 1)) if i + 1 < n else None)
        futures[i] = stepper.submit(demo, *inputs(engine, i), streams[i])

    submit(0)
    for i in range(n):
        while i not in futures:
            threading.Event().wait(0.01)
        got = futures[i].result(timeout=60)[0].tolist()
        assert got == alone(static, demo, *inputs(engine, i)), f"request {i} ({SETTINGS[i % len(SETTINGS)]})"
        assert streams[i].ids == got and streams[i].ended  # its own stream: its own tokens, ended once
    assert stepper.widest == 4  # they did share steps, never more than max_batch
    # Fewer steps than the requests' lengths added up: rows ran side by side.
    assert stepper.steps < sum(len(futures[i].result()[0]) - 1 for i in range(n))


def test_concurrent_streams_are_kept_apart_through_the_engine(demo):
    engine = ChatEngine(demo, "test", batcher=StepBatcher())
    expected = [ChatEngine(demo, "alone", batcher=Batcher()).reply(t, "and then?", FAST)[0] for t in TALKS]
    results = [None] * len(TALKS)

    def chat(i):
        results[i] = [text for text, _ in engine.stream(TALKS[i], "and then?", FAST)]

    threads = [threading.Thread(target=chat, args=(i,)) for i in range(len(TALKS))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    for texts, want in zip(results, expected):
        assert texts[-1] == want and all(b.startswith(a) for a, b in zip(texts, texts[1:]))
    assert engine._batcher.widest > 1


def test_a_seeded_sample_is_the_same_beside_any_neighbours(demo, static):
    engine = ChatEngine(demo, "test", batcher=static)
    stepper = StepBatcher()
    encoded, kwargs = inputs(engine, 3)  # sampling, seed 11
    want = alone(static, demo, encoded, kwargs)
    others = [stepper.submit(demo, *inputs(engine, i)) for i in (0, 1, 2, 4)]
    assert stepper.submit(demo, encoded, kwargs).result(60)[0].tolist() == want
    assert all(f.result(60) is not None for f in others)
    unseeded = {k: v for k, v in kwargs.items() if k != "generator_seed"}
    replies = {tuple(stepper.submit(demo, encoded, unseeded).result(60)[0].tolist()) for _ in range(4)}
    assert len(replies) > 1  # without a seed it does sample


FAITHFUL = GENERATION_PRESETS["faithful"]  # beam 10
MIXED = [  # greedy rows and beam searches of several widths, lengths and length penalties
    FAST,
    FAITHFUL,
    replace(FAST, max_new_tokens=5),
    replace(FAITHFUL, num_beams=3, length_penalty=0.5, min_new_tokens=5),
    FAST,
    replace(FAITHFUL, num_beams=4, max_new_tokens=22),
]


@pytest.mark.parametrize("optimize", ["none", "int8"])
def test_beam_searches_share_steps_with_other_rows_and_reply_as_generate_alone(optimize, demo, static):
    """With ``beams``, a beam-search request is its beams' rows of the running batch (chat.beams): it
    joins mid-reply, its beams are reordered among rows that are not its own, and int8 quantizes them
    together."""
    model = demo if optimize == "none" else load_checkpoint(str(DEMO_DIR), optimize="int8")
    engine = ChatEngine(model, "test", batcher=static)
    requests = [(engine.build_input(TALKS[i % len(TALKS)])[0], s.generate_kwargs()) for i, s in enumerate(MIXED)]
    expected = [alone(static, model, *r) for r in requests]
    stepper = StepBatcher(max_batch=16)  # 20 rows in all: some wait for rows to leave
    stepper.beams = True
    futures = []

    def the_rest():  # sent when the first row has made 2 tokens: they join a running batch
        futures.extend(stepper.submit(model, *r) for r in requests[1:])

    first = stepper.submit(model, *requests[0], Tokens(2, the_rest))
    assert first.result(60)[0].tolist() == expected[0]
    while len(futures) < len(requests) - 1:
        threading.Event().wait(0.01)
    for i, future in enumerate(futures, 1):
        assert future.result(120)[0].tolist() == expected[i], f"request {i} ({MIXED[i]})"
    assert 11 < stepper.widest <= 16  # beams and other rows shared steps, within max_batch rows
    assert stepper.steps < sum(len(e) - 1 for e in expected)


def test_what_beam_search_the_step_loop_takes(demo, static):
    stepper = StepBatcher(max_batch=8)
    assert stepper.takes(demo, FAST.generate_kwargs())
    assert not stepper.takes(demo, replace(FAITHFUL, num_beams=8).generate_kwargs())  # by default: static
    engine = ChatEngine(demo, "test", batcher=stepper)
    assert engine.reply(TALKS[0], "ok", FAITHFUL)[0] and stepper.steps == 0
    stepper.beams = True
    assert stepper.takes(demo, replace(FAITHFUL, num_beams=8).generate_kwargs())
    assert not stepper.takes(demo, FAITHFUL.generate_kwargs())  # 10 beams: more rows than a step has
    assert not stepper.takes(demo, {**replace(FAITHFUL, num_beams=4).generate_kwargs(), "do_sample": True})
    assert not stepper.takes(demo, {**FAST.generate_kwargs(), "num_return_sequences": 2})
    stepper.slots = True  # a GPU's slots: a slot per beam, as many as the slots (gpu_max_batch)
    assert stepper.takes(demo, replace(FAITHFUL, num_beams=8).generate_kwargs())
    assert not stepper.takes(demo, replace(FAITHFUL, num_beams=9).generate_kwargs())
    stepper.beams = False
    assert not stepper.takes(demo, replace(FAITHFUL, num_beams=4).generate_kwargs())
    stepper.slots = None
    engine = ChatEngine(demo, "test", batcher=StepBatcher())
    engine._batcher.beams = True
    want = ChatEngine(demo, "alone", batcher=static).reply(TALKS[0], "ok", FAITHFUL)[0]
    assert engine.reply(TALKS[0], "ok", FAITHFUL)[0] == want and engine._batcher.steps > 0
    encoded, kwargs = engine.build_input(TALKS[1])[0], replace(FAITHFUL, num_beams=4).generate_kwargs()
    with pytest.raises(ValueError, match="beam"):  # as generate() itself: no streamer with beam search
        stepper.submit(demo, encoded, kwargs, Tokens()).result(60)
    assert stepper.steps == 0


def test_int8_rows_share_steps_and_reply_as_alone(static):
    """Dynamic int8 scales activations per call: in a step each row is quantized on its own, so a
    reply does not depend on its neighbours (the static batcher serves int8 requests alone)."""
    int8 = load_checkpoint(str(DEMO_DIR), optimize="int8")
    engine = ChatEngine(int8, "test", batcher=static)
    stepper = StepBatcher()
    requests = [inputs(engine, i) for i in range(len(TALKS))]
    expected = [alone(static, int8, *r) for r in requests]
    futures = [stepper.submit(int8, *r) for r in requests]
    assert [f.result(60)[0].tolist() for f in futures] == expected
    assert stepper.widest > 1


def test_the_scheduler_setting(monkeypatch):
    monkeypatch.delenv("CHAT_SCHEDULER", raising=False)
    assert scheduler() == "step" and isinstance(make_batcher(), StepBatcher)
    monkeypatch.setenv("CHAT_SCHEDULER", "static")
    assert type(make_batcher()) is Batcher
    with pytest.raises(ValueError, match="CHAT_SCHEDULER"):
        scheduler("continuous")


def submit_together(stepper: StepBatcher, requests: list) -> list:
    """Submit ``requests`` (loaded, encoded, kwargs) so that they join one step: the worker is held
    in the first row's first put until all are queued."""
    gate = threading.Event()

    class Held(BaseStreamer):
        def put(self, value):
            gate.wait(10)

        def end(self):
            pass

    futures = [stepper.submit(*requests[0], Held())]
    futures += [stepper.submit(*r) for r in requests[1:]]
    gate.set()
    return futures


def test_rows_of_different_adapters_share_steps_each_through_its_own(tmp_path):
    engine = ChatEngine(load_checkpoint(str(DEMO_DIR), optimize="none"), "test", batcher=Batcher())
    names = ["bob", "ann", "eve"]
    for seed, name in enumerate(names):
        engine.load(str(make_adapter(DEMO_DIR, tmp_path / name, seed=seed)))
    models = [engine.model_for(m) for m in [*names, "demo-model"]]
    settings = [FAST, replace(FAST, max_new_tokens=9), FAST, replace(FAST, min_new_tokens=15)]
    requests = []
    for i, (loaded, s) in enumerate(zip(models, settings)):
        encoded, _ = engine.build_input(TALKS[i], loaded)
        requests.append((loaded, encoded, s.generate_kwargs()))
    expected = [alone(engine._batcher, *r) for r in requests]
    assert len({tuple(e) for e in expected}) == 4  # each adapter answers its own way
    stepper = StepBatcher()
    futures = submit_together(stepper, requests)
    assert [f.result(60)[0].tolist() for f in futures] == expected
    assert stepper.widest == 4


def test_a_beam_search_of_one_adapter_shares_steps_with_another_adapters_rows(tmp_path):
    """With ``beams``, a beam search's rows are its beams: each beam goes through its request's
    adapter (the step's rows of models, one per beam), beside another adapter's and the base's rows."""
    engine = ChatEngine(load_checkpoint(str(DEMO_DIR), optimize="none"), "test", batcher=Batcher())
    for seed, name in enumerate(["bob", "ann"]):
        engine.load(str(make_adapter(DEMO_DIR, tmp_path / name, seed=seed)))
    models = [engine.model_for(m) for m in ["bob", "ann", "demo-model"]]
    settings = [FAST, replace(FAITHFUL, num_beams=3, min_new_tokens=5), FAST]
    requests = [
        (loaded, engine.build_input(TALKS[i], loaded)[0], s.generate_kwargs())
        for i, (loaded, s) in enumerate(zip(models, settings))
    ]
    expected = [alone(engine._batcher, *r) for r in requests]
    stepper = StepBatcher()
    stepper.beams = True
    futures = submit_together(stepper, requests)
    assert [f.result(60)[0].tolist() for f in futures] == expected
    assert stepper.widest == 5  # 1 + 3 beams + 1


def test_a_text_streamer_reads_the_steps_as_it_reads_generate(demo):
    stepper = StepBatcher()
    engine = ChatEngine(demo, "test", batcher=stepper)
    encoded, kwargs = inputs(engine, 0)
    streamer = TextIteratorStreamer(demo.tokenizer, skip_prompt=False, skip_special_tokens=True, timeout=60)
    out = stepper.submit(demo, encoded, kwargs, streamer)
    text = "".join(streamer)
    assert text.strip() == demo.tokenizer.decode(out.result()[0], skip_special_tokens=True).strip()


def test_a_failing_row_fails_its_request_and_the_batch_goes_on(demo):
    stepper = StepBatcher()
    engine = ChatEngine(demo, "test", batcher=stepper)
    encoded, kwargs = inputs(engine, 0)
    bad = stepper.submit(demo, encoded, {**kwargs, "top_k": -3, "do_sample": True})
    with pytest.raises(ValueError):
        bad.result(60)
    assert stepper.submit(demo, encoded, kwargs).result(60)[0].tolist()


def test_rows_of_the_same_settings_share_their_stateless_processors(demo):
    """Building a row's processors is transformers' generate() set-up (~1 ms); rows of the same
    settings reuse one list when every processor keeps no state, and only then."""
    from chat.batching import Request
    from chat.rows import Row

    engine = ChatEngine(demo, "test", batcher=Batcher())
    first, second = (Row(Request(demo, *inputs(engine, i)), demo.model, 1) for i in (0, 5))  # both FAST
    assert first.processors is second.processors and first.stop is second.stop
    encoder_rule = [Row(Request(demo, *inputs(engine, 4)), demo.model, 1) for _ in range(2)]  # its source's n-grams
    assert encoder_rule[0].processors is not encoder_rule[1].processors
    sampled = [Row(Request(demo, *inputs(engine, 3)), demo.model, 1) for _ in range(2)]  # seeded sampling
    assert sampled[0].processors is sampled[1].processors and sampled[0].generator is not sampled[1].generator


def test_the_servers_concurrency_setting(monkeypatch):
    import torch

    from chat.stepping import CPU_MAX_BATCH, GPU_CONCURRENCY, concurrency

    monkeypatch.delenv("CHAT_CONCURRENCY", raising=False)
    assert concurrency() == (GPU_CONCURRENCY if torch.cuda.is_available() else CPU_MAX_BATCH)
    monkeypatch.setenv("CHAT_CONCURRENCY", "32")
    assert concurrency() == 32
    for bad in ("0", "-3", "many", "2000", "1.5"):
        with pytest.raises(ValueError, match="CHAT_CONCURRENCY"):
            concurrency(bad)


def test_requests_joining_at_once_are_each_encoded_alone_and_a_failing_one_leaves_the_others(demo, static):
    """The loop lets all arrived requests join between two steps (the caches grow once for all);
    one that cannot join fails alone, and the others reply as generate() alone."""
    import torch

    from chat.batching import Request
    from chat.stepping import _Batch

    engine = ChatEngine(demo, "test", batcher=static)
    first, *joining = [Request(demo, *inputs(engine, i)) for i in (0, 2, 4)]  # plain, no n-grams, encoder rule
    encoded, kwargs = inputs(engine, 1)
    bad = Request(demo, encoded, {**kwargs, "top_k": -3, "do_sample": True})
    batch = _Batch(demo.model)
    replies = {}
    with torch.inference_mode():
        assert batch.join([first]) == []
        batch.step()  # the first request is one token in when the others join (the base model: no adapter)
        failed = batch.join([joining[0], bad, joining[1]])
        assert [request for request, _ in failed] == [bad] and isinstance(failed[0][1], ValueError)
        assert [row.request for row in batch.rows] == [first, *joining]
        while batch.rows:
            replies.update({id(row.request): row.ids[0].tolist() for row in batch.step()})
    for i, request in zip((0, 2, 4), [first, *joining]):
        assert replies[id(request)] == alone(static, demo, *inputs(engine, i))


def test_the_self_attention_cache_reads_as_its_columns_concatenated():
    """Its columns are written into spare room (moved to a new buffer when it runs out); rows leave,
    reorder and join, and old columns are dropped, as the step loop asks."""
    import torch

    from chat.stepcache import SelfAttention

    cache, want = SelfAttention(2), [None, None]
    g = torch.Generator().manual_seed(0)
    for step in range(3 * SelfAttention.SPARE):
        rows = len(want[0][0]) if want[0] is not None else 3
        for layer in range(2):
            key, value = torch.randn(rows, 2, 1, 4, generator=g), torch.randn(rows, 2, 1, 4, generator=g)
            got = cache.update(key, value, layer)
            old = want[layer]
            want[layer] = (
                (key, value) if old is None else tuple(torch.cat([o, n], 2) for o, n in zip(old, (key, value)))
            )
            assert all(torch.equal(a, b) for a, b in zip(got, want[layer]))
            assert torch.equal(cache.keys[layer], want[layer][0]) and torch.equal(cache.values[layer], want[layer][1])
        if step == 5:  # only the last 4 columns are read from now on
            cache.keep(4)
            want = [(k[:, :, -4:], v[:, :, -4:]) for k, v in want]
        if step == 9:  # row 1 leaves, rows 2 and 0 swap, two rows join
            cache.rows(torch.tensor([2, 0]), added=2)
            want = [tuple(torch.cat([t[[2, 0]], torch.zeros(2, *t.shape[1:])]) for t in pair) for pair in want]
        if step > 9:
            assert all(torch.equal(t, w) for t, w in zip((cache.keys[0], cache.values[0]), want[0]))
