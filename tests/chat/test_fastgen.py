"""chat/fastgen.py: its n-gram processors ban exactly what transformers' own ban, its lazily
reordered beam cache holds what transformers' holds, and generate() with ``fast_kwargs`` (those
processors + the beam cache), also inside ``grouped_beams``, returns the sequences of transformers'
own generate()."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from transformers import AutoTokenizer
from transformers.cache_utils import DynamicLayer
from transformers.generation.logits_process import EncoderNoRepeatNGramLogitsProcessor, NoRepeatNGramLogitsProcessor

from chat.fastgen import (
    CACHE_KWARG,
    BeamCache,
    EncoderNoRepeatNGram,
    LazyReorderLayer,
    NoRepeatNGram,
    fast_kwargs,
    grouped_beams,
)
from chat.model import load_model


def _ids(draw_seed: int, shape: tuple[int, int], vocab: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(draw_seed)
    return torch.randint(0, vocab, shape, generator=g)


@settings(max_examples=60, deadline=None)
@given(
    n=st.integers(1, 4),
    hyps=st.integers(1, 6),
    length=st.integers(1, 14),
    vocab=st.integers(2, 6),
    seed=st.integers(0, 10_000),
)
def test_decoder_blocking_matches_transformers(n, hyps, length, vocab, seed):
    # A tiny vocabulary makes repeated n-grams (the interesting case) common.
    input_ids = _ids(seed, (hyps, length), vocab)
    scores = torch.randn(hyps, vocab + 2, generator=torch.Generator().manual_seed(seed + 1))
    expected = NoRepeatNGramLogitsProcessor(n)(input_ids, scores.clone())
    assert torch.equal(NoRepeatNGram(n)(input_ids, scores.clone()), expected)


@settings(max_examples=60, deadline=None)
@given(
    n=st.integers(1, 4),
    batch=st.integers(1, 3),
    beams=st.integers(1, 4),
    src=st.integers(1, 12),
    length=st.integers(1, 10),
    vocab=st.integers(2, 6),
    seed=st.integers(0, 10_000),
)
def test_encoder_blocking_matches_transformers(n, batch, beams, src, length, vocab, seed):
    encoder_ids = _ids(seed, (batch, src), vocab)
    input_ids = _ids(seed + 1, (batch * beams, length), vocab)
    scores = torch.randn(batch * beams, vocab, generator=torch.Generator().manual_seed(seed + 2))
    expected = EncoderNoRepeatNGramLogitsProcessor(n, encoder_ids)(input_ids, scores.clone())
    assert torch.equal(EncoderNoRepeatNGram(n, encoder_ids)(input_ids, scores.clone()), expected)


def test_encoder_blocking_bans_the_copied_continuation():
    encoder = torch.tensor([[5, 6, 7, 8]])
    out = EncoderNoRepeatNGram(3, encoder)(torch.tensor([[1, 5, 6]]), torch.zeros(1, 10))
    assert out[0, 7] == -float("inf")
    assert torch.isfinite(out[0, [0, 1, 2, 3, 4, 5, 6, 8, 9]]).all()


def test_fast_kwargs_rewrites_only_the_ngram_rules():
    ids = torch.tensor([[1, 2, 3]])
    out = fast_kwargs({"num_beams": 4, "no_repeat_ngram_size": 3, "encoder_no_repeat_ngram_size": 2}, ids)
    assert out["num_beams"] == 4
    assert out["no_repeat_ngram_size"] == 0 and out["encoder_no_repeat_ngram_size"] == 0
    assert [type(p) for p in out["logits_processor"]] == [NoRepeatNGram, EncoderNoRepeatNGram]
    assert isinstance(out[CACHE_KWARG], BeamCache)
    plain = fast_kwargs({"num_beams": 1}, ids)
    assert "logits_processor" not in plain and plain["no_repeat_ngram_size"] == 0
    assert CACHE_KWARG not in plain and "past_key_values" not in plain  # greedy/sampling never reorder a cache
    # CUDA graphs (the static cache) are asked for by serving only, and only happen on a GPU.
    assert "cache_implementation" not in fast_kwargs({"num_beams": 1}, ids, cuda_graphs=True)
    with pytest.raises(ValueError):
        NoRepeatNGram(0)


TEXTS = [
    "chatbot: hello there, how are you?",
    "chatbot: your persona: i like jazz. </s>  <s> hi",
    "hi",  # much shorter: padded
    "chatbot: your persona: i have two dogs. your persona: i love to hike. </s>  <s> what do you do for fun?",
]
# (beams, rows, max_length, min_length): max > min lets beams end early (eos) at different steps.
CASES = [(1, 2, 30, 20), (2, 1, 24, 4), (3, 3, 24, 10), (4, 4, 40, 30), (10, 2, 20, 20), (10, 4, 24, 6)]


@pytest.fixture(scope="module")
def tiny(tiny_path):
    """The tiny model on eager attention (what generate() is compared with), and its tokenizer."""
    model = load_model(tiny_path).eval()
    model.set_attn_implementation("eager")
    return model, AutoTokenizer.from_pretrained(tiny_path)


def _setup(tiny, beams: int, rows: int, max_length: int, min_length: int):
    model, tokenizer = tiny
    batch = tokenizer(TEXTS[:rows], return_tensors="pt", padding=True)
    # Sampling-free settings in the seed's style, long enough for repeats to be blocked.
    kwargs = dict(
        num_beams=beams,
        max_length=max_length,
        min_length=min_length,
        no_repeat_ngram_size=2,
        encoder_no_repeat_ngram_size=2,
        repetition_penalty=1.2,
        do_sample=False,
    )
    return model, batch, kwargs


@pytest.mark.parametrize(("beams", "rows", "max_length", "min_length"), CASES)
def test_generate_gives_the_same_sequences(tiny, beams, rows, max_length, min_length):
    model, batch, kwargs = _setup(tiny, beams, rows, max_length, min_length)
    expected = model.generate(**batch, **kwargs)
    fast = fast_kwargs(kwargs, batch["input_ids"])
    assert torch.equal(model.generate(**batch, **fast), expected)
    if beams > 1:  # the lazily reordered layers were the ones used
        layers = fast[CACHE_KWARG].self_attention_cache.layers
        assert layers and all(type(layer) is LazyReorderLayer for layer in layers)


@pytest.mark.parametrize(("beams", "rows", "max_length", "min_length"), [c for c in CASES if c[0] > 1])
def test_grouped_beams_gives_the_same_sequences(tiny, beams, rows, max_length, min_length):
    """Grouped cross-attention over a cross cache of one row per input: transformers' sequences, and
    that cache really holds ``rows`` rows (the dedupe cannot silently go); after the block the
    model is as before (attention, no hooks) and a BeamCache holds one cross row per hypothesis."""
    model, batch, kwargs = _setup(tiny, beams, rows, max_length, min_length)
    expected = model.generate(**batch, **kwargs)
    fast = fast_kwargs(kwargs, batch["input_ids"])
    with grouped_beams(model, beams):
        got = model.generate(**batch, **fast)
    assert torch.equal(got, expected)
    cross = fast[CACHE_KWARG].cross_attention_cache.layers
    assert len(cross) == model.config.decoder_layers
    assert all(layer.keys.shape[0] == rows and layer.values.shape[0] == rows for layer in cross)
    assert model.config._attn_implementation == "eager"
    assert not any(m._forward_pre_hooks for m in model.modules())
    after = fast_kwargs(kwargs, batch["input_ids"])
    assert torch.equal(model.generate(**batch, **after), expected)
    assert after[CACHE_KWARG].cross_attention_cache.layers[0].keys.shape[0] == rows * beams


def test_grouped_beams_without_a_beam_cache_gives_the_same_sequences(tiny):
    """transformers' own cache (reordered by hypothesis) keeps per-hypothesis cross rows: the grouped
    attention then reads every beams-th row."""
    model, batch, kwargs = _setup(tiny, 4, 3, 20, 8)
    expected = model.generate(**batch, **kwargs)
    with grouped_beams(model, 4):
        assert torch.equal(model.generate(**batch, **kwargs), expected)


def test_lazy_reorder_layer_holds_what_dynamic_layer_holds():
    """Updates, reorders (two in a row compose), reads with a reorder pending, crop and reset."""
    g = torch.Generator().manual_seed(0)
    lazy, plain = LazyReorderLayer(), DynamicLayer()

    def states(hyps=6, n=1):
        return torch.randn(hyps, 2, n, 4, generator=g), torch.randn(hyps, 2, n, 4, generator=g)

    def same(got, want):
        assert all(torch.equal(x, y) for x, y in zip(got, want, strict=True))

    def order():
        return torch.randint(0, 6, (6,), generator=g)

    for layer in (lazy, plain):
        layer.reorder_cache(torch.arange(6))  # before any update: nothing to reorder
    for step in range(6):
        k, v = states(n=3 if step == 0 else 1)
        same(lazy.update(k, v), plain.update(k, v))
        for _ in range(1 + step % 2):
            idx = order()
            lazy.reorder_cache(idx)
            plain.reorder_cache(idx)
        assert lazy._order is not None and lazy.get_seq_length() == plain.get_seq_length()
        if step == 3:  # read while a reorder is pending: applied first
            same((lazy.keys, lazy.values), (plain.keys, plain.values))
            assert lazy._order is None
    idx = order()
    lazy.reorder_cache(idx)
    plain.reorder_cache(idx)
    lazy.crop(-2)
    plain.crop(-2)
    same((lazy.keys, lazy.values), (plain.keys, plain.values))
    idx = order()
    for layer in (lazy, plain):  # (transformers 5.17 zeroes the history, later releases drop it)
        layer.reorder_cache(idx)
        layer.reset()
    assert lazy._order is None and lazy.get_seq_length() == plain.get_seq_length()
    k, v = states()
    same(lazy.update(k, v), plain.update(k, v))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_cuda_graph_decoding_gives_the_same_sequences(tiny_path):
    tokenizer = AutoTokenizer.from_pretrained(tiny_path)
    model = load_model(tiny_path).eval().cuda()
    kwargs = dict(num_beams=1, max_new_tokens=24, min_new_tokens=24, no_repeat_ngram_size=3, repetition_penalty=1.2)
    for text in ["chatbot: hello there, how are you?", "chatbot: your persona: i like jazz. </s>  <s> hi"]:
        batch = tokenizer([text], return_tensors="pt").to("cuda")
        expected = model.generate(**batch, **fast_kwargs(kwargs, batch["input_ids"]))
        graphed = fast_kwargs(kwargs, batch["input_ids"], cuda_graphs=True)
        assert graphed["cache_implementation"] == "static"
        assert torch.equal(model.generate(**batch, **graphed), expected)


def test_beam_grouped_attention_is_eager_attention_on_beam_copies(tiny):
    """Cross-attention with each input's keys/values repeated per beam (as generate() lays them out)
    or given once per input (the cache ``grouped_beams`` fills): the grouped form gives eager
    attention's output, masks included; elsewhere it is eager itself."""
    from transformers.models.blenderbot.modeling_blenderbot import eager_attention_forward

    from chat.fastgen import _BEAMS, beam_grouped_attention

    layer = tiny[0].model.decoder.layers[0]
    rows, beams, heads, dim, source = 3, 4, 4, 8, 7
    g = torch.Generator().manual_seed(0)
    query = torch.randn(rows * beams, heads, 1, dim, generator=g)
    once = [torch.randn(rows, heads, source, dim, generator=g) for _ in "kv"]
    key, value = (t.repeat_interleave(beams, 0) for t in once)
    mask = torch.zeros(rows * beams, 1, 1, source)
    mask[:beams, ..., -2:] = torch.finfo(torch.float32).min  # the first input is padded
    expected, _ = eager_attention_forward(layer.encoder_attn, query, key, value, mask, scaling=0.3)
    token = _BEAMS.set(beams)
    try:
        for k, v in ((key, value), once):
            got, weights = beam_grouped_attention(layer.encoder_attn, query, k, v, mask, scaling=0.3)
            assert weights is None and torch.allclose(got, expected, atol=1e-6)
        # Self-attention (causal) is never grouped: its keys differ per beam.
        _, self_weights = beam_grouped_attention(layer.self_attn, query, key, value, mask, scaling=0.3)
        assert self_weights is not None
        # Two query positions are not grouped: per-input keys are repeated per hypothesis for eager.
        query2 = torch.randn(rows * beams, heads, 2, dim, generator=g)
        mask2 = mask.expand(-1, -1, 2, -1)
        expected2, _ = eager_attention_forward(layer.encoder_attn, query2, key, value, mask2, scaling=0.3)
        got2, _ = beam_grouped_attention(layer.encoder_attn, query2, *once, mask2, scaling=0.3)
        assert torch.equal(got2, expected2)
    finally:
        _BEAMS.reset(token)
