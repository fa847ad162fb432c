"""generate() made fast for the seed's beam settings, with identical outputs.

1. N-gram blocking as whole-tensor operations. The seed's evaluation and the ``faithful`` chat
   preset block repeated n-grams in the reply (``no_repeat_ngram_size``) and n-grams copied from
   the input (``encoder_no_repeat_ngram_size``). transformers implements the encoder rule as a
   Python loop over every hypothesis with a ``.tolist()`` per hypothesis per step: with beam 10
   over an evaluation batch that is thousands of GPU round-trips per generated token. (Older
   releases loop for the decoder rule too.) These processors ban exactly the same tokens (tests
   compare them with transformers' own on random inputs).
2. A beam-search cache that moves as little as it can. After each step beam search puts the
   cache into the surviving beams' order. The cross-attention half (every decoder layer x 128
   encoder positions) holds the same values for every beam of one input, and beams never move
   between inputs, so it is not reordered at all (on H200s that copy was over half of evaluation
   time). The self-attention half is reordered lazily: the reorder only records the beams' order,
   and the next step's update gathers the history into the grown tensor in one pass, instead of a
   gather (a full copy) and then a concatenation (another).

3. On a GPU, with ``cuda_graphs``, greedy and sampled replies use transformers' static cache,
   which makes generate() compile the decoder step into CUDA graphs
   (``cache_implementation="static"``; ~60 s of compiling per model, beam search left eager). The
   chat engine does this only with ``CHAT_CUDA_GRAPHS=compile``: its default, ``chat.graphs``,
   records the step itself for every strategy in about a second (docs/chat-benchmarks.md).

4. Beam-grouped cross-attention (``grouped_beams``): every beam of one input attends over the same
   encoder keys/values, yet attention reads them once per beam (beam 10: ten copies, per layer, per
   step). Inside ``grouped_beams`` the cross-attention keys/values are projected once per input
   (not per beam) into a ``BeamCache`` that then holds one row per input, a tenth of the memory, and
   attention (eager otherwise) treats the beams as ten query positions: one matrix product per input
   instead of ten vector products. For evaluation's large batches (``--eval_attention grouped``);
   same math, rounding may differ from eager's.

``fast_kwargs`` turns generate() keyword arguments into ones that use 1-3.
"""

from __future__ import annotations

import contextvars
from contextlib import contextmanager

import torch
from transformers import AttentionInterface, DynamicCache, EncoderDecoderCache, LogitsProcessor, LogitsProcessorList
from transformers.cache_utils import DynamicLayer
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


def run_processors(processors, ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
    """``processors(ids, scores)`` (a ``LogitsProcessorList``) without the list's signature inspection
    of every processor on every call (~40 us a row per step): generate() hands processors no other
    arguments, so each is called with the ids and scores alone, in order, as the list then does."""
    for processor in processors:
        scores = processor(ids, scores)
    return scores


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


def _select_into(src: torch.Tensor, order: torch.Tensor, out: torch.Tensor) -> None:
    """``index_select(src, 0, order, out=out)``, over 8-byte elements when the rows allow (a bit-exact
    view): PyTorch's gather kernels move one element per thread, and over 2-byte bf16 elements they
    ran at ~1.4 TB/s of an H200's ~4.8 (docs/benchmarks.md)."""
    try:
        src, out = src.view(torch.int64), out.view(torch.int64)
    except RuntimeError:  # rows whose bytes do not split into 8-byte elements: gather as they are
        pass
    torch.index_select(src, 0, order, out=out)


def _gather_append(old: torch.Tensor, order: torch.Tensor, new: torch.Tensor) -> torch.Tensor:
    """``cat([old[order], new], dim=-2)`` writing each element once (no reordered copy in between)."""
    length = old.shape[-2]
    out = old.new_empty((order.shape[0], *old.shape[1:-2], length + new.shape[-2], old.shape[-1]))
    _select_into(old, order, out[..., :length, :])
    out[..., length:, :] = new
    return out


class LazyReorderLayer(DynamicLayer):
    """A self-attention cache layer whose beam reorder is done by the next ``update``.

    transformers reorders with ``index_select`` (reading and writing the whole history) and the next
    update grows it with ``cat`` (both again): 1.65 + 1.0 s of kernels in a 5.5 s, 1,000-row
    evaluation batch on an H200 (docs/benchmarks.md). Here a reorder only records the order
    (composing with one not yet applied) and ``update`` gathers the history straight into the grown
    tensor. ``keys``/``values`` are properties that apply a pending order first, so anything else
    that reads them (crop, offloading, the returned cache) sees the reordered history; only
    ``get_seq_length`` (shape only) and ``update`` read the stored tensors.
    """

    _keys = _values = _order = None

    def _settled(self) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        if self._order is not None:
            order, self._order = self._order, None
            self._keys, self._values = self._keys.index_select(0, order), self._values.index_select(0, order)
        return self._keys, self._values

    keys = property(lambda self: self._settled()[0], lambda self, t: setattr(self, "_keys", t))
    values = property(lambda self: self._settled()[1], lambda self, t: setattr(self, "_values", t))

    def get_seq_length(self) -> int:
        return 0 if not self.is_initialized or self._keys.numel() == 0 else self._keys.shape[-2]

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        if self.get_seq_length() > 0:
            beam_idx = beam_idx.to(self._keys.device)
            self._order = beam_idx if self._order is None else self._order[beam_idx]

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        if self._order is None:
            return super().update(key_states, value_states, *args, **kwargs)
        order, self._order = self._order, None
        self._keys = _gather_append(self._keys, order, key_states)
        self._values = _gather_append(self._values, order, value_states)
        return self._keys, self._values

    def reset(self) -> None:
        self._order = None
        super().reset()


class BeamCache(EncoderDecoderCache):
    """An encoder-decoder cache for beam search: lazily reordered self-attention layers, and a
    cross-attention half that is never reordered (it is the same for every beam of an input)."""

    def __init__(self):
        self_attention = DynamicCache()
        self_attention.layer_class_to_replicate = LazyReorderLayer  # the layers are made on first update
        super().__init__(self_attention, DynamicCache())

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
            out[CACHE_KWARG] = BeamCache()
    elif cuda_graphs and input_ids.device.type == "cuda":
        out.setdefault("cache_implementation", "static")
    return out


GROUPED = "beam_grouped"  # the attention implementation's registered name
_BEAMS = contextvars.ContextVar("beams_per_input", default=1)


def _is_cross_attention(module) -> bool:
    return getattr(module, "is_decoder", False) and not getattr(module, "is_causal", True)


def beam_grouped_attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
    """Eager attention, except that decoder cross-attention inside ``grouped_beams`` reads each
    input's keys/values once for all of its beams. ``key``/``value`` hold either one row per input
    (the cache ``grouped_beams`` fills) or one per hypothesis, where rows ``b*beams ..
    b*beams+beams-1`` are copies of one another (generate() repeats the encoder output per beam)."""
    beams = _BEAMS.get()
    hyps, heads, length, dim = query.shape
    if beams == 1 or not _is_cross_attention(module) or length != 1 or hyps % beams or module.training:
        if key.shape[0] != hyps:  # per-input rows, outside the grouped case: one copy per hypothesis
            key, value = (t.repeat_interleave(hyps // t.shape[0], dim=0) for t in (key, value))
        return eager_attention_forward(module, query, key, value, attention_mask, scaling, dropout, **kwargs)
    rows = hyps // beams
    if key.shape[0] != rows:
        key, value = key[::beams], value[::beams]
    q = query.reshape(rows, beams, heads, dim).transpose(1, 2)  # the beams as query positions
    scores = torch.matmul(q, key.transpose(2, 3)) * (scaling if scaling is not None else dim**-0.5)
    if attention_mask is not None:
        scores = scores + attention_mask[::beams]
    out = torch.matmul(torch.nn.functional.softmax(scores, dim=-1), value)  # (rows, heads, beams, dim)
    return out.transpose(1, 2).reshape(hyps, 1, heads, dim), None


def _fill_cross_cache(module, args, kwargs):
    """Before a cross-attention's first step inside ``grouped_beams``: project each input's encoder
    states (every beams-th row) into a BeamCache's cross-attention half and mark it filled, so the
    module reads it instead of projecting all ``beams`` copies. Only a BeamCache: transformers' own
    caches reorder that half by hypothesis."""
    beams, states = _BEAMS.get(), kwargs.get("key_value_states")
    cache = kwargs.get("cache", kwargs.get("past_key_values"))
    if beams == 1 or states is None or not isinstance(cache, BeamCache) or module.training:
        return
    if cache.is_updated.get(module.layer_idx) or states.shape[0] % beams:
        return
    per_input = states[::beams]
    shape = (*per_input.shape[:-1], -1, module.head_dim)
    key = module.k_proj(per_input).view(shape).transpose(1, 2)
    value = module.v_proj(per_input).view(shape).transpose(1, 2)
    cache.cross_attention_cache.update(key, value, module.layer_idx)
    cache.is_updated[module.layer_idx] = True


AttentionInterface.register(GROUPED, beam_grouped_attention)
AttentionMaskInterface.register(GROUPED, ALL_MASK_ATTENTION_FUNCTIONS["eager"])


@contextmanager
def grouped_beams(model, beams: int):
    """generate() calls inside use beam-grouped cross-attention for ``beams`` beams per input, and
    with a ``BeamCache`` (``fast_kwargs``) project and keep the cross-attention keys/values once
    per input. Outside the block the model is as it was."""
    before = model.config._attn_implementation
    model.set_attn_implementation(GROUPED)
    token = _BEAMS.set(beams)
    hooks = [
        m.register_forward_pre_hook(_fill_cross_cache, with_kwargs=True)
        for m in model.modules()
        if _is_cross_attention(m) and hasattr(m, "k_proj")
    ]
    try:
        yield
    finally:
        for hook in hooks:
            hook.remove()
        _BEAMS.reset(token)
        model.set_attn_implementation(before)
