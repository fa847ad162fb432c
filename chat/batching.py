"""Batching of concurrent replies: requests with the same model and settings that arrive within
a few milliseconds of each other run as one ``generate`` call. (The engine's default scheduler is
``chat.stepping``'s step loop; it sends beam search, and on a GPU adapters' requests, here.)

Decoding one token costs about the same for 1 row as for 8 (on a CPU the weights are read from
memory once per step either way), so serving 8 chats together is several times the throughput
of serving them one by one (measured in ``python -m bench.chat``). Streaming keeps working: a
``FanOutStreamer`` hands each row's tokens to that request's own ``TextIteratorStreamer``.
"""

from __future__ import annotations

import collections
import logging
import os
import queue
import threading
import time
from concurrent.futures import Future
from contextlib import nullcontext
from dataclasses import dataclass, field

import torch
from transformers.generation.streamers import BaseStreamer, TextIteratorStreamer

from chat import graphs
from chat.fastgen import fast_kwargs
from chat.optimize import optimization_of

log = logging.getLogger(__name__)


@dataclass
class Request:
    loaded: object  # chat.loading.LoadedModel
    encoded: dict
    kwargs: dict
    streamer: BaseStreamer | None = None
    future: Future = field(default_factory=Future)
    source: list[int] = field(init=False)  # the source's token ids without padding

    def __post_init__(self):
        # Read once, in the thread that submits (not the step loop's worker): the step loop's rows
        # (chat.rows, chat.beams) take their length from it, the GPU's slots their encoder input.
        ids, mask = self.encoded["input_ids"][0].tolist(), self.encoded["attention_mask"][0].tolist()
        self.source = [t for t, m in zip(ids, mask) if m]

    @property
    def key(self):
        # Only identical settings on the same model (a base, or one adapter on it) can share a
        # generate() call; a seeded request runs alone so its sampling stays reproducible.
        # Dynamic int8 quantization scales activations over the whole batch, so a row's reply
        # would depend on its neighbours: such models serve one request at a time.
        if self.kwargs.get("generator_seed") is not None or optimization_of(self.loaded.model) == "int8":
            return ("alone", id(self))
        return id(self.loaded), tuple(sorted(self.kwargs.items()))


class FanOutStreamer(BaseStreamer):
    """Splits a batch's token stream into one streamer per row; a row ends at its EOS."""

    def __init__(self, streamers: list[BaseStreamer | None], eos_token_id: int):
        self.streamers, self.eos = streamers, eos_token_id
        self.done = [s is None for s in streamers]

    def put(self, value: torch.Tensor) -> None:
        rows = value if value.dim() == 2 else value[:, None]
        for i, streamer in enumerate(self.streamers):
            if self.done[i]:
                continue
            streamer.put(rows[i])
            if rows[i, -1].item() == self.eos:
                streamer.end()
                self.done[i] = True

    def end(self) -> None:
        for i, streamer in enumerate(self.streamers):
            if not self.done[i]:
                streamer.end()
                self.done[i] = True


# How often a streamed reply's new text reaches its reader, by device (s; the first token at once). On
# a GPU a step of 64 rows takes a few milliseconds, and waking each chat's reader after every step
# (a thread switch and a decode each, under the GIL) cost more than the step: every 30 ms (33 updates
# a second, smooth to the eye) instead. A CPU's step takes longer than that anyway: every token.
STREAM_INTERVAL = {"cuda": 0.03}


class ReaderTextStreamer(TextIteratorStreamer):
    """transformers' ``TextIteratorStreamer``, with the decoding done in the reading thread, and
    tokens handed over at most every ``interval`` seconds.

    ``put`` only keeps the ids: the decoder's worker thread serves every row of a step, so the
    tokenizer calls it would make for each of 64 rows (a decode of the reply so far, per token) hold up
    all of them; the reader, one thread per chat, does them instead, beside the next step. With
    ``interval`` > 0 the reader is woken for the first token at once, then at most every ``interval``
    s and at the end, and reads every id that arrived since its last read in one decode: on a GPU a
    64-row step takes a few milliseconds, and waking 64 readers after each (a thread switch and a
    decode per token, all under the GIL) cost more than the step (docs/chat-benchmarks.md). The text is
    the same; only its pieces are longer. With 0 (a CPU's) the pieces are ``TextIteratorStreamer``'s."""

    def __init__(self, tokenizer, interval: float = 0.0, **kwargs):
        if kwargs.get("skip_prompt"):  # ids are read in runs: where a prompt ended is not kept
            raise ValueError("ReaderTextStreamer streams generated ids only: skip_prompt is not supported")
        super().__init__(tokenizer, **kwargs)
        self.interval = interval
        self._ready = threading.Condition()
        self._ids: list[int] = []  # put, not read yet
        self._ended = False
        self._puts = 0
        self._woken = -float("inf")  # when the reader was last woken

    def put(self, value) -> None:
        if value.dim() > 1 and value.shape[0] > 1:
            raise ValueError("TextStreamer only supports batch size 1")
        self.put_ids(value.reshape(-1).tolist())

    def put_ids(self, ids: list[int]) -> None:
        """``put`` for ids as ints (``hand_ids``)."""
        with self._ready:
            self._ids += ids
            self._puts += 1
            now = time.monotonic()
            # The first two puts (the decoder's start token, then the first new one) wake it at once:
            # the time to the first text is not held back.
            if self._puts <= 2 or now - self._woken >= self.interval:
                self._woken = now
                self._ready.notify()

    def end(self) -> None:
        with self._ready:
            self._ended = True
            self._ready.notify()

    def __next__(self) -> str:
        while self.text_queue.empty():
            with self._ready:
                if not self._ready.wait_for(lambda: self._ids or self._ended, timeout=self.timeout):
                    raise queue.Empty  # as TextIteratorStreamer's own wait does
                ids, self._ids, ended = self._ids, [], self._ended
            if ids and self.interval:  # all that arrived, in one decode
                super().put(torch.tensor(ids))
            else:  # each id as TextIteratorStreamer takes it (its pieces, even for a reader behind)
                for token in ids:
                    super().put(torch.tensor([token]))
            if ended:
                super().end()  # the rest of the text, then the stop signal
        return super().__next__()


def hand_ids(streamer: BaseStreamer, ids: list[int]) -> None:
    """Give a row's new ``ids`` to its streamer: as ints where it takes them (``ReaderTextStreamer``:
    the step loop's worker then makes no torch call per row, each of which would let the readers take
    the GIL from it), else as the tensor transformers' streamers take."""
    if hasattr(streamer, "put_ids"):
        streamer.put_ids(ids)
    else:
        streamer.put(torch.tensor(ids))


# CUDA-graph decoding pads sources up to a multiple of this many tokens. ``chat.graphs`` records
# graphs per source length, and real chats rarely repeat one: rounded lengths let most replies
# replay graphs recorded for an earlier one instead of recording new ones (docs/chat-benchmarks.md).
# Padding is masked, so a reply is the unpadded source's (exactly so in fp32: tests/chat).
SOURCE_BUCKET = 16


def _pad(encodings: list[dict], pad_id: int, multiple: int = 1, limit: int | None = None) -> dict:
    """The encodings right-padded into one batch, ``multiple`` rounding its width up (never past
    ``limit``, the model's positions, unless a source is that long already)."""
    width = max(e["input_ids"].shape[1] for e in encodings)
    rounded = -(-width // multiple) * multiple
    width = rounded if limit is None else max(width, min(rounded, limit))
    ids = torch.full((len(encodings), width), pad_id, dtype=torch.long)
    mask = torch.zeros((len(encodings), width), dtype=torch.long)
    for i, e in enumerate(encodings):
        n = e["input_ids"].shape[1]
        ids[i, :n] = e["input_ids"][0]
        mask[i, :n] = e["attention_mask"][0]
    return {"input_ids": ids, "attention_mask": mask}


def _cuda_graph_thread_state() -> None:
    """Let this thread replay compiled CUDA graphs (the GPU decoding of ``chat.fastgen``).

    torch before 2.12 sets up CUDA-graph trees' per-thread state only in the thread that first
    imports the module, so in this worker thread compiled decoding failed with an AssertionError
    in ``cudagraph_trees.get_obj`` (seen with torch 2.11 on an H200). This repeats that set-up,
    as newer torch does itself for every thread. ``Batcher`` also calls it in the thread that
    creates it, before starting its worker: a first import inside the worker left that thread
    without the state (its compiled generate() then failed the same way; seen in the GPU tests)."""
    if not torch.cuda.is_available():
        return
    try:
        from torch._inductor import cudagraph_trees as trees

        if hasattr(trees.local, "tree_manager_containers") or torch._C._is_key_in_tls("tree_manager_containers"):
            return
        trees.local.tree_manager_containers = {}
        trees.local.tree_manager_locks = collections.defaultdict(threading.Lock)
        torch._C._stash_obj_in_tls("tree_manager_containers", trees.local.tree_manager_containers)
        torch._C._stash_obj_in_tls("tree_manager_locks", trees.local.tree_manager_locks)
    except (ImportError, AttributeError) as err:  # a torch whose internals moved: decoding still works eagerly
        log.warning("could not prepare CUDA-graph state for the chat worker thread: %s", err)


GRAPH_MODES = {"capture": "capture", "1": "capture", "compile": "compile", "off": "off", "0": "off"}


def graph_mode(value: str) -> str:
    """CHAT_CUDA_GRAPHS's value as a mode; anything unknown is an error, not a silent default."""
    mode = GRAPH_MODES.get(value.strip().lower())
    if mode is None:
        raise ValueError(f"CHAT_CUDA_GRAPHS must be capture, compile or off (1/0), got {value!r}")
    return mode


class Batcher:
    """One worker thread that runs generate() for queued requests, batching compatible ones."""

    def __init__(self, window_s: float = 0.01, max_batch: int = 8):
        self.window_s, self.max_batch = window_s, max_batch
        # How decoding uses CUDA graphs on a GPU (CHAT_CUDA_GRAPHS): "capture" (chat.graphs, every
        # strategy), "compile" (transformers' compiled static cache, greedy and sampling only) or
        # "off"; the engine turns it off if warming up fails.
        self.cuda_graphs = graph_mode(os.environ.get("CHAT_CUDA_GRAPHS", "capture"))
        self._queue: queue.Queue[Request] = queue.Queue()
        self._held: list[Request] = []  # taken from the queue but not compatible with the last batch
        _cuda_graph_thread_state()  # for this thread, before the worker imports the module
        threading.Thread(target=self._loop, daemon=True, name="chat-batcher").start()

    def submit(self, loaded, encoded: dict, kwargs: dict, streamer: BaseStreamer | None = None) -> Future:
        request = Request(loaded, encoded, kwargs, streamer)
        self._queue.put(request)
        return request.future

    def _loop(self) -> None:
        _cuda_graph_thread_state()
        while True:
            # Nothing of a batch outlives its run: a request holds its LoadedModel, and a model
            # swapped out (or the Compare tab's idle one) must be freed now, not after the next reply.
            self._run(self._next_batch())

    def _next_batch(self) -> list[Request]:
        """Wait for a request, then a few milliseconds for more that can join it (none can join
        a request that must run alone); others are held for the next batch."""
        first = self._held.pop(0) if self._held else self._queue.get()
        batch = [first]
        for r in [r for r in self._held if r.key == first.key][: self.max_batch - 1]:
            self._held.remove(r)
            batch.append(r)
        deadline = time.monotonic() + (0 if first.key[0] == "alone" else self.window_s)
        while len(batch) < self.max_batch:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                break
            try:
                nxt = self._queue.get(timeout=remaining)
            except queue.Empty:
                break
            (batch if nxt.key == first.key else self._held).append(nxt)
        return batch

    def _run(self, batch: list[Request]) -> None:
        first = batch[0]
        kwargs = dict(first.kwargs)
        seed = kwargs.pop("generator_seed", None)
        tokenizer, model = first.loaded.tokenizer, first.loaded.model
        streamers = [r.streamer for r in batch]
        fan = FanOutStreamer(streamers, tokenizer.eos_token_id) if any(streamers) else None
        try:
            if seed is not None:
                torch.manual_seed(seed)
            capture = self.cuda_graphs == "capture" and model.device.type == "cuda"
            padded = _pad(
                [r.encoded for r in batch],
                tokenizer.pad_token_id,
                SOURCE_BUCKET if capture else 1,
                getattr(model.config, "max_position_embeddings", None),
            )
            inputs = {k: v.to(model.device) for k, v in padded.items()}
            ids = inputs["input_ids"]
            # A graph replays the weights it recorded: each adapter on a shared base gets its own.
            variant = first.loaded.adapter
            step_graphs = graphs.for_model(model).decoding(model, ids, kwargs, variant) if capture else nullcontext({})
            # The model answers as this batch's model: its adapter active (or none), under the host's lock.
            with first.loaded.activated(), torch.inference_mode(), step_graphs as cache:
                compiled = self.cuda_graphs == "compile"
                out = model.generate(**inputs, streamer=fan, **fast_kwargs({**kwargs, **cache}, ids, compiled))
        except BaseException as err:  # every waiting request learns about it
            if fan:
                fan.end()
            for r in batch:
                r.future.set_exception(err)
            return
        if fan:
            fan.end()
        for i, r in enumerate(batch):
            r.future.set_result(out[i : i + 1].cpu())
