"""Step-level (continuous) batching: a request joins the running batch at the next decoder step and
leaves it at its own end, each row with its own settings, streamer and random generator.

``chat.batching``'s static batcher runs one ``generate()`` per batch: a request that arrives a
moment after a batch started waits for all of it, and only requests with identical settings share
one. Here one worker thread runs its own decoding loop over the model's parts:

* a joining request's source is encoded alone (as ``generate()`` alone would), and each decoder
  layer's cross-attention keys/values are projected from it once; the requests that arrived
  between two steps join together, the caches grown once for all (``_Batch.join``);
* every step runs the decoder's layers once for all rows, each at its own position, over a
  self-attention cache whose rows are right-aligned (a row's history ends at the newest column; a
  younger row's older columns are masked; columns are written into spare room, ``chat.stepcache``)
  and a cross-attention cache padded to the longest source; columns no row needs any more are
  dropped, so the cache spans the oldest row's reply at most;
* each row's logits go through that row's own logits processors and stopping criteria, built by
  transformers' generate() helpers from the row's generate() kwargs (repetition penalty, n-gram
  blocking, min length, temperature, top-p, forced EOS: exactly what ``generate()`` alone would
  apply), then argmax or sampling with the row's own ``torch.Generator`` (seeded: reproducible
  whatever else runs beside it). Greedy rows whose processors are only those go through one pass
  for all rows (``chat.greedy.choose_greedy``, as the GPU's slots: the same choices).

Greedy replies are those of ``generate()`` alone (tests/chat/test_stepping.py: token for token on
the demo model in fp32, joining mid-flight included). Beam search (``faithful``) goes to the static
batcher, as does anything else this loop does not do; with ``StepBatcher.beams`` a beam-search
request is its beams' rows of the steps, stepped by transformers' own helpers (``chat.beams``: same
replies, measured slower on a CPU). Rows of different LoRA adapters of one base share a step
(``chat.lora.rows_of``): each row gets its own low-rank update.

On a GPU the rows live in fixed-address slots and each step and each join is replayed from a CUDA
graph (``chat.stepgraphs.SlotBatch``: the same ``step``, requests join several at a time, and the next
step starts before a step's tokens are handed out); there each row of a LoRA adapter goes through
its own adapter by lanes (``adapters_in_slots``: 2.2x the static batcher's replies/s for ten adapters
on an H200), and beam searches go to the static batcher, whose recorded steps (``chat.graphs``) serve
them, unless ``beams`` (a slot per beam: slower there too).

A request's settings become transformers' processors in ``chat.rows``.
"""

from __future__ import annotations

import itertools
import logging
import os
import queue
import threading
from concurrent.futures import Future
from contextlib import nullcontext

import torch

from chat import stepgraphs
from chat.batching import Batcher, Request
from chat.optimize import rows_apart
from chat.rows import beams_of, choose_plain, eos_mask, eos_of, member
from chat.stepcache import Layer, SelfAttention, StepCache, cross_keys_values, decoder_layer, stacked

log = logging.getLogger(__name__)

SCHEDULER_ENV = "CHAT_SCHEDULER"
SCHEDULERS = ("step", "static", "process")
# Rows per step on a CPU, measured with bench.chat_load on 2 idle cores (400M int8, 16 clients: 8 rows
# 3.81 replies/s and first text after 2.53 s, 16 rows 4.38 and 0.83 s, 32 rows 4.75 and 0.76 s; the
# app's 16 at once, app.CONCURRENCY, fill 16; docs/chat-benchmarks.md).
CPU_MAX_BATCH = 16
# Replies a server (the app's chat, the API) runs at once on a GPU: the step loop's 64-row steps served
# 137 replies/s with p95 0.47 s on an H200, 256 rows 173 replies/s but p95 1.5 s (docs/chat-benchmarks.md).
GPU_CONCURRENCY = 64
CONCURRENCY_ENV = "CHAT_CONCURRENCY"


def concurrency(value: str | None = None) -> int:
    """How many replies the app's chat and the API each run at once, so the step loop's batches can
    fill: CHAT_CONCURRENCY if set, else 64 with a GPU and CPU_MAX_BATCH (16) without."""
    value = os.environ.get(CONCURRENCY_ENV) if value is None else value
    if value is None or not value.strip():
        return GPU_CONCURRENCY if torch.cuda.is_available() else CPU_MAX_BATCH
    try:
        count = int(value)
    except ValueError:
        count = 0
    if not 1 <= count <= 1024:
        raise ValueError(f"{CONCURRENCY_ENV} must be a whole number from 1 to 1024, got {value!r}")
    return count


# Rows per step on a GPU at most (a 400M step costs about the same for 256 rows as for 1; the slots'
# memory budget, chat.stepgraphs.default_budget, may allow fewer).
GPU_MAX_BATCH = 256


def scheduler(value: str | None = None) -> str:
    """CHAT_SCHEDULER's value (``step``: this module, ``static``: chat.batching alone, ``process``:
    on a GPU this module's step loop in a process of its own, ``chat.stepproc``)."""
    value = (os.environ.get(SCHEDULER_ENV, "step") if value is None else value).strip().lower()
    if value not in SCHEDULERS:
        raise ValueError(f"{SCHEDULER_ENV} must be one of {', '.join(SCHEDULERS)}, got {value!r}")
    return value


class _Batch:
    """The running rows of one model object (a base and the adapters on it) and their caches."""

    def __init__(self, model):
        self.model = model
        self.decoder = model.get_decoder()
        self.rows: list = []  # chat.rows' members: a Row, or a beam search's BeamRows
        self.self_attention = SelfAttention(len(self.decoder.layers))
        self.cross: list[Layer] = []  # per layer, rows padded to the longest source
        self.eos = eos_of(model)
        self.eos_mask: torch.Tensor | None = None

    def _choose_plain(self, rows: list, starts: list[int], logits: torch.Tensor) -> dict[int, int]:
        """The next token of each plain greedy row (by the row's id), all in one pass (chat.greedy)."""
        plain = [(row, start) for row, start in zip(rows, starts) if row.plain is not None]
        if not plain:
            return {}
        if self.eos_mask is None or len(self.eos_mask) != logits.shape[1]:
            self.eos_mask = eos_mask(self.eos, logits.shape[1])
        tokens = choose_plain([row for row, _ in plain], logits[[start for _, start in plain]], self.eos_mask)
        return {id(row): token for (row, _), token in zip(plain, tokens)}

    def join(self, requests: list[Request]) -> list[tuple[Request, BaseException]]:
        """Encode each request's source alone and add its cross-attention keys/values as new rows
        (one, or one per beam: the same for each), all of them in one copy of the caches; returns
        the requests that could not join, each with its error (the others join)."""
        model = self.model
        new, failed = [], []
        for request in requests:
            try:
                row = member(request, model, model.generation_config.decoder_start_token_id)
                encoded = {k: v.to(model.device) for k, v in request.encoded.items()}
                with request.loaded.activated():  # its adapter's projections (or none) for its encoder states
                    hidden = model.get_encoder()(**encoded).last_hidden_state
                    new.append((row, cross_keys_values(self.decoder, hidden)))
            except BaseException as err:  # noqa: BLE001 - handed to the waiting caller
                failed.append((request, err))
        if not new:
            return failed
        rows = [row for row, _ in new]
        width = max(row.source for row in [*rows, *self.rows])
        cross = []  # built whole before anything is replaced: a failure leaves the batch as it was
        for i, layer in enumerate(self.cross or [None] * len(self.decoder.layers)):
            keys, values = ([], []) if layer is None else ([layer.keys], [layer.values])
            for row, layers in new:
                k, v = layers[i]
                keys.append(k.expand(row.width, -1, -1, -1))
                values.append(v.expand(row.width, -1, -1, -1))
            cross.append(Layer(stacked(keys, width), stacked(values, width)))
        self.self_attention.rows(added=_size(rows))
        self.cross = cross
        self.rows += rows
        return failed

    def step(self) -> list:
        """One decoder step for every row; returns the rows that finished (already left)."""
        rows, model, decoder = self.rows, self.model, self.decoder
        sa = self.self_attention
        width = (sa.keys[0].shape[2] if sa.keys[0] is not None else 0) + 1  # columns after this step
        for row in rows:
            row.length += 1
        lengths = torch.tensor([row.length for row in rows for _ in range(row.width)])
        sources = torch.tensor([row.source for row in rows for _ in range(row.width)])
        dtype = self.cross[0].keys.dtype
        self_mask = _mask(torch.arange(width)[None] >= width - lengths[:, None], dtype)
        cross_mask = _mask(torch.arange(self.cross[0].keys.shape[2])[None] < sources[:, None], dtype)
        tokens = torch.cat([row.last() for row in rows]).to(model.device)
        positions = (lengths - 1)[:, None].to(model.device)
        hidden = decoder.embed_tokens(tokens) + decoder.embed_positions(tokens.shape, 0, position_ids=positions)
        cache = StepCache(sa, self.cross)
        masks = [m if m is None else m.to(model.device) for m in (self_mask, cross_mask)]
        # A request's beams are quantized together (int8), as generate() alone runs them.
        with rows_apart(tuple(row.width for row in rows)) if len(rows) < len(lengths) else nullcontext():
            for layer in decoder.layers:
                hidden = decoder_layer(layer, hidden, masks[0], self.cross[0].keys, masks[1], cache)
            logits = model.lm_head(decoder.layer_norm(hidden)) + model.final_logits_bias.to(hidden.device)
        logits = logits[:, -1].to(copy=True, dtype=torch.float32, device="cpu")
        starts = list(itertools.accumulate((row.width for row in rows), initial=0))
        chosen = self._choose_plain(rows, starts, logits)
        done, order = [], None
        for row, start in zip(rows, starts):
            if row.plain is not None:
                finished = row.take(chosen[id(row)], self.eos)
            else:  # its own processors (sampling, beam search, rules chat.greedy does not know)
                finished = row.choose(logits[start : start + row.width])
            if finished:
                done.append(row)
            if row.order is not None:  # beams that go on read their parents' cache rows
                order = list(range(len(lengths))) if order is None else order
                order[start : start + row.width] = [start + i for i in row.order.tolist()]
        if order is not None and order != list(range(len(order))):
            sa.rows(torch.tensor(order, device=sa.keys[0].device))
        if done:
            self._leave([i for i, row in enumerate(rows) if row not in done])
        keep = max((row.length for row in self.rows), default=0)
        if keep < width:  # columns no row reads any more
            sa.keep(keep)
        return done

    def serving(self):
        return _serving([row.request.loaded for row in self.rows for _ in range(row.width)])

    def drop(self) -> None:
        """Forget every row (after a failed step)."""
        self.rows = []

    def _leave(self, kept: list[int]) -> None:
        starts = [0]
        for row in self.rows:
            starts.append(starts[-1] + row.width)
        self.rows = [self.rows[i] for i in kept]
        rows = [r for i in kept for r in range(starts[i], starts[i + 1])]
        index = torch.tensor(rows, dtype=torch.long, device=self.cross[0].keys.device)
        width = max((row.source for row in self.rows), default=0)
        self.cross = [Layer(c.keys[index, :, :width], c.values[index, :, :width]) for c in self.cross]
        self.self_attention.rows(index)


def _mask(visible: torch.Tensor, dtype) -> torch.Tensor | None:
    """An additive attention mask (rows, 1, 1, columns); None when every column is visible (then
    attention runs exactly as for one row alone)."""
    if bool(visible.all()):
        return None
    return torch.zeros(visible.shape, dtype=dtype).masked_fill(~visible, torch.finfo(dtype).min)[:, None, None]


class StepBatcher:
    """One worker thread that decodes every running request step by step (``_Batch``); requests it
    does not decode (beam search; adapters only peft's own forward serves, such as DoRA; on a GPU
    adapters' if ``adapters_in_slots`` is turned off) go to the static ``Batcher``. Same ``submit`` as ``Batcher``."""

    def __init__(self, max_batch: int | None = None, fallback: Batcher | None = None):
        if max_batch is not None and max_batch < 1:
            raise ValueError(f"max_batch must be >= 1, got {max_batch}")
        self.max_batch = max_batch or CPU_MAX_BATCH
        self.gpu_max_batch = max_batch or GPU_MAX_BATCH  # slots: further bounded by their memory budget
        self.fallback = fallback or Batcher()
        self.steps = 0  # decoder steps run (tests and benchmarks read it)
        self.widest = 0  # the most rows one step has run
        self._queue: queue.Queue[Request] = queue.Queue()
        threading.Thread(target=self._loop, daemon=True, name="chat-stepper").start()

    # The static batcher's knobs, for callers that tune them (warm_up, bench.chat).
    cuda_graphs = property(
        lambda self: self.fallback.cuda_graphs, lambda self, v: setattr(self.fallback, "cuda_graphs", v)
    )
    window_s = property(lambda self: self.fallback.window_s, lambda self, v: setattr(self.fallback, "window_s", v))

    # Where the step loop decodes. On a GPU it runs in slots with CUDA-graph steps (chat.stepgraphs).
    devices = ("cpu", "cuda")
    # Slots (chat.stepgraphs) or growing caches (``_Batch``): None = slots on a GPU only.
    slots: bool | None = None
    # Slots: start the next step before handing this one's tokens to the streamers (the readers'
    # Python then runs beside the device's step). None = where steps are replayed CUDA graphs.
    lookahead: bool | None = None
    # Beam search as its beams' rows of the steps (chat.beams; in slots a slot per beam). Off: on 2
    # CPU cores in int8 a beam search beside greedy rows served 19-23% fewer replies/s than the static
    # batcher in a thread of its own, and the greedy rows waited longer (a CPU step's cost grows with
    # its rows, so sharing one gains nothing: docs/chat-benchmarks.md). In a GPU's slots, where a
    # step costs the same for more rows, the worker's host-side choice per beam search per step cost
    # more: one chat in four faithful, 8 / 64 chats on an H100, 27.7 / 82.9 replies/s off, 17.0 /
    # 24.7 on (``bench.chat_load --schedulers step,step-beams --faithful_every 4``).
    beams: bool = False
    # On a GPU, adapters' rows in the slots too, each through its own adapter in recorded steps
    # (``chat.lora.by_lanes``). Off, they go to the static batcher: ten adapters, 64 chats on an
    # H200 in one run, 88 replies/s there, 191 in the slots (p95 1.33 -> 0.43 s), the same replies
    # (docs/chat-benchmarks.md; ``bench.chat_load --schedulers static,step-apart,step --adapters 10``).
    adapters_in_slots: bool = True

    def takes(self, loaded, kwargs: dict) -> bool:
        """Does the step loop decode this request? Greedy or sampling (int8 layers quantize each
        row apart in a step: ``chat.optimize.rows_apart``), with ``beams`` beam search (not sampled);
        on a GPU, of a base model (any adapter with ``adapters_in_slots``), within the decoder's
        positions."""
        model = loaded.model
        beams = beams_of(kwargs)
        most = self.gpu_max_batch if self._slots_for(model) else self.max_batch
        if beams > 1 and (not self.beams or beams > most or kwargs.get("do_sample")):
            return False
        ok = (
            int(kwargs.get("num_return_sequences") or 1) == 1
            and model.device.type in self.devices
            and hasattr(model, "get_decoder")
            and model.config.is_encoder_decoder
        )
        if ok and self._slots_for(model):  # a slot holds the decoder's positions, no more
            longest = kwargs.get("max_new_tokens") or model.generation_config.max_length
            ok = int(longest) + 1 <= model.config.max_position_embeddings
        if loaded.adapter is not None and loaded.host is not None and not loaded.host.shares(loaded.adapter):
            return False  # DoRA and the like: alone, as peft's own forward serves them
        return ok and not (model.device.type == "cuda" and loaded.adapter is not None and not self.adapters_in_slots)

    def _slots_for(self, model) -> bool:
        return model.device.type == "cuda" if self.slots is None else self.slots

    def submit(self, loaded, encoded: dict, kwargs: dict, streamer=None) -> Future:
        beams = beams_of(kwargs)
        if not self.takes(loaded, kwargs) or (beams > 1 and streamer is not None):  # generate() refuses that
            return self.fallback.submit(loaded, encoded, kwargs, streamer)
        request = Request(loaded, encoded, kwargs, streamer)
        self._queue.put(request)
        return request.future

    def _loop(self) -> None:
        held: list[Request] = []  # waiting for another model's batch to drain
        while True:
            # Nothing of a batch outlives it (a method's locals): a model swapped out is freed now.
            self._run(held.pop(0) if held else self._queue.get(), held)

    def _run(self, first: Request, held: list[Request]) -> None:
        """Decode ``first`` and every request of its model that arrives meanwhile, until none is left."""
        model = first.loaded.model
        if self._slots_for(model):
            with torch.inference_mode():
                batch = stepgraphs.for_model(model, self.gpu_max_batch, graphs=self.cuda_graphs != "off")
        else:
            batch = _Batch(model)
        self._admit(batch, [first], held)
        while batch.rows:
            if isinstance(batch, _Batch):
                self._gather(batch, held)
            self._step(batch, held)

    def _gather(self, batch, held: list[Request]) -> None:
        """Let the requests that arrived meanwhile join the running batch, while nothing of another
        model waits (which then gets the next batch: no model starves another)."""
        while True:
            try:
                held.append(self._queue.get_nowait())
            except queue.Empty:
                break
        if all(r.loaded.model is batch.model for r in held):
            joining = list(held)
            held.clear()
            self._admit(batch, joining, held)

    def _admit(self, batch, requests: list[Request], held: list[Request]) -> None:
        """Let ``requests`` join in their order while their rows fit; the rest wait in ``held`` (a
        beam-search request waits for all of its rows, and those after it wait with it)."""
        most = self.max_batch if isinstance(batch, _Batch) else batch.capacity
        fits = []
        for request in requests:
            if beams_of(request.kwargs) > most:  # never fits (the slots' budget made fewer than asked)
                _fail(request, ValueError(f"{beams_of(request.kwargs)} beams: a step holds {most} rows"))
            else:
                fits.append(request)
        requests, room, joining = fits, most - _size(batch.rows), []
        for request in requests:
            rows = beams_of(request.kwargs)
            if rows > room:
                break
            joining.append(request)
            room -= rows
        held += requests[len(joining) :]
        if isinstance(batch, _Batch):  # each encoded alone, the caches copied once for all
            try:
                with torch.inference_mode():
                    failed = batch.join(joining)
            except BaseException as err:  # noqa: BLE001 - the caches could not grow: none joined
                failed = [(request, err) for request in joining]
            for request, err in failed:
                _fail(request, err)
        elif joining:  # slots: encoded together
            try:
                with torch.inference_mode():
                    batch.join_all(joining)
            except BaseException as err:  # noqa: BLE001
                log.exception("a join of %d requests failed; each gets the error", len(joining))
                for request in joining:
                    _fail(request, err)

    def _step(self, batch, held: list[Request]) -> None:
        rows = batch.rows
        try:
            with rows_apart(), torch.inference_mode():
                if isinstance(batch, _Batch):
                    with batch.serving():
                        done = batch.step()
                else:  # joiners are let in between this step's tokens and the next step
                    ahead = self.lookahead if self.lookahead is not None else batch.graphs_on
                    done = batch.step(between=lambda: self._gather(batch, held), ahead=ahead)
        except BaseException as err:  # noqa: BLE001 - every row in the step learns about it
            log.exception("a decoding step of %d rows failed; each gets the error", len(rows))
            for row in {id(r): r for r in [*rows, *batch.rows]}.values():  # and any that joined
                _fail(row.request, err)
            with torch.inference_mode():  # the slots' tensors are inference tensors
                batch.drop()
            return
        self.steps += 1
        self.widest = max(self.widest, _size(rows))
        for row in done:
            if row.request.streamer is not None:
                row.request.streamer.end()
            row.request.future.set_result(row.ids)


def _size(rows: list) -> int:
    """The rows of a step that ``rows`` (chat.rows' members) take: a beam search's beams a row each."""
    return sum(row.width for row in rows)


def _serving(loadeds: list):
    """The context a step runs in (``loadeds``: each row's model, a beam search's once per beam):
    one adapter (or the base) active for all rows, or, for rows of different adapters on one base,
    each row's own (``Host.rows``). (``chat.lora.by_lanes`` served 4 adapters' int8 rows on 2 CPU
    cores no faster than peft's mixed batches: docs/chat-benchmarks.md.)"""
    first = loadeds[0]
    if all(loaded.adapter == first.adapter for loaded in loadeds) or first.host is None:
        return first.activated()
    return first.host.rows(loadeds)


def _fail(request: Request, err: BaseException) -> None:
    if request.streamer is not None:
        request.streamer.end()
    if not request.future.done():
        request.future.set_exception(err)


def make_batcher() -> Batcher | StepBatcher:
    """The engine's scheduler, as ``CHAT_SCHEDULER`` says (default ``step``)."""
    chosen = scheduler()
    if chosen == "process":
        from chat.stepproc import ProcessBatcher  # it builds on this module

        return ProcessBatcher()
    return StepBatcher() if chosen == "step" else Batcher()
