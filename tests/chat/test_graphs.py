"""chat/graphs.py: generate() through StepGraphs gives the sequences plain generate() gives (beam
search, greedy, sampling, padded batches), the model's forward is put back, the decoder step never
reads tensor data on the host (what a CUDA-graph capture needs), and on a GPU the steps replay and
threads that record at once take turns."""

from __future__ import annotations

import pytest
import torch
from torch._subclasses.fake_tensor import DataDependentOutputException, FakeTensorMode
from transformers import AutoTokenizer

from chat.fastgen import CACHE_KWARG, fast_kwargs
from chat.graphs import StepGraphs, _Entry, cache_bytes, cache_length, for_model, record
from chat.model import load_model

TEXTS = ["chatbot: hello there, how are you doing today?", "chatbot: your persona: i like jazz. </s>  <s> hi"]
SETTINGS = {
    "beam": dict(num_beams=4, max_new_tokens=12, min_new_tokens=12, no_repeat_ngram_size=3, repetition_penalty=1.2),
    "greedy": dict(num_beams=1, max_new_tokens=12, min_new_tokens=3, no_repeat_ngram_size=3),
    "sampled": dict(num_beams=1, do_sample=True, top_p=0.9, temperature=0.8, max_new_tokens=12),
}


@pytest.fixture(scope="module")
def tiny(tiny_path):
    return AutoTokenizer.from_pretrained(tiny_path), load_model(tiny_path).eval()


def _generate(model, batch, kwargs, graphs=None):
    torch.manual_seed(0)
    if graphs is None:
        return model.generate(**batch, **kwargs)
    with graphs.decoding(model, batch["input_ids"], kwargs) as cache:
        return model.generate(**batch, **fast_kwargs({**kwargs, **cache}, batch["input_ids"]))


@pytest.mark.parametrize("strategy", SETTINGS)
def test_static_cache_decoding_gives_the_sequences_of_plain_generate(tiny, strategy):
    tokenizer, model = tiny
    batch = tokenizer(TEXTS, return_tensors="pt", padding=True)  # two lengths: one row is padded
    graphs = StepGraphs()
    expected = _generate(model, batch, SETTINGS[strategy])
    for call in range(2):  # the second call reuses (and resets) the first call's cache
        assert torch.equal(_generate(model, batch, SETTINGS[strategy], graphs), expected)
        (entry,) = graphs._entries.values()
        # the first step runs from static copies of its inputs (what a GPU records) from the second call on
        assert (entry.encoder_hidden is not None) == (call == 1)


def test_forward_is_put_back_even_on_errors(tiny):
    tokenizer, model = tiny
    batch = tokenizer(TEXTS[:1], return_tensors="pt")
    graphs = StepGraphs()
    with pytest.raises(RuntimeError, match="boom"):
        with graphs.decoding(model, batch["input_ids"], SETTINGS["greedy"]):
            assert "forward" in model.__dict__
            raise RuntimeError("boom")
    assert "forward" not in model.__dict__

    def wrapped(*args, **kwargs):  # as accelerate's mixed-precision wrapper sets one
        return type(model).forward(model, *args, **kwargs)

    model.forward = wrapped
    try:
        with graphs.decoding(model, batch["input_ids"], SETTINGS["greedy"]):
            assert model.forward is not wrapped
        assert model.forward is wrapped
    finally:
        del model.forward


def test_one_cache_per_shape_least_recently_used_dropped(tiny):
    tokenizer, model = tiny
    graphs = StepGraphs(capacity=2)
    for text in ["chatbot: hi", "chatbot: hi there", "chatbot: hi", "chatbot: hello to you too"]:
        batch = tokenizer([text], return_tensors="pt")
        _generate(model, batch, SETTINGS["greedy"], graphs)
    lengths = [key[1] for key in graphs._entries]
    assert len(lengths) == 2 and lengths[-1] == len(tokenizer("chatbot: hello to you too")["input_ids"])
    assert lengths[0] == len(tokenizer("chatbot: hi")["input_ids"])  # used again, so kept over "hi there"


def test_caches_beyond_the_memory_budget_are_dropped(tiny):
    tokenizer, model = tiny
    one = cache_bytes(model.config, 1, 13 + len(tokenizer("chatbot: hi")["input_ids"]), model.dtype)
    graphs = StepGraphs(capacity=8, budget_bytes=int(1.5 * one))  # room for one short chat's caches
    for text in ["chatbot: hi", "chatbot: hi"]:
        _generate(model, tokenizer([text], return_tensors="pt"), SETTINGS["greedy"], graphs)
    assert len(graphs._entries) == 1 and graphs.held_bytes() == one
    _generate(model, tokenizer(["chatbot: hello to you"], return_tensors="pt"), SETTINGS["greedy"], graphs)
    assert len(graphs._entries) == 1 and list(graphs._entries)[0][1] > 4  # only the newest is kept
    entry = next(iter(graphs._entries.values()))
    held = sum(
        t.numel() * t.element_size()
        for half in (entry.cache.self_attention_cache, entry.cache.cross_attention_cache)
        for layer in half.layers
        for t in (layer.keys, layer.values)
    )
    assert held == entry.bytes  # the estimate is what the caches hold


def test_cache_length_and_one_graph_set_per_model(tiny):
    _, model = tiny
    assert cache_length({"max_new_tokens": 24}, model) == 25
    assert cache_length({"max_length": 40}, model) == 40
    assert for_model(model) is for_model(model)


def _fake_caches(cache) -> FakeTensorMode:
    fake = FakeTensorMode(allow_non_fake_inputs=True)
    for half in (cache.self_attention_cache, cache.cross_attention_cache):
        for layer in half.layers:
            layer.keys, layer.values = fake.from_tensor(layer.keys), fake.from_tensor(layer.values)
            layer.cumulative_length = fake.from_tensor(layer.cumulative_length)
    return fake


def _first_step(tokenizer, model):
    """A fresh shape's entry and the kwargs of its first decoder step (as generate() makes them
    without a decoder mask: transformers before 5.2x)."""
    batch = tokenizer(TEXTS, return_tensors="pt", padding=True)
    entry = StepGraphs()._entry(model, 2, batch["input_ids"].shape[1], 8)
    first = dict(
        decoder_input_ids=torch.full((2, 1), model.config.decoder_start_token_id),
        encoder_outputs=model.get_encoder()(**batch),
        attention_mask=batch["attention_mask"],
        use_cache=True,
        **{CACHE_KWARG: entry.cache},
    )
    return entry, first


@pytest.mark.parametrize("attention", ["sdpa", "eager"])
def test_decoder_step_reads_no_tensor_data_on_the_host(tiny, attention):
    """A CUDA graph records kernels only: a step that turns a tensor into a Python value (``.item()``,
    a size from a tensor, ``if tensor``) cannot be captured. Under fake tensors that raises, so the
    step StepGraphs captures (after the first, which fills the cross-attention cache) runs that way
    here, on the CPU, with every cache tensor fake (real 0-d tensors would pass as constants)."""
    tokenizer, model = tiny
    model.set_attn_implementation(attention)
    entry, first = _first_step(tokenizer, model)
    try:
        with torch.no_grad():
            model(**first)
            assert entry.cache.cross_ready()
            step = entry.step_kwargs(first)
            with _fake_caches(entry.cache):
                assert model(**step).logits.shape[:2] == (2, 1)
                without_mask = {k: v for k, v in step.items() if k != "decoder_attention_mask"}
                with pytest.raises(DataDependentOutputException):  # the check can fail: this step syncs
                    model(**without_mask)
    finally:
        model.set_attn_implementation("sdpa")


@pytest.mark.parametrize("attention", ["sdpa", "eager"])
def test_first_decoder_step_reads_no_tensor_data_on_the_host(tiny, attention):
    """The first step is recorded too: it projects the encoder's output into the cross-attention
    cache (from static copies of its inputs) and must read nothing on the host either."""
    tokenizer, model = tiny
    model.set_attn_implementation(attention)
    entry, first = _first_step(tokenizer, model)
    try:
        with torch.no_grad():
            static = entry.step_kwargs(first, first=True)
            assert static["encoder_outputs"][0] is entry.encoder_hidden
            expected = model(**static).logits  # also allocates the cache's tensors
            entry.cache.reset()
            assert not entry.cache.cross_ready()
            with _fake_caches(entry.cache):
                assert model(**static).logits.shape == expected.shape
            assert entry.cache.cross_ready()
    finally:
        model.set_attn_implementation("sdpa")


def _handed_kwargs(model, batch, monkeypatch) -> tuple[_Entry, dict]:
    """The static kwargs generate() hands the recorded forward (first step and a later one), from
    two beam-search calls on one shape; the shape's entry is not used again after a check."""
    seen, step_kwargs = {}, _Entry.step_kwargs

    def spy(self, kw, first=False):
        static = step_kwargs(self, kw, first)
        seen.setdefault("first" if first else "step", static)
        return static

    monkeypatch.setattr(_Entry, "step_kwargs", spy)
    graphs = StepGraphs()
    for _ in range(2):  # the first step takes its static inputs from the shape's second call on
        _generate(model, batch, SETTINGS["beam"], graphs)
    monkeypatch.setattr(_Entry, "step_kwargs", step_kwargs)
    assert set(seen) == {"first", "step"}  # generate() went through both
    (entry,) = graphs._entries.values()
    entry.cache.reset()
    return entry, seen


@pytest.mark.parametrize("attention", ["sdpa", "eager"])
def test_the_steps_generate_hands_the_graphs_read_no_tensor_data_on_the_host(tiny, attention, monkeypatch):
    """The same check on the very kwargs generate() hands the recorded forward, whatever this
    transformers release passes (5.2x adds a 4-D decoder mask that older releases do not): the
    first step's and a later step's, each run under fake tensors."""
    tokenizer, model = tiny
    model.set_attn_implementation(attention)
    batch = tokenizer(TEXTS, return_tensors="pt", padding=True)
    try:
        with torch.no_grad():
            entry, seen = _handed_kwargs(model, batch, monkeypatch)
            with _fake_caches(entry.cache):
                model(**seen["first"])
            assert entry.cache.cross_ready()
            entry, seen = _handed_kwargs(model, batch, monkeypatch)
            model(**seen["first"])  # fills the cross-attention cache for real
            with _fake_caches(entry.cache):
                assert model(**seen["step"]).logits.shape[1] == 1
    finally:
        model.set_attn_implementation("sdpa")


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("strategy", SETTINGS)
def test_graph_replay_gives_the_sequences_of_plain_generate(tiny_path, strategy):
    tokenizer = AutoTokenizer.from_pretrained(tiny_path)
    model = load_model(tiny_path).eval().cuda()
    batch = tokenizer(TEXTS, return_tensors="pt", padding=True).to("cuda")
    graphs = StepGraphs()
    expected = _generate(model, batch, SETTINGS[strategy])
    for _ in range(2):
        assert torch.equal(_generate(model, batch, SETTINGS[strategy], graphs), expected)
    assert graphs.replays > 0 and not any(entry.failed for entry in graphs._entries.values())
    # every step came from a graph, the first included: one replay per new token per generate() call
    assert all(entry.first.graph is not None and entry.step.graph is not None for entry in graphs._entries.values())


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_threads_recording_at_once_take_turns():
    # The static batcher (beam searches) and the step loop record in threads of their own; two
    # captures at once failed with cudaErrorIllegalState, then crashed the process (an H200).
    import threading

    start, results, errors = threading.Barrier(2), {}, []

    def record_and_replay(k: int) -> None:
        torch.manual_seed(k)
        x, y = torch.rand(64, 64, device="cuda"), torch.empty(64, 64, device="cuda")

        def body():  # long enough for the two threads' recordings to overlap
            z = x
            for _ in range(200):
                z = torch.tanh(z @ x)
            y.copy_(z)

        body()
        expected = y.cpu()
        start.wait()
        try:
            for _ in range(10):
                y.zero_()
                graph, _ = record(body)
                graph.replay()
                results.setdefault(k, []).append(torch.allclose(y.cpu(), expected))
        except Exception as err:
            errors.append(err)

    threads = [threading.Thread(target=record_and_replay, args=(k,)) for k in range(2)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert not errors and results == {0: [True] * 10, 1: [True] * 10}


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_a_failed_recording_reports_what_its_pool_took():
    # The slots' graphs share one pool, which keeps what a failed recording reserved: the budget
    # must count it, or failed shapes grow the pool past it unseen.
    from chat.graphs import CaptureError

    pool = torch.cuda.graph_pool_handle()
    keep = []

    def body():  # 64 MiB from the pool, then a read on the host, which no recording allows
        keep.append(torch.ones(16 << 20, device="cuda"))
        keep[-1].sum().item()

    with pytest.raises(CaptureError) as failed:
        record(body, warm=lambda: None, pool=pool)
    # Most of those 64 MiB, not all of them: reserved memory is the whole process's (62 MiB on an
    # H100, 2026-12-06); a failure that reported nothing would be 0.
    assert failed.value.held >= 32 << 20
    x = torch.rand(8, device="cuda")  # the process serves on: an eager op and a recording after it
    graph, _ = record(lambda: x.mul_(2), pool=pool)
    before = x.clone()
    graph.replay()
    assert torch.equal(x, before * 2)
