"""Packed training batches: several dialogues per row, attention kept inside each dialogue.

Padding every row to the batch's longest dialogue wastes most of a realistic batch: on the
benchmark's realistic rows a random batch of 1,600 computes ~1.9 tokens per real one. Packing
puts several dialogues (sources in the encoder row, their replies in the decoder row) into each
row: those 1,600 dialogues fit in ~640 rows, 1.57x fewer multiply-adds, 1.54x the samples/s on an
H200 (docs/benchmarks.md). The model must not see across dialogues, so:

* each row carries segment ids (1, 2, ... per dialogue; 0 for padding) for both sides;
* encoder self-attention, decoder (causal) self-attention and cross-attention get 4-D masks
  that keep every token inside its own dialogue; padding attends to padding (or, in the
  decoder's cross-attention, to everything) so that no softmax row is empty (an empty row is
  NaN, and a NaN times a zero gradient still poisons the weight gradients);
* position embeddings restart at 0 for every dialogue.

The loss is the same mean over the same label tokens, so a packed step computes the same loss
and gradients as the padded one (tests compare them). ``install`` adds forward pre-hooks to the
model that swap in the masks and positions while a ``packed`` block is open; outside one, and
for models never installed, nothing changes (evaluation and chat see plain batches).
"""

from __future__ import annotations

import bisect
import contextvars
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass

import torch
from torch.nn.attention import SDPBackend, sdpa_kernel

# The packed batch's keys that are not model inputs: segment ids and the dialogue count (a plain
# int, so counting samples never waits for the GPU).
PACKING_KEYS = ("source_segments", "target_segments", "samples")
# The attention implementations that take an arbitrary 4-D mask (flash attention takes none).
PACKABLE_ATTENTION = ("sdpa", "eager")


def pack_rows(sources: list[int], targets: list[int], max_source: int, max_target: int) -> list[list[int]]:
    """Dialogues (by their source and target lengths) grouped into rows of at most
    ``max_source`` / ``max_target`` tokens: best fit on the source side (the longer one),
    longest first, a new row when the best fit has no room for the target."""
    order = sorted(range(len(sources)), key=lambda i: -sources[i])
    rows: list[list[int]] = []
    free_target: list[int] = []
    by_free: list[tuple[int, int]] = []  # (free source tokens, row), sorted
    for i in order:
        if sources[i] > max_source or targets[i] > max_target:
            raise ValueError(
                f"a dialogue of {sources[i]}/{targets[i]} tokens exceeds rows of {max_source}/{max_target}"
            )
        at = bisect.bisect_left(by_free, (sources[i], -1))
        while at < len(by_free) and free_target[by_free[at][1]] < targets[i]:
            at += 1
        if at == len(by_free):
            rows.append([])
            free_target.append(max_target)
            free, row = max_source, len(rows) - 1
        else:
            free, row = by_free.pop(at)
        rows[row].append(i)
        free_target[row] -= targets[i]
        bisect.insort(by_free, (free - sources[i], row))
    return rows


def token_costs(config) -> tuple[float, float]:
    """Multiply-adds per source token and per target token of a BART-style encoder-decoder
    (linear layers only: attention over these short rows is a few percent). A target token costs
    ~3.6x a source token on BlenderBot-400M (2 encoder layers, 12 decoder layers, LM head)."""
    d = config.d_model
    source = config.encoder_layers * (4 * d * d + 2 * d * config.encoder_ffn_dim) + config.decoder_layers * 2 * d * d
    target = config.decoder_layers * (6 * d * d + 2 * d * config.decoder_ffn_dim) + d * config.vocab_size
    return float(source), float(target)


@dataclass
class PackingCollator:
    """Tokenized rows (``input_ids``, ``labels``; unpadded) to one packed batch: ``input_ids``,
    ``attention_mask`` (real tokens), ``decoder_input_ids``, ``labels``, the segment ids and
    ``samples`` (the number of dialogues).

    Rows hold up to ``max_source`` source tokens; how many target tokens a row may hold is
    chosen per batch, the cheapest by ``costs`` among multiples of 8 from the longest reply to
    ``max_target``: target tokens cost more (12 decoder layers), so filling the encoder rows
    with many short replies can cost more decoder width than it saves (measured on the
    benchmark's realistic rows: 1.57x fewer multiply-adds than per-batch padding at 32 or 40,
    1.28x at 64)."""

    pad_token_id: int
    decoder_start_token_id: int
    max_source: int
    max_target: int
    costs: tuple[float, float] = (1.0, 3.6)  # (per source token, per target token): token_costs
    multiple: int | None = None  # row widths rounded up to this (tensor cores like multiples of 8)

    def __call__(self, features: list[dict]) -> dict[str, torch.Tensor]:
        sources = [list(f["input_ids"]) for f in features]
        # Labels are the reply's tokens (the tokenizer's padding, if any, is -100).
        targets = [[t for t in f["labels"] if t != -100] for f in features]
        rows, width_s, width_t = self._cheapest([len(s) for s in sources], [len(t) for t in targets])
        src_ids, src_seg, dec_ids, labels, tgt_seg = [], [], [], [], []
        for row in rows:
            src_ids.append([t for i in row for t in sources[i]])
            src_seg.append([n for n, i in enumerate(row, 1) for _ in sources[i]])
            # Teacher forcing per dialogue: the decoder start token, then the reply shifted right.
            dec_ids.append([t for i in row for t in (self.decoder_start_token_id, *targets[i][:-1])])
            labels.append([t for i in row for t in targets[i]])
            tgt_seg.append([n for n, i in enumerate(row, 1) for _ in targets[i]])
        source_segments = _padded(src_seg, width_s, 0, torch.int32)
        batch = {
            "input_ids": _padded(src_ids, width_s, self.pad_token_id),
            "attention_mask": (source_segments > 0).long(),
            "decoder_input_ids": _padded(dec_ids, width_t, self.pad_token_id),
            "labels": _padded(labels, width_t, -100),
            "source_segments": source_segments,
            "target_segments": _padded(tgt_seg, width_t, 0, torch.int32),
            "samples": len(features),
        }
        return batch

    def _cheapest(self, sources: list[int], targets: list[int]) -> tuple[list[list[int]], int, int]:
        best = None
        for capacity in sorted({*range(self._width(max(targets)), self.max_target + 1, 8), self.max_target}):
            rows = pack_rows(sources, targets, self.max_source, capacity)
            width_s = self._width(max(sum(sources[i] for i in row) for row in rows))
            width_t = self._width(max(sum(targets[i] for i in row) for row in rows))
            cost = len(rows) * (width_s * self.costs[0] + width_t * self.costs[1])
            if best is None or cost < best[0]:
                best = (cost, rows, width_s, width_t)
        return best[1:]

    def _width(self, used: int) -> int:
        m = self.multiple or 1
        return -(-used // m) * m


def _padded(rows: list[list[int]], width: int, fill: int, dtype=torch.long) -> torch.Tensor:
    return torch.tensor([row + [fill] * (width - len(row)) for row in rows], dtype=dtype)


def samples_in(batch: dict) -> int:
    """Dialogues in a batch: its rows, or what a packed batch says it holds."""
    return batch["samples"] if "samples" in batch else batch["input_ids"].shape[0]


@dataclass
class _Packed:
    source: torch.Tensor  # (rows, source width) segment ids, 0 = padding
    target: torch.Tensor  # (rows, target width)


_ACTIVE: contextvars.ContextVar[_Packed | None] = contextvars.ContextVar("packed_batch", default=None)


@contextmanager
def packed(batch: dict):
    """Yield the model's inputs of ``batch``; for a packed batch the installed hooks apply its
    masks and positions inside the block (keep backward inside too: nothing recomputes the
    forward today, but a recomputing forward would need them)."""
    if "source_segments" not in batch:
        yield batch
        return
    inputs = {k: v for k, v in batch.items() if k not in PACKING_KEYS}
    token = _ACTIVE.set(_Packed(batch["source_segments"], batch["target_segments"]))
    try:
        with steady_attention(batch["source_segments"].is_cuda):
            yield inputs
    finally:
        _ACTIVE.reset(token)


def steady_attention(cuda: bool):
    """On a GPU, PyTorch's memory-efficient SDPA kernel (unless --attention turned it off), for
    batches whose shape is new. cuDNN's kernel (PyTorch's first pick) builds an execution plan for
    every new shape: measured on an H200, a packed step (its row count changes every step) through
    the CLI took 608 ms where its forward + backward alone took 210 ms, and an evaluation's loss
    forward over 1,000 rows 1.7 s; the memory-efficient kernel is as fast on one shape (209 vs
    210 ms) and plans nothing."""
    if cuda and torch.backends.cuda.mem_efficient_sdp_enabled():
        return sdpa_kernel([SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH])
    return nullcontext()


def _positions(segments: torch.Tensor) -> torch.Tensor:
    """Position of each token inside its segment (0 for padding)."""
    starts = torch.ones_like(segments, dtype=torch.bool)
    starts[:, 1:] = segments[:, 1:] != segments[:, :-1]
    index = torch.arange(segments.shape[1], device=segments.device).expand_as(segments)
    first = torch.where(starts, index, 0).cummax(dim=1).values  # index where the current segment began
    return torch.where(segments > 0, index - first, 0)


def _as_mask(allowed: torch.Tensor, module: torch.nn.Module) -> torch.Tensor:
    """A (rows, 1, q, k) boolean mask in the form the model's attention takes: boolean for sdpa,
    additive (0 / -inf-like) for eager."""
    implementation = module.config._attn_implementation
    if implementation == "sdpa":
        return allowed
    if implementation == "eager":
        dtype = module.embed_tokens.weight.dtype
        return torch.zeros(allowed.shape, dtype=dtype, device=allowed.device).masked_fill(
            ~allowed, torch.finfo(dtype).min
        )
    raise ValueError(f"packed batches need attention {' or '.join(PACKABLE_ATTENTION)}, not {implementation!r}")


def _replace(kwargs: dict, name: str, value) -> None:
    if name not in kwargs:  # a transformers release that passes it positionally: fail, never mis-train
        raise RuntimeError(f"packed batches: the model was not called with {name}= (unsupported transformers?)")
    kwargs[name] = value


def _encoder_hook(module, args, kwargs):
    p = _ACTIVE.get()
    if p is not None:
        seg = p.source.to(module.embed_tokens.weight.device, non_blocking=True)
        _replace(kwargs, "attention_mask", _as_mask((seg[:, :, None] == seg[:, None, :])[:, None], module))
    return args, kwargs


def _decoder_hook(module, args, kwargs):
    p = _ACTIVE.get()
    if p is not None:
        device = module.embed_tokens.weight.device
        src, tgt = p.source.to(device, non_blocking=True), p.target.to(device, non_blocking=True)
        causal = torch.ones(tgt.shape[1], tgt.shape[1], dtype=torch.bool, device=device).tril()
        own = (tgt[:, :, None] == tgt[:, None, :]) & causal
        # Padding queries see every encoder position: any non-empty row keeps the softmax finite.
        cross = (tgt[:, :, None] == src[:, None, :]) | (tgt == 0)[:, :, None]
        _replace(kwargs, "attention_mask", _as_mask(own[:, None], module))
        _replace(kwargs, "encoder_attention_mask", _as_mask(cross[:, None], module))
    return args, kwargs


def _position_hook(side: str):
    def hook(module, args, kwargs):
        p = _ACTIVE.get()
        if p is not None:
            seg = getattr(p, side).to(module.weight.device, non_blocking=True)
            kwargs["position_ids"] = _positions(seg)
        return args, kwargs

    return hook


def install(model) -> None:
    """Add the hooks to a BlenderBot-style model (``model.model.encoder`` / ``.decoder``); once."""
    if getattr(model, "_packing_hooks", False):
        return
    encoder, decoder = model.get_encoder(), model.get_decoder()
    encoder.register_forward_pre_hook(_encoder_hook, with_kwargs=True)
    decoder.register_forward_pre_hook(_decoder_hook, with_kwargs=True)
    encoder.embed_positions.register_forward_pre_hook(_position_hook("source"), with_kwargs=True)
    decoder.embed_positions.register_forward_pre_hook(_position_hook("target"), with_kwargs=True)
    model._packing_hooks = True
