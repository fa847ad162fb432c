"""chat.stepproc: the step loop in an engine process of its own gives every request the reply the
static batcher gives it alone, streams each reply to its own reader, leaves what it does not take
to this process's step loop, and fails only the replies in flight when its process dies (later ones
are served here). On the demo model, on the CPU (the engine process takes the CPU when told to)."""

from __future__ import annotations

import os
import signal
import threading
import time
from dataclasses import replace

import pytest
import torch
from adapter_files import make_adapter
from test_stepping import FAST, SETTINGS, TALKS, alone, inputs

from chat.batching import Batcher
from chat.engine import DEMO_DIR, GENERATION_PRESETS, ChatEngine, load_checkpoint
from chat.stepping import StepBatcher, make_batcher
from chat.stepproc import EngineProcessError, ProcessBatcher


@pytest.fixture(scope="module")
def demo():
    return load_checkpoint(str(DEMO_DIR), optimize="none")


@pytest.fixture(scope="module")
def apart():
    batcher = ProcessBatcher(devices=("cpu",))
    yield batcher
    batcher.close()


def test_replies_through_the_engine_process_are_each_requests_alone(demo, apart):
    """Every setting of the step loop's tests (greedy, leaving early, min length, a seeded sample,
    source n-gram blocking), submitted at once so they share steps there."""
    engine = ChatEngine(demo, "test", batcher=Batcher())
    requests = [inputs(engine, i) for i in range(10)]
    expected = [alone(engine._batcher, demo, *r) for r in requests]
    sent = apart.sent
    futures = [apart.submit(demo, *r) for r in requests]
    assert [f.result(120)[0].tolist() for f in futures] == expected
    assert apart.sent - sent == len(requests)  # all of them there, none here


def test_concurrent_streams_are_kept_apart(demo, apart):
    engine = ChatEngine(demo, "test", batcher=apart)
    expected = [ChatEngine(demo, "alone", batcher=Batcher()).reply(t, "and then?", FAST)[0] for t in TALKS]
    results = [None] * len(TALKS)

    def chat(i):
        results[i] = [text for text, _ in engine.stream(TALKS[i], "and then?", FAST)]

    sent = apart.sent
    threads = [threading.Thread(target=chat, args=(i,)) for i in range(len(TALKS))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    for texts, want in zip(results, expected):
        assert texts[-1] == want and all(b.startswith(a) for a, b in zip(texts, texts[1:]))
    assert apart.sent - sent == len(TALKS)


def test_what_it_does_not_take_is_served_in_this_process(demo, apart, tmp_path):
    """Beam search, an int8 model (its quantized layers do not travel) and an adapter's requests go to
    this process's step loop (and its static batcher), with the same replies as alone."""
    faithful = GENERATION_PRESETS["faithful"]
    int8 = load_checkpoint(str(DEMO_DIR), optimize="int8")
    host = ChatEngine(load_checkpoint(str(DEMO_DIR), optimize="none"), "test", batcher=Batcher())
    host.load(str(make_adapter(DEMO_DIR, tmp_path / "bob", seed=1)))
    bob = host.model_for("bob")
    cases = [
        (demo, *inputs(host, 0)[:1], replace(faithful, num_beams=3).generate_kwargs()),
        (int8, inputs(host, 1)[0], FAST.generate_kwargs()),
        (bob, host.build_input(TALKS[2], bob)[0], FAST.generate_kwargs()),
    ]
    for loaded, _encoded, kwargs in cases:
        assert not apart.takes(loaded, kwargs)
    static = Batcher()
    expected = [alone(static, *c) for c in cases]
    sent = apart.sent
    assert [apart.submit(*c).result(120)[0].tolist() for c in cases] == expected
    assert apart.sent == sent


def test_a_dead_engine_process_fails_its_replies_in_flight_and_later_ones_are_served_here(demo):
    batcher = ProcessBatcher(devices=("cpu",))
    engine = ChatEngine(demo, "test", batcher=Batcher())
    encoded, kwargs = inputs(engine, 0)
    want = alone(engine._batcher, demo, encoded, kwargs)
    assert batcher.submit(demo, encoded, kwargs).result(120)[0].tolist() == want  # started, serving
    # A request that stays in flight (128 tokens, none allowed to end it early), then the process dies.
    long = {**kwargs, "min_new_tokens": 120, "max_new_tokens": 128}
    streamer = _Ids()
    future = batcher.submit(demo, encoded, long, streamer)
    streamer.first.wait(60)
    os.kill(batcher._proc.pid, signal.SIGKILL)
    with pytest.raises(EngineProcessError, match="ended"):
        future.result(60)
    assert streamer.ended.wait(10)
    deadline = time.monotonic() + 30
    while batcher.broken is None and time.monotonic() < deadline:
        time.sleep(0.05)
    assert "ended" in batcher.broken
    sent = batcher.sent
    assert batcher.submit(demo, encoded, kwargs).result(120)[0].tolist() == want  # here now
    assert batcher.sent == sent and not batcher.takes(demo, kwargs)


def test_the_scheduler_setting_makes_one(monkeypatch):
    monkeypatch.setenv("CHAT_SCHEDULER", "process")
    batcher = make_batcher()
    assert isinstance(batcher, ProcessBatcher) and batcher.devices == ("cuda",)
    assert batcher._proc is None  # started by its first request, not before


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_on_a_gpu_the_engine_process_steps_the_same_tensors_in_recorded_slots():
    """The engine process takes the model's CUDA tensors (no copy) and replays recorded steps; its
    replies are those of this process's step loop (the same kernels)."""
    loaded = load_checkpoint(str(DEMO_DIR), optimize="none")
    loaded.model.cuda()
    engine = ChatEngine(loaded, "test", batcher=Batcher())
    requests = [inputs(engine, i) for i in range(len(SETTINGS) * 2)]
    local = StepBatcher(max_batch=8)
    want = [f.result(120)[0].tolist() for f in [local.submit(loaded, *r) for r in requests]]
    batcher = ProcessBatcher(max_batch=8)
    try:
        futures = [batcher.submit(loaded, *r) for r in requests]
        assert [f.result(120)[0].tolist() for f in futures] == want
        assert batcher.sent == len(requests)
    finally:
        batcher.close()


class _Ids:
    """A streamer that says when its first token came and when it ended."""

    def __init__(self):
        self.first, self.ended = threading.Event(), threading.Event()

    def put_ids(self, ids):
        if len(ids) and not self.first.is_set():
            self.first.set()

    def end(self):
        self.ended.set()
