"""generate()'s one-token decoder steps replayed from CUDA graphs, beam search included.

On a GPU a 400M decoder step is well under 1 ms of kernels but several ms of Python and kernel
launches, so a 24-token reply is mostly launch overhead. transformers compiles the step into CUDA
graphs for greedy and sampling only (``cache_implementation="static"``, ~20 s of compiling per
model); beam search, the ``faithful`` preset, stays eager.

``StepGraphs`` captures the step itself with ``torch.cuda.CUDAGraph`` (no compiler, a few
milliseconds per shape) for every decoding strategy:

* the cache is transformers' static cache (self- and cross-attention), whose tensors never move,
  so a graph can read and write them by address; beam search reorders the self-attention half in
  place and, as ``chat.fastgen.BeamCache`` does, leaves the beam-invariant cross-attention alone;
* ``generate()`` calls the model as usual; while ``StepGraphs.decoding`` is active the model's
  forward replays one of two graphs: the first step's (which projects the encoder's output, copied
  into a static tensor, into the cross-attention cache; eagerly it was ~15 ms of a ~80 ms reply
  on an H200; recorded from a shape's second reply on) or every later step's;
* one graph and cache per shape (hypotheses, source length, cache length, dtype, attention, and
  where the weights live; ``chat.batching`` rounds source lengths up to multiples of 16, so the
  shapes repeat); the least recently used are dropped beyond ``capacity`` shapes or
  ``budget_bytes`` of caches and the graphs' memory pools (what reserved memory grew by while each was
  recorded; 8 concurrent beam-10 chats over 128 tokens hold ~1.2 GB of caches in fp32).

On a CPU the same static-cache path runs eagerly (that is what the tests check against plain
generate()); only the capture needs CUDA. A failed capture is logged once and that shape is served
eagerly.
"""

from __future__ import annotations

import logging
import threading
import weakref
from collections import OrderedDict
from contextlib import contextmanager
from dataclasses import dataclass, field

import torch
from transformers import EncoderDecoderCache, StaticCache
from transformers.modeling_outputs import BaseModelOutput

from chat.fastgen import CACHE_KWARG

log = logging.getLogger(__name__)


class GraphCache(EncoderDecoderCache):
    """Static self- and cross-attention caches that a captured step reads by address: beam search
    reorders the self-attention keys/values in place and skips the cross-attention half."""

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        for layer in self.self_attention_cache.layers:
            if layer.is_initialized:
                idx = beam_idx.to(layer.keys.device)
                layer.keys.copy_(layer.keys.index_select(0, idx))
                layer.values.copy_(layer.values.index_select(0, idx))

    def cross_ready(self) -> bool:
        return bool(self.is_updated) and all(self.is_updated.values())


@dataclass
class _Recorded:
    """One recorded forward: the graph and the output each replay overwrites."""

    graph: torch.cuda.CUDAGraph | None = None
    output: object = None
    failed: bool = False


@dataclass
class _Entry:
    """One shape's cache, the static tensors its graphs read, and two graphs: the first step (which
    fills the cross-attention cache from the encoder's output) and every later step."""

    cache: GraphCache
    inputs: dict = field(default_factory=dict)  # the steps' tensor inputs, at fixed addresses
    encoder_hidden: torch.Tensor | None = None  # the first step's copy of the encoder's output
    first: _Recorded = field(default_factory=_Recorded)
    step: _Recorded = field(default_factory=_Recorded)
    bytes: int = 0  # what its caches hold (estimated from the shape)
    uses: int = 0  # generate() calls on this shape so far

    @property
    def failed(self) -> bool:
        return self.first.failed or self.step.failed

    def step_kwargs(self, kw: dict, first: bool = False) -> dict | None:
        """The forward's kwargs for one decoder step, its tensors copied into the static ones (for
        the ``first`` step the encoder's output too); None when ``kw`` is not of the form this
        shape's graphs take.

        The decoder's mask: transformers 5.2x makes a 4-D one over the static cache before every
        step (a graph input like the token ids); older releases pass none, and the decoder then
        gets an all-ones mask over the whole cache (causality comes from the positions): without
        one it builds its own, sized by the cache's length, a tensor read on the host."""
        ids, mask, given = kw["decoder_input_ids"], kw["attention_mask"], kw.get("decoder_attention_mask")
        if not self.inputs:
            max_len = self.cache.self_attention_cache.layers[0].max_cache_len
            self.inputs = {
                "decoder_input_ids": torch.empty_like(ids),
                "attention_mask": torch.empty_like(mask),
                "decoder_attention_mask": torch.ones((ids.shape[0], max_len), dtype=mask.dtype, device=mask.device)
                if given is None
                else torch.empty_like(given),
            }
        static_mask = self.inputs["decoder_attention_mask"]
        if given is None:
            if static_mask.dim() != 2:
                return None
        elif given.dim() != 4 or given.shape != static_mask.shape or given.dtype != static_mask.dtype:
            return None
        else:
            static_mask.copy_(given)
        self.inputs["decoder_input_ids"].copy_(ids)
        self.inputs["attention_mask"].copy_(mask)
        if not first:
            return {**kw, **self.inputs}
        hidden = kw["encoder_outputs"][0]
        if self.encoder_hidden is None or self.encoder_hidden.dtype != hidden.dtype:
            self.encoder_hidden = torch.empty_like(hidden)
        self.encoder_hidden.copy_(hidden)
        return {**kw, **self.inputs, "encoder_outputs": BaseModelOutput(last_hidden_state=self.encoder_hidden)}


def cache_length(kwargs: dict, model) -> int:
    """Decoder positions a generate() call can fill: the start token plus the new tokens."""
    if kwargs.get("max_new_tokens") is not None:
        return int(kwargs["max_new_tokens"]) + 1
    return int(kwargs.get("max_length") or model.generation_config.max_length)


def cache_bytes(config, hyps: int, positions: int, dtype: torch.dtype) -> int:
    """Bytes of keys and values for ``positions`` (self- plus cross-attention) of every decoder
    layer of a model with ``config``."""
    layers, width = config.decoder_layers, config.d_model
    return 2 * layers * hyps * positions * width * torch.empty((), dtype=dtype).element_size()


class StepGraphs:
    """CUDA graphs of one model's decoder step, one per shape; use ``decoding`` around generate().
    ``for_model`` keeps one per model without keeping the model alive."""

    def __init__(self, capacity: int = 32, budget_bytes: int = 2 << 30):
        self.capacity, self.budget_bytes = capacity, budget_bytes
        self._entries: OrderedDict[tuple, _Entry] = OrderedDict()
        self._lock = threading.Lock()  # one generate() at a time may own the caches and graphs
        self.replays = 0  # steps served from a graph (tests and benchmarks read it)

    def _entry(self, model, hyps: int, source_len: int, max_len: int, variant=None) -> _Entry:
        config = model.config
        # A graph reads the weights by address: weights moved or replaced make a new key. It also
        # replays the Python it recorded: a LoRA adapter active then (``variant``) is part of it.
        weights = hash(tuple(p.data_ptr() for p in model.parameters()))
        key = (hyps, source_len, max_len, model.dtype, config._attn_implementation, weights, variant)
        entry = self._entries.pop(key, None)
        if entry is None:
            decoder = config.get_text_config(decoder=True)
            self_attention = StaticCache(config=decoder, max_cache_len=max_len)
            entry = _Entry(GraphCache(self_attention, StaticCache(config=decoder, max_cache_len=source_len)))
            entry.bytes = cache_bytes(config, hyps, max_len + source_len, model.dtype)
            while self._entries and (
                len(self._entries) >= self.capacity or self.held_bytes() + entry.bytes > self.budget_bytes
            ):
                self._entries.popitem(last=False)  # the least recently used
        self._entries[key] = entry  # most recently used last
        return entry

    def held_bytes(self) -> int:
        return sum(entry.bytes for entry in self._entries.values())

    @contextmanager
    def decoding(self, model, input_ids: torch.Tensor, kwargs: dict, variant=None):
        """Yield generate() kwargs (the shape's cache, compiling off) for one ``model.generate`` call
        on ``input_ids`` with ``kwargs``; ``variant`` names what else the step depends on (the
        LoRA adapter active on a shared base, ``chat.serving``): each gets graphs of its own."""
        beams = int(kwargs.get("num_beams") or 1) * int(kwargs.get("num_return_sequences") or 1)
        with self._lock:
            hyps, cache_len = input_ids.shape[0] * beams, cache_length(kwargs, model)
            entry = self._entry(model, hyps, input_ids.shape[1], cache_len, variant)
            entry.cache.reset()
            entry.uses += 1
            # accelerate may have set an instance forward (mixed-precision wrapper): keep and restore it.
            own = model.__dict__.get("forward")
            eager = model.forward

            def forward(*args, **kw):
                ours = not args and kw.get(CACHE_KWARG) is entry.cache and kw["decoder_input_ids"].shape[1] == 1
                first = ours and not entry.cache.cross_ready()
                # A shape's first step is recorded from its second generate() on: recording costs
                # about two eager steps, which a one-off shape (a new source length) would pay for nothing.
                if not ours or (first and (entry.uses < 2 or "encoder_outputs" not in kw)):
                    return eager(*args, **kw)  # anything else runs as usual
                static = entry.step_kwargs(kw, first)
                if static is None:
                    return eager(*args, **kw)
                recorded = entry.first if first else entry.step
                on_gpu = static["decoder_input_ids"].is_cuda
                if (
                    not on_gpu
                    or recorded.failed
                    or (recorded.graph is None and not self._capture(recorded, entry, eager, static))
                ):
                    return eager(**static)  # the step as a graph would record it, run directly
                recorded.graph.replay()
                if first:  # what the recorded forward did in Python: the cross-attention cache is filled
                    entry.cache.is_updated.update(
                        dict.fromkeys(range(len(entry.cache.cross_attention_cache.layers)), True)
                    )
                self.replays += 1
                return recorded.output

            model.forward = forward
            try:
                # transformers would compile the forward for a static cache on a GPU: the graph is ours.
                yield {CACHE_KWARG: entry.cache, "disable_compile": True}
            finally:
                if own is None:
                    del model.forward  # back to the class's forward
                else:
                    model.forward = own

    def _capture(self, recorded: _Recorded, entry: _Entry, eager, static: dict) -> bool:
        """Record a step; the cache is left exactly as before, so the replay that follows is the step."""
        cache = entry.cache
        layers = [*cache.self_attention_cache.layers, *cache.cross_attention_cache.layers]
        lengths = [layer.cumulative_length.clone() for layer in layers]
        updated = dict(cache.is_updated)

        def rewind() -> None:  # positions (tensors the kernels moved) and cross-attention flags (Python)
            for layer, length in zip(layers, lengths):
                layer.cumulative_length.copy_(length)
            cache.is_updated.clear()
            cache.is_updated.update(updated)

        def body() -> None:
            recorded.output = eager(**static)

        try:
            graph, held = record(body, rewind=rewind)
            entry.bytes += held  # the graph's private memory pool counts against the budget with the caches
            rewind()  # recording ran the Python (flags) but no kernels
        except Exception as err:  # some model code cannot be captured: serve this shape eagerly
            entry.bytes += getattr(err, "held", 0)  # what the failed recording reserved
            log.warning("CUDA-graph capture failed (%s: %s); decoding this shape eagerly", type(err).__name__, err)
            recorded.failed = True
            rewind()
            return False
        recorded.graph = graph
        return True


def record(body, warm=None, rewind=None, pool=None) -> tuple[torch.cuda.CUDAGraph, int]:
    """``body`` recorded as a CUDA graph, and the memory its recording reserved (what its memory pool
    took: budgets count it). As torch.cuda.graphs asks, ``warm`` (else ``body``) runs once first on
    a side stream, then ``rewind()`` undoes what that changed. Raises where ``body`` cannot be
    captured (some model code cannot).

    One recording at a time in the process (PyTorch allows no more): the static batcher records
    beam searches' steps in its thread while the step loop records its own in another, and two
    captures at once failed (cudaErrorIllegalState), then crashed the process, on an H200."""
    with _RECORDING:
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            (warm or body)()
        torch.cuda.current_stream().wait_stream(side)
        if rewind is not None:
            rewind()
        graph = torch.cuda.CUDAGraph()
        before = torch.cuda.memory_reserved()
        try:
            # thread_local: other threads' work meanwhile (a model loading, other rows' eager steps) must not void it.
            with torch.cuda.graph(graph, pool=pool, capture_error_mode="thread_local"):
                body()
        except Exception as err:
            raise CaptureError(err, max(0, torch.cuda.memory_reserved() - before)) from err
        return graph, max(0, torch.cuda.memory_reserved() - before)


class CaptureError(RuntimeError):
    """A recording that failed, with the memory reserved while it ran (``held``): a pool shared
    with other graphs keeps it, so budgets count it as they count a recorded graph's."""

    def __init__(self, err: Exception, held: int):  # noqa: D107
        super().__init__(f"{type(err).__name__}: {err}")
        self.held = held


_RECORDING = threading.Lock()  # see record()


_PER_MODEL: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def for_model(model) -> StepGraphs:
    """The model's ``StepGraphs`` (made on first use, freed with the model)."""
    graphs = _PER_MODEL.get(model)
    if graphs is None:
        graphs = _PER_MODEL[model] = StepGraphs()
    return graphs
