"""chat/fastgen.py: its n-gram processors ban exactly what transformers' own ban, and generate()
with ``fast_kwargs`` (those processors + the beam cache) returns the same sequences as without."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from transformers import AutoTokenizer
from transformers.generation.logits_process import EncoderNoRepeatNGramLogitsProcessor, NoRepeatNGramLogitsProcessor

from chat.fastgen import CACHE_KWARG, BeamCache, EncoderNoRepeatNGram, NoRepeatNGram, fast_kwargs
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


@pytest.mark.parametrize("num_beams", [1, 4, 10])
def test_generate_gives_the_same_sequences(tiny_path, num_beams):
    tokenizer = AutoTokenizer.from_pretrained(tiny_path)
    model = load_model(tiny_path).eval()
    batch = tokenizer(
        ["chatbot: hello there, how are you?", "chatbot: your persona: i like jazz. </s>  <s> hi"],
        return_tensors="pt",
        padding=True,
    )
    # Sampling-free settings in the seed's style, long enough for repeats to be blocked.
    kwargs = dict(
        num_beams=num_beams,
        max_length=40,
        min_length=30,
        no_repeat_ngram_size=2,
        encoder_no_repeat_ngram_size=2,
        repetition_penalty=1.2,
        do_sample=False,
    )
    torch.manual_seed(0)
    expected = model.generate(**batch, **kwargs)
    got = model.generate(**batch, **fast_kwargs(kwargs, batch["input_ids"]))
    assert torch.equal(got, expected)


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


def test_beam_grouped_attention_is_eager_attention_on_beam_copies(tiny_path):
    """Cross-attention with each input's keys/values repeated per beam (as generate() lays them out):
    the grouped form gives eager attention's output, masks included; elsewhere it is eager itself."""
    from transformers.models.blenderbot.modeling_blenderbot import eager_attention_forward

    from chat.fastgen import _BEAMS, beam_grouped_attention

    layer = load_model(tiny_path).eval().model.decoder.layers[0]
    rows, beams, heads, dim, source = 3, 4, 4, 8, 7
    g = torch.Generator().manual_seed(0)
    query = torch.randn(rows * beams, heads, 1, dim, generator=g)
    key, value = (torch.randn(rows, heads, source, dim, generator=g).repeat_interleave(beams, 0) for _ in "kv")
    mask = torch.zeros(rows * beams, 1, 1, source)
    mask[:beams, ..., -2:] = torch.finfo(torch.float32).min  # the first input is padded
    expected, _ = eager_attention_forward(layer.encoder_attn, query, key, value, mask, scaling=0.3)
    token = _BEAMS.set(beams)
    try:
        got, weights = beam_grouped_attention(layer.encoder_attn, query, key, value, mask, scaling=0.3)
        assert weights is None and torch.allclose(got, expected, atol=1e-6)
        # Self-attention (causal) is never grouped: its keys differ per beam.
        _, self_weights = beam_grouped_attention(layer.self_attn, query, key, value, mask, scaling=0.3)
        assert self_weights is not None
    finally:
        _BEAMS.reset(token)


def test_grouped_beams_generates_the_sequences_of_eager_attention(tiny_path):
    from chat.fastgen import grouped_beams

    tokenizer = AutoTokenizer.from_pretrained(tiny_path)
    model = load_model(tiny_path).eval()
    model.set_attn_implementation("eager")
    batch = tokenizer(
        ["chatbot: hello there, how are you?", "chatbot: your persona: i like jazz. </s>  <s> hi"],
        return_tensors="pt",
        padding=True,
    )
    kwargs = dict(num_beams=10, max_length=16, min_length=16, no_repeat_ngram_size=3, repetition_penalty=1.2)
    expected = model.generate(**batch, **fast_kwargs(kwargs, batch["input_ids"]))
    with grouped_beams(model, 10):
        got = model.generate(**batch, **fast_kwargs(kwargs, batch["input_ids"]))
    assert model.config._attn_implementation == "eager"  # put back
    assert torch.equal(got, expected)
