"""The step loop on a GPU: every running row in fixed-address slots, each decoder step one CUDA-graph
replay per batch width, and the logits processing of plain greedy rows done for all rows at once.

``chat.stepping._Batch`` (the CPU's) grows and trims its caches every step and runs each row's
logits through that row's own processors: cheap on a CPU, where the model's arithmetic dominates,
but on a GPU a 400M decoder step for 64 rows is well under a millisecond of kernels, and launching
them (plus 64 rows of Python) took the rest (docs/chat-benchmarks.md: the eager step loop served
half the static batcher's replies/s). Here instead:

* **Slots.** Every decoder layer's self-attention keys/values live in one tensor of ``capacity``
  rows x the decoder's positions, its cross-attention keys/values in one of ``capacity`` rows x the
  encoder's positions. A request takes a free slot and keeps it to its end; a row's token ``t`` is
  written at column ``t`` (index_put at each row's own position) and a mask hides the columns a row
  does not have (older rows' leftovers in a reused slot, a shorter source's padding). Nothing moves
  when rows join or leave, so a step's tensors always have the same addresses.
* **Graphs.** A step over the first ``width`` slots (the highest used slot, rounded up to a power of
  two), attending over the columns its rows need (rounded up to 32: the self-attention positions
  and the sources), is recorded once per such shape and set of n-gram sizes, then replayed:
  embeddings, all decoder layers, the LM head and the batched logits pass below in one launch.
  Attention runs PyTorch's plain math path: with one query per row the fused kernels waste most of
  their tiles (42% of a 64-row step on an H200, docs/chat-benchmarks.md). Widths share one
  memory pool; its size counts against ``budget_bytes`` with the caches (past it, new shapes run
  eagerly). Off a GPU, or with ``graphs=False``, the same step runs eagerly (the CPU tests do that).
* **Batched logits.** Greedy rows whose processors are only those the ``fast`` preset and the API
  give (repetition penalty, minimum length, forced EOS at the length limit, n-gram blocking) are
  processed together (``chat.greedy.choose_greedy``: the same operations as transformers'
  processors and ``chat.fastgen.NoRepeatNGram``, on each row's own ids and length). Any other row (sampling with
  its own generator, encoder n-gram blocking, custom processors) goes through its own processors
  on its own logits, as in ``chat.stepping``.
* **Joins recorded too.** Joining requests are encoded together (right-padded, masked), their
  cross-attention keys/values written into their slots and the slots set up, as one recorded launch
  per (joiners rounded up to a power of two, longest source rounded up to 32), from two transfers.
* **Few torch calls in the worker.** Every torch call lets the chats' threads take the GIL, and
  under load the worker then waits for it back (a millisecond or more with 64 busy threads; pure
  Python does not give it up): a greedy step is one replay and one read of the chosen tokens, a
  join one replay, the tokens reach ``chat.batching.ReaderTextStreamer`` as ints. And the next step
  is started before a step's tokens are handed out (``step(ahead=True)``), so that Python runs beside
  the device's step.

A row's reply is the one ``generate()`` gives it alone, up to float rounding (the CPU tests check
replies token for token on the demo model; on a GPU batched products round differently). A beam
search takes a slot per beam; after each step transformers' helpers choose on the host
(``chat.beams``) and each hypothesis that goes on copies its parent's slot (``chat.beams.reorder``).
Rows of LoRA adapters on the model (``chat.serving.Host``) step beside the base's: each through its
own adapter from every layer's adapters stacked by lane (``chat.lora.by_lanes``: a row's lane is a
device tensor, so one recorded step serves any mix), recorded per set of lanes and re-recorded when
the adapters change (the host's ``version``); an adapter peft alone serves (DoRA, a bias of its own)
makes its steps eager, rows of different adapters through peft's mixed-batch forward. On a GPU
``chat.stepping`` sends beam searches' requests to the static batcher unless ``beams``, adapters'
if ``adapters_in_slots`` is turned off.
"""

from __future__ import annotations

import logging
import weakref
from contextlib import contextmanager, nullcontext

import numpy
import torch
from torch.nn.attention import SDPBackend, sdpa_kernel

from chat.batching import Request, hand_ids
from chat.beams import reorder
from chat.graphs import record
from chat.greedy import UNPROCESSED, choose_greedy
from chat.lora import by_lanes, lane_mask, stack_all
from chat.rows import beams_of, eos_mask, eos_of, member
from chat.stepcache import Layer, SlotSelfAttention, StepCache, cross_keys_values, decoder_layer

log = logging.getLogger(__name__)

# Caches plus graph memory one model's step loop may hold: on a GPU at most this, a quarter of the
# device's memory and half of what is free when the slots are made (an H200: 16 GiB, 256 fp32 rows of
# the 400M model at 31.5 MB each; a 16 GB T4: 4 GiB, ~97 rows); off a GPU (tests) 2 GiB.
GPU_BUDGET_BYTES = 16 << 30
CPU_BUDGET_BYTES = 2 << 30


def default_budget(device: torch.device) -> int:
    """The slots' memory budget on ``device`` (see GPU_BUDGET_BYTES)."""
    if device.type != "cuda":
        return CPU_BUDGET_BYTES
    free, total = torch.cuda.mem_get_info(device)
    return int(min(GPU_BUDGET_BYTES, total / 4, free / 2))


class SlotBatch:
    """The running rows of one model, in slots: ``join_all`` (several requests at once), then ``step``
    and ``rows`` as ``chat.stepping._Batch``."""

    def __init__(self, model, capacity: int, graphs: bool = True, budget_bytes: int | None = None):
        self._model = weakref.ref(model)
        config, decoder = model.config, model.get_decoder()
        attn = decoder.layers[0].self_attn
        heads, dim = attn.num_heads if hasattr(attn, "num_heads") else config.decoder_attention_heads, attn.head_dim
        self.columns = config.max_position_embeddings  # decoder positions
        self.sources = getattr(config, "max_source_positions", None) or config.max_position_embeddings
        dtype, device = model.dtype, model.device
        layers = len(decoder.layers)
        budget_bytes = default_budget(device) if budget_bytes is None else budget_bytes
        per_row = layers * 2 * heads * dim * (self.columns + self.sources) * dtype.itemsize
        self.capacity = max(1, min(capacity, int(budget_bytes * 3 / 4) // per_row))
        self.budget_bytes = budget_bytes
        c = self.capacity

        def zeros(*shape, **kw):
            return torch.zeros(*shape, device=device, **{"dtype": dtype, **kw})

        # Views of one tensor: a beam search's reorder is two calls for all layers (chat.beams.reorder).
        self.self_cache = zeros(2, layers, c, heads, self.columns, dim)
        self.self_keys, self.self_values = list(self.self_cache[0]), list(self.self_cache[1])
        # What joining writes has one more row, slot ``c``: a join is recorded for a power-of-two
        # number of joiners, and the padding rows write there (no step reads it).
        j = c + 1
        self.cross_keys = [zeros(j, heads, self.sources, dim) for _ in range(layers)]
        self.cross_values = [zeros(j, heads, self.sources, dim) for _ in range(layers)]
        low = torch.finfo(dtype).min
        self.cross_mask = torch.full((j, 1, 1, self.sources), low, dtype=dtype, device=device)
        self.vocab = model.get_output_embeddings().weight.shape[0]
        long = torch.long
        self.ids = torch.full((j, self.columns), self.vocab, dtype=long, device=device)
        self.length = torch.ones(j, dtype=long, device=device)  # ids so far (a free slot: 1, harmless)
        self.tokens = torch.zeros(j, 1, dtype=long, device=device)  # the id each row feeds next
        self.active = torch.zeros(j, dtype=torch.bool, device=device)
        self.penalty = torch.ones(j, device=device)
        self.eos_until = torch.zeros(j, dtype=long, device=device)
        self.forced_at = torch.full((j,), -1, dtype=long, device=device)
        self.ngram = torch.zeros(j, dtype=long, device=device)
        self.lane = torch.zeros(j, dtype=long, device=device)  # each row's adapter's lane (0: the base)
        self._lanes = [0] * j  # the same, as the host last said
        # Joiners' inputs, copied in by one transfer each: per row its source ids, their mask, its
        # slot, then its eos_until, forced_at, n-gram size and lane (``_join_body`` reads them).
        self.staged = torch.zeros(c, 2 * self.sources + 5, dtype=long, device=device)
        self.staged_penalty = torch.ones(c, device=device)
        self.source_index = torch.arange(self.sources, device=device)
        self.slot_index = torch.arange(c, device=device)
        self.column_index = torch.arange(self.columns, device=device)
        self.choice = torch.zeros(c, dtype=long, device=device)
        self.logits = torch.zeros(c, self.vocab, device=device)
        self.eos = eos_of(model)
        self.eos_mask = eos_mask(self.eos, self.vocab, device)
        self.slots: list = [None] * c  # the row in each slot
        self.graphs_on = graphs and device.type == "cuda"
        self._graphs: dict = {}  # _forward's arguments -> CUDAGraph, or None where capture failed
        self._pool = torch.cuda.graph_pool_handle() if self.graphs_on else None
        self.graph_bytes = 0  # what the graphs' memory pool took (counted against the budget)
        self.cache_bytes = per_row * c
        self.replays = 0
        self.joins_replayed = 0
        self._flight = None  # the step started and not yet collected: (rows, width, rows choosing on the host)
        self._ahead = True  # may the next step start early (the last step's rows were recorded-capable)
        self._version = None  # the host's adapters' version the recorded lanes steps read

    @property
    def model(self):
        return self._model()

    @property
    def rows(self) -> list:
        """The running members (chat.rows': a Row, or a beam search's BeamRows in ``width`` slots)."""
        return list(dict.fromkeys(row for row in self.slots if row is not None))

    # -- joining -----------------------------------------------------------------------------------

    def join_all(self, requests: list[Request]) -> None:
        """Give each request a free slot and set its row up there: the sources of the requests of
        each model (base or adapter) encoded together into their slots' cross-attention keys/values."""
        model = self.model
        free = [i for i, row in enumerate(self.slots) if row is None]
        wanted = sum(beams_of(request.kwargs) for request in requests)
        if wanted > len(free):
            raise ValueError(f"{wanted} rows joining, {len(free)} slots free")
        start = model.generation_config.decoder_start_token_id
        groups: dict[int, list] = {}
        made = []
        for request in requests:
            row = member(request, model, start)
            if row.source > self.sources:
                raise ValueError(f"a source of {row.source} tokens is over the encoder's {self.sources} positions")
            row.slots, free = free[: row.width], free[row.width :]  # a beam search: a slot per beam
            row.tokens = [start]
            groups.setdefault(id(request.loaded), []).append(row)
            made.append(row)
        try:
            with self._lanes_of([request.loaded for request in requests]) as (lanes, version, each):
                for row, lane in zip(made, each):
                    for slot in row.slots:
                        self._lanes[slot] = lane
                if lanes or len(groups) == 1 and made[0].request.loaded.adapter is None:  # together
                    self._join(made, lanes, version)
                else:  # peft's own forward for some: each model apart
                    for rows in groups.values():
                        self._join(rows)
        except BaseException:  # slots a join set up stay free: none may step (its length would grow)
            self.active[[slot for row in made for slot in row.slots]] = False
            raise
        for row in made:
            for slot in row.slots:
                self.slots[slot] = row

    def _join(self, rows: list, lanes: tuple | None = None, version: int | None = None) -> None:
        """Copy the rows' sources and settings to the device (two transfers) and run ``_join_body``
        for them, recorded as a CUDA graph per (joiners rounded up to a power of two, longest source
        rounded up to 32) like the steps: a join is one launch, not the ~200 of an eager encoder.
        ``lanes``: (lanes, rank) of the host's adapters, each row through its own; else the rows are
        one model's (the base's: recorded; an adapter's: eagerly, as it is active)."""
        model, sources = self.model, self.sources
        slots = [(row, slot) for row in rows for slot in row.slots]  # a beam search: its source in each beam's slot
        n = min(self.capacity, 1 << (len(slots) - 1).bit_length())
        width = _bucket(max(row.source for row in rows), sources)
        joiners = [(row.request.source, slot, row.plain or UNPROCESSED, self._lanes[slot]) for row, slot in slots]
        staged, penalty = stage(joiners, n, sources, model.config.pad_token_id or 0, self.capacity)
        self.staged[:n].copy_(staged)
        self.staged_penalty[:n].copy_(penalty)
        loaded = rows[0].request.loaded
        with nullcontext() if lanes else loaded.activated():  # its adapter's projections (or none)
            graph = None
            if self.graphs_on and (lanes or loaded.adapter is None):
                key = ("join", n, width, lanes, version)
                graph = self._graph(key, lambda: self._join_body(n, width, lanes))
            if graph is not None:
                graph.replay()
                self.joins_replayed += 1
            else:
                self._join_body(n, width, lanes)

    def _join_body(self, n: int, width: int, lanes: tuple | None = None) -> None:
        """Encode the first ``n`` staged sources (``width`` positions, right-padded and masked, each
        at its positions as alone), project each decoder layer's cross-attention keys/values into
        their slots and set the slots' rows up. Reads and writes only fixed-address tensors."""
        model, sources = self.model, self.sources
        staged = self.staged[:n]
        ids, mask, slots = staged[:, :width], staged[:, sources : sources + width], staged[:, 2 * sources]
        with self._through(lanes, staged[:, 2 * sources + 4]):
            hidden = model.get_encoder()(input_ids=ids, attention_mask=mask).last_hidden_state
            for i, (k, v) in enumerate(cross_keys_values(model.get_decoder(), hidden)):
                self.cross_keys[i][:, :, :width].index_copy_(0, slots, k)
                self.cross_values[i][:, :, :width].index_copy_(0, slots, v)
        low = torch.finfo(self.cross_mask.dtype).min
        visible = self.source_index[None] < mask.sum(1)[:, None]
        self.cross_mask.index_copy_(0, slots, torch.where(visible, 0.0, low).to(self.cross_mask.dtype)[:, None, None])
        start = model.generation_config.decoder_start_token_id
        self.ids.index_fill_(0, slots, self.vocab)
        self.ids[:, 0].index_fill_(0, slots, start)
        self.length.index_fill_(0, slots, 1)
        self.tokens[:, 0].index_fill_(0, slots, start)
        self.active.index_fill_(0, slots, True)
        self.penalty.index_copy_(0, slots, self.staged_penalty[:n])
        for column, field in enumerate((self.eos_until, self.forced_at, self.ngram, self.lane)):
            field.index_copy_(0, slots, staged[:, 2 * sources + 1 + column])

    # -- stepping ----------------------------------------------------------------------------------

    def _forward(
        self, width: int, sizes: tuple[int, ...], columns: int, sources: int, lanes=None, advance: bool = False
    ) -> None:
        """One decoder step over slots [0, width), attending over the first ``columns`` positions
        of the self-attention cache and ``sources`` of the cross-attention one (enough for every
        running row): logits into ``self.logits``, the batched greedy choice into ``self.choice``
        and, ``advance``, each row on by that choice (every row greedy). ``lanes``: (lanes, rank), each
        row through its own lane's adapter. Reads and writes only fixed-address tensors (a graph body)."""
        model = self.model
        decoder = model.get_decoder()
        length, tokens = self.length[:width], self.tokens[:width]
        positions = length - 1
        places = decoder.embed_positions(tokens.shape, 0, position_ids=positions[:, None])
        hidden = decoder.embed_tokens(tokens) + places
        dtype = self.cross_mask.dtype
        low = torch.finfo(dtype).min
        visible = self.column_index[None, :columns] < length[:, None]
        self_mask = torch.where(visible, 0.0, low).to(dtype)[:, None, None]
        cross = [
            Layer(k[:width, :, :sources], v[:width, :, :sources]) for k, v in zip(self.cross_keys, self.cross_values)
        ]
        keys, values = [k[:width] for k in self.self_keys], [v[:width] for v in self.self_values]
        cache = StepCache(SlotSelfAttention(keys, values, self.slot_index[:width], positions, columns), cross)
        cross_mask = self.cross_mask[:width, ..., :sources]
        # One query per row: fused attention kernels tile over queries and waste most of their
        # work here; PyTorch's plain math path (two batched products) reads each key once.
        with sdpa_kernel(SDPBackend.MATH), self._through(lanes, self.lane[:width]):
            for layer in decoder.layers:
                hidden = decoder_layer(layer, hidden, self_mask, cross[0].keys, cross_mask, cache)
        logits = model.lm_head(decoder.layer_norm(hidden)) + model.final_logits_bias.to(hidden.device)
        logits = logits[:, -1].float()
        self.logits[:width].copy_(logits)
        chosen = choose_greedy(
            logits,
            self.ids[:width],
            length,
            self.penalty[:width],
            self.eos_until[:width],
            self.forced_at[:width],
            self.ngram[:width],
            sizes,
            self.eos_mask,
        )
        self.choice[:width].copy_(chosen)
        if advance:
            self._advance(width)

    def drop(self) -> None:
        """Forget every row (after a failed step)."""
        self.slots = [None] * self.capacity
        self._flight = None
        self.active.zero_()

    def serving(self):
        """An eager step's context for peft's own forward: each slot's adapter (holes: the first row's)."""
        from chat.stepping import _serving

        rows = self.rows
        return _serving([(row or rows[0]).request.loaded for row in self.slots[: self._width()]])

    @contextmanager
    def _lanes_of(self, loadeds: list):
        """How rows of ``loadeds`` step, held so while inside: ((lanes, rank), the host's version,
        each one's lane) where each goes through its own adapter by lanes (``chat.lora.by_lanes``:
        steps recorded for any mix); (None, None, lanes of 0) where all are the base's or one of their
        adapters needs peft's own forward."""
        host = loadeds[0].host if loadeds else None
        if host is None or all(loaded.adapter is None for loaded in loadeds):
            yield None, None, [0] * len(loadeds)
            return
        with host.lanes(loadeds) as plan:
            if plan is None:
                yield None, None, [0] * len(loadeds)
            else:
                lanes, rank, version, each = plan
                if self._version != version:  # the adapters changed: their stacks and recordings too
                    self._graphs = {key: graph for key, graph in self._graphs.items() if key[-1] is None}
                    stack_all(self.model, lanes, rank)
                    self._version = version
                yield (lanes, rank), version, each

    def _through(self, lanes: tuple | None, lane: torch.Tensor):
        """Inside a step or join body: each row (lanes ``lane``) through its own adapter, or as is."""
        if lanes is None:
            return nullcontext()
        return by_lanes(lanes[0], lanes[1], lane_mask(lane, len(lanes[0]), lanes[1], self.cross_mask.dtype))

    def _width(self) -> int:
        used = max(i for i, row in enumerate(self.slots) if row is not None)
        return min(self.capacity, 1 << used.bit_length())  # slots [0, width): a power of two

    def step(self, between=None, ahead: bool = False) -> list:
        """One decoder step for every row; returns the rows that finished (their slots freed).

        ``between()`` (the batcher letting new requests join) runs once this step's tokens are
        known and the finished rows' slots free. Then, ``ahead``, where every row's next token is
        chosen on the device (the greedy rows of a base model), the next step is started before this
        one's tokens reach the streamers: the readers' Python runs beside the device's next step
        (the next call collects it). The tokens are those of stepping one step at a time."""
        if self._flight is None:
            self._launch()
        done, handed = self._collect()
        if between is not None:
            between()
        if ahead and self._ahead and self.rows and all(row.plain for row in self.rows):
            self._launch()
        for streamer, token in handed:
            hand_ids(streamer, [token])
        return done

    def _launch(self) -> None:
        """Start a step over the running rows (queued on the device; nothing waits for it)."""
        rows, width = self.rows, self._width()
        shape = (
            width,
            tuple(sorted({row.plain["ngram"] for row in rows if row.plain and row.plain["ngram"]})),
            _bucket(max(len(row.tokens) if row.plain else row.fed for row in rows), self.columns),
            _bucket(max(row.source for row in rows), self.sources),
        )
        others = [row for row in rows if row.plain is None]
        with self._lanes_of([row.request.loaded for row in rows]) as (lanes, version, each):
            # Rows whose adapter was unloaded and attached again meanwhile, in another lane.
            moved = [(slot, lane) for row, lane in zip(rows, each) for slot in row.slots] if lanes else []
            moved = [(slot, lane) for slot, lane in moved if self._lanes[slot] != lane]
            if moved:
                slots, now = zip(*moved)
                for slot, lane in moved:
                    self._lanes[slot] = lane
                self.lane[list(slots)] = torch.tensor(now, device=self.lane.device)
            # Recorded: the base's rows, or every row through its own adapter by lanes; peft's own
            # forward (an adapter it alone serves) runs eagerly, as each row's adapter is active.
            peft = lanes is None and any(row.request.loaded.adapter is not None for row in rows)
            # every row's token chosen on the device: the rows advance in the step
            shape = (*shape, lanes, not others)
            with nullcontext() if lanes else self.serving():
                graph = None
                if self.graphs_on and not peft:
                    # (warmed up without advancing: the warm-up runs, the capture does not)
                    key = (*shape, version)
                    graph = self._graph(key, lambda: self._forward(*shape), lambda: self._forward(*shape[:-1]))
                if graph is not None:
                    graph.replay()
                    self.replays += 1
                else:
                    self._forward(*shape)
        self._ahead = not peft
        self._flight = (rows, width, others)

    def _advance(self, width: int) -> None:
        """Each active row takes its chosen token: into its ids, its length, its next input."""
        active, length = self.active[:width], self.length[:width]
        column = length.clamp(max=self.columns - 1)[:, None]
        ids = self.ids[:width]
        ids.scatter_(1, column, torch.where(active, self.choice[:width], ids.gather(1, column)[:, 0])[:, None])
        length += active
        self.tokens[:width, 0] = self.choice[:width]

    def _collect(self) -> tuple[list, list]:
        """Wait for the started step: its finished rows (slots freed) and each streamed row's
        (streamer, new token), not yet handed over."""
        rows, width, others = self._flight
        self._flight = None
        done = []
        if others:  # their own processors (and generators) on their own logits
            own = torch.tensor([slot for row in others for slot in row.slots], device=self.logits.device)
            logits, at = self.logits[own].cpu(), 0
            for row in others:
                if row.choose(logits[at : at + row.width]):
                    done.append(row)
                at += row.width
            beams = [row for row in others if row.order is not None and row not in done]
            reorder(self.self_cache, beams)  # the hypotheses that go on, in their slots
            chosen = [token for row in others for token in row.last()[:, 0].tolist()]  # each beam's, reordered
            self.choice[own] = torch.tensor(chosen, device=own.device)
            self._advance(width)
        chosen = self.choice[:width].cpu().tolist()  # the step's one wait for the device
        handed = []
        for row in rows:
            if row.plain is None:
                continue
            token = chosen[row.slots[0]]
            row.tokens.append(token)
            if row.request.streamer is not None:
                handed.append((row.request.streamer, token))
            if token in self.eos or len(row.tokens) >= row.plain["max_length"]:
                row.ids = torch.tensor([row.tokens])
                done.append(row)
        if done:
            slots = [slot for row in done for slot in row.slots]
            self.active[slots] = False  # one call (the index list becomes a tensor inside it)
            for slot in slots:
                self.slots[slot] = None
        return done, handed

    def _graph(self, key: tuple, body, warm=None):
        """The graph of ``body`` (a step or a join, ``key`` its arguments), recorded on first use
        (None: eager, when capture failed or the budget is spent). Before recording, ``warm`` (else
        ``body``) runs once: it must leave the rows as they were."""
        if key in self._graphs:
            return self._graphs[key]
        if self.cache_bytes + self.graph_bytes >= self.budget_bytes:
            return None
        try:
            graph, held = record(body, warm, pool=self._pool)  # (``warm`` must leave the rows as they were)
            self.graph_bytes += held
        except Exception as err:  # some model code cannot be captured: this shape runs eagerly
            self.graph_bytes += getattr(err, "held", 0)  # the shared pool keeps what the failed one took
            log.warning("CUDA-graph capture of %s failed (%s: %s)", key, type(err).__name__, err)
            graph = None
        self._graphs[key] = graph
        return graph


def stage(joiners: list, n: int, sources: int, pad: int, spare: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``staged`` and ``staged_penalty``'s first ``n`` rows for ``joiners`` (source ids, slot, settings, lane).
    In numpy (few torch calls): from nested lists 10.5 ms for 256 joiners on a 2-core Xeon, this 0.8 ms."""
    staged = numpy.zeros((n, 2 * sources + 5), dtype=numpy.int64)
    staged[:, :sources] = pad
    staged[len(joiners) :, sources] = 1  # padding rows: one token seen (none would divide by zero),
    staged[len(joiners) :, 2 * sources :] = (spare, 0, -1, 0, 0)  # written into the spare slot
    penalty = numpy.ones(n, dtype=numpy.float32)
    for k, (ids, slot, settings, lane) in enumerate(joiners):
        staged[k, : len(ids)] = ids
        staged[k, sources : sources + len(ids)] = 1
        staged[k, 2 * sources :] = (slot, settings["eos_until"], settings["forced_at"], settings["ngram"], lane)
        penalty[k] = settings["penalty"]
    return torch.from_numpy(staged), torch.from_numpy(penalty)


def _bucket(needed: int, most: int) -> int:
    """Columns a step attends over: ``needed`` rounded up to a multiple of 32, at most ``most`` (so
    the graphs of a few shapes serve every length)."""
    return min(most, -(-needed // 32) * 32)


_PER_MODEL: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def for_model(model, capacity: int, graphs: bool = True) -> SlotBatch:
    """The model's slots (made on first use, kept between bursts with their graphs, freed with the
    model)."""
    kept = _PER_MODEL.setdefault(model, {})  # one per (capacity, graphs) asked: a benchmark asks two
    if (capacity, graphs) not in kept:
        kept[(capacity, graphs)] = SlotBatch(model, capacity, graphs)
    return kept[(capacity, graphs)]
