"""generate() made fast for the seed's beam settings, with identical outputs.

1. N-gram blocking as whole-tensor operations. The seed's evaluation and the ``faithful`` chat
   preset block repeated n-grams in the reply (``no_repeat_ngram_size``) and n-grams copied from
   the input (``encoder_no_repeat_ngram_size``). transformers implements the encoder rule as a
   Python loop over every hypothesis with a ``.tolist()`` per hypothesis per step: with beam 10
   over an evaluation batch that is thousands of GPU round-trips per generated token. (Older
   releases loop for the decoder rule too.) These processors ban exactly the same tokens (tests
   compare them with transformers' own on random inputs).
2. A beam-search cache that does not reorder the cross-attention keys/values. After each step
   beam search copies the whole cache into the surviving beams' order; the cross-attention half
   (every decoder layer x 128 encoder positions) holds the same values for every beam of one
   input, and beams never move between inputs, so that copy changes nothing. On H200s it was
   over half of evaluation time.

3. On a GPU, with ``cuda_graphs``, greedy and sampled replies use transformers' static cache,
   which makes generate() compile the decoder step into CUDA graphs
   (``cache_implementation="static"``; ~60 s of compiling per model, beam search left eager). The
   chat engine does this only with ``CHAT_CUDA_GRAPHS=compile``: its default, ``chat.graphs``,
   records the step itself for every strategy in about a second (docs/chat-benchmarks.md).

4. Beam-grouped cross-attention (``grouped_beams``): every beam of one input attends over the same
   encoder keys/values, yet attention reads them once per beam (beam 10: ten copies, per layer, per
   step). This attention (eager otherwise) reads them once per input and treats the beams as ten
   query positions: one matrix product per input instead of ten vector products. For evaluation's
   large batches (``--eval_attention grouped``); same math, rounding may differ from eager's.

``fast_kwargs`` turns generate() keyword arguments into ones that use 1-3.
"""

from __future__ import annotations

import contextvars
from contextlib import contextmanager

import torch
from transformers import AttentionInterface, DynamicCache, EncoderDecoderCache, LogitsProcessor, LogitsProcessorList
from transformers.generation import utils as generation_utils
from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, AttentionMaskInterface
from transformers.models.blenderbot.modeling_blenderbot import eager_attention_forward

# generate()'s keyword for a cache object: "cache" in newer transformers, which warns about (and
# from 5.40 drops) the old "past_key_values".
CACHE_KWARG = "cache" if "cache" in getattr(generation_utils, "ALL_CACHE_NAMES", ()) else "past_key_values"


def _ban(scores: torch.Tensor, matches: torch.Tensor, candidates: torch.Tensor) -> torch.Tensor:
    """-inf at ``candidates[h, w]`` for every window ``w`` that ``matches`` for hypothesis ``h``."""
    vocab = scores.shape[-1]
    # Non-matching windows (and ids past the scores' width) go to a spare column that is dropped.
    banned = torch.zeros((scores.shape[0], vocab + 1), dtype=torch.bool, device=scores.device)
    banned.scatter_(1, torch.where(matches, candidates.clamp(max=vocab), vocab), True)
    return scores.masked_fill(banned[:, :vocab], -float("inf"))


class NoRepeatNGram(LogitsProcessor):
    """No n-gram of size ``n`` occurs twice in the generated sequence."""

    def __init__(self, n: int):
        if n < 1:
            raise ValueError(f"n-gram size must be >= 1, got {n}")
        self.n = n

    def __call__(self, input_ids: torch.LongTensor, scores: torch.Tensor) -> torch.Tensor:
        length = input_ids.shape[1]
        if length < self.n:
            return scores
        windows = input_ids.unfold(1, self.n, 1)  # (hyps, length - n + 1, n)
        tail = input_ids[:, length - self.n + 1 :]  # the n-1 tokens the next one would extend
        matches = (windows[..., :-1] == tail[:, None, :]).all(-1)
        return _ban(scores, matches, windows[..., -1])


class EncoderNoRepeatNGram(LogitsProcessor):
    """No n-gram of size ``n`` from the encoder input is repeated in the output."""

    def __init__(self, n: int, encoder_input_ids: torch.LongTensor):
        if n < 1:
            raise ValueError(f"n-gram size must be >= 1, got {n}")
        if encoder_input_ids.dim() == 1:
            encoder_input_ids = encoder_input_ids[None]
        self.n = n
        self.batch = encoder_input_ids.shape[0]
        self.windows = encoder_input_ids.unfold(1, n, 1) if encoder_input_ids.shape[1] >= n else None
        self._expanded: tuple[int, torch.Tensor] | None = None  # windows repeated per beam, made once

    def _per_hypothesis(self, hyps: int) -> torch.Tensor:
        if self._expanded is None or self._expanded[0] != hyps:
            if hyps % self.batch:
                raise ValueError(f"{hyps} hypotheses do not divide into {self.batch} inputs")
            # generate() lays hypotheses out input by input: input b owns rows b*beams ... b*beams+beams-1.
            self._expanded = (hyps, self.windows.repeat_interleave(hyps // self.batch, dim=0))
        return self._expanded[1]

    def __call__(self, input_ids: torch.LongTensor, scores: torch.Tensor) -> torch.Tensor:
        length = input_ids.shape[1]
        if self.windows is None or length < self.n - 1:
            return scores
        windows = self._per_hypothesis(input_ids.shape[0]).to(input_ids.device)
        tail = input_ids[:, length - self.n + 1 :]
        matches = (windows[..., :-1] == tail[:, None, :]).all(-1)
        return _ban(scores, matches, windows[..., -1])


class BeamCache(EncoderDecoderCache):
    """An encoder-decoder cache whose beam reordering skips the (beam-invariant) cross-attention."""

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        self.self_attention_cache.reorder_cache(beam_idx)


def fast_kwargs(kwargs: dict, input_ids: torch.LongTensor, cuda_graphs: bool = False) -> dict:
    """generate() kwargs with the n-gram rules done by the processors above, for beam search
    the cache above, and with ``cuda_graphs`` on a GPU the static cache for greedy and
    sampling. Serving asks for graphs; evaluation does not (its batches change shape every
    call, and each new shape would compile).

    The n-gram sizes are set to 0 (not dropped) so that a model's own generation_config, which
    for BlenderBot sets both to 3, cannot switch transformers' slow versions back on.
    """
    out = dict(kwargs)
    processors = LogitsProcessorList(out.pop("logits_processor", None) or [])
    size = out.get("no_repeat_ngram_size") or 0
    encoder_size = out.get("encoder_no_repeat_ngram_size") or 0
    if size > 0:
        processors.append(NoRepeatNGram(size))
    if encoder_size > 0:
        processors.append(EncoderNoRepeatNGram(encoder_size, input_ids))
    out.update(no_repeat_ngram_size=0, encoder_no_repeat_ngram_size=0)
    if processors:
        out["logits_processor"] = processors
    if (out.get("num_beams") or 1) > 1:
        if "past_key_values" not in out and "cache" not in out:
            out[CACHE_KWARG] = BeamCache(DynamicCache(), DynamicCache())
    elif cuda_graphs and input_ids.device.type == "cuda":
        out.setdefault("cache_implementation", "static")
    return out


GROUPED = "beam_grouped"  # the attention implementation's registered name
_BEAMS = contextvars.ContextVar("beams_per_input", default=1)
# Each input's keys/values, made once per generate() call: the cross-attention cache holds the same
# tensors at every step (BeamCache never reorders it), and taking every beams-th row of it is a
# copy (the rows no longer merge with the heads into one batch dimension for the matmul).
_PER_INPUT = contextvars.ContextVar("per_input_keys_values", default=None)


def beam_grouped_attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
    """Eager attention, except that decoder cross-attention inside ``grouped_beams`` reads each
    input's keys/values once for all of its beams (rows ``b*beams .. b*beams+beams-1`` of the
    cache are copies of one another: generate() repeats the encoder output per beam)."""
    beams = _BEAMS.get()
    hyps, heads, length, dim = query.shape
    cross = module.is_decoder and not module.is_causal
    if beams == 1 or not cross or length != 1 or hyps % beams or module.training:
        return eager_attention_forward(module, query, key, value, attention_mask, scaling, dropout, **kwargs)
    rows = hyps // beams
    key, value = _per_input(key, beams), _per_input(value, beams)
    q = query.reshape(rows, beams, heads, dim).transpose(1, 2)  # the beams as query positions
    scores = torch.matmul(q, key.transpose(2, 3)) * (scaling if scaling is not None else dim**-0.5)
    if attention_mask is not None:
        scores = scores + attention_mask[::beams]
    out = torch.matmul(torch.nn.functional.softmax(scores, dim=-1), value)  # (rows, heads, beams, dim)
    return out.transpose(1, 2).reshape(hyps, 1, heads, dim), None


def _per_input(states: torch.Tensor, beams: int) -> torch.Tensor:
    memo = _PER_INPUT.get()
    if memo is None:
        return states[::beams]
    key = (states.data_ptr(), tuple(states.shape), states.dtype)
    if key not in memo:
        memo[key] = states[::beams].contiguous()
    return memo[key]


AttentionInterface.register(GROUPED, beam_grouped_attention)
AttentionMaskInterface.register(GROUPED, ALL_MASK_ATTENTION_FUNCTIONS["eager"])


@contextmanager
def grouped_beams(model, beams: int):
    """One generate() call inside uses beam-grouped cross-attention for ``beams`` beams per input
    (its per-input keys/values are kept until the block ends: one call per block)."""
    before = model.config._attn_implementation
    model.set_attn_implementation(GROUPED)
    token, memo = _BEAMS.set(beams), _PER_INPUT.set({})
    try:
        yield
    finally:
        _PER_INPUT.reset(memo)
        _BEAMS.reset(token)
        model.set_attn_implementation(before)
