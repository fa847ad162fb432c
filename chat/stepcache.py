"""The step loop's caches (``chat.stepping._Batch``; the GPU's slots use ``Layer``, ``StepCache``,
``cross_keys_values`` and their own ``SlotSelfAttention``): the decoder's self-attention cache for
rows at different positions, the cross-attention keys/values projected once per request, and the
cache object a decoder layer reads."""

from __future__ import annotations

import torch
from transformers import EncoderDecoderCache

from chat.fastgen import CACHE_KWARG


class SelfAttention:
    """The decoder's self-attention cache for all rows, right-aligned: after a step a row's keys
    are the last ``lengths[row]`` columns. Duck-typed for ``BlenderbotAttention`` (``update``).

    Each layer's keys and values (``keys[i]``, ``values[i]``) are views of buffers with spare
    columns on the right: a step writes its column into them (~6 us a layer for 8 rows) where a
    concatenation copied the whole cache (~37 us); every ``SPARE`` steps the live columns move to a
    new buffer with room again."""

    SPARE = 8

    def __init__(self, layers: int):
        self.keys: list[torch.Tensor | None] = [None] * layers
        self.values: list[torch.Tensor | None] = [None] * layers
        self._room: list[tuple | None] = [None] * layers  # (key buffer, value buffer, start, stop)

    def update(self, key, value, layer_idx, *args, **kwargs):
        room, new = self._room[layer_idx], key.shape[2]
        if room is None or room[3] + new > room[0].shape[2]:  # no buffer, or no room left in it
            live = (self.keys[layer_idx], self.values[layer_idx]) if room is not None else None
            n = 0 if live is None else live[0].shape[2]
            buffers = []
            for old, fresh in zip(live or (None, None), (key, value)):
                buffer = fresh.new_empty((fresh.shape[0], fresh.shape[1], n + new + self.SPARE, fresh.shape[3]))
                if n:
                    buffer[:, :, :n] = old
                buffers.append(buffer)
            room = (*buffers, 0, n)
        k, v, start, stop = room
        k[:, :, stop : stop + new], v[:, :, stop : stop + new] = key, value
        self._set(layer_idx, (k, v, start, stop + new))
        return self.keys[layer_idx], self.values[layer_idx]

    def _set(self, i: int, room: tuple) -> None:
        k, v, start, stop = self._room[i] = room
        self.keys[i], self.values[i] = k[:, :, start:stop], v[:, :, start:stop]

    def keep(self, columns: int) -> None:
        """Keep each row's last ``columns`` columns (no row reads the older ones any more)."""
        for i, room in enumerate(self._room):
            if room is not None:
                self._set(i, (room[0], room[1], max(room[2], room[3] - columns), room[3]))

    def rows(self, index: torch.Tensor | None = None, added: int = 0) -> None:
        """Keep the rows ``index`` picks, in its order (None: all), then add ``added`` rows of zeros.
        Every layer's buffers are made before any is replaced: a failure leaves the cache as it was."""
        grown = []
        for room in self._room:
            if room is None:
                grown.append(None)
                continue
            k, v, start, stop = room
            if index is not None:
                k, v = k.index_select(0, index), v.index_select(0, index)
            if added:
                k, v = (torch.cat([t, t.new_zeros((added, *t.shape[1:]))]) for t in (k, v))
            grown.append((k, v, start, stop))
        for i, room in enumerate(grown):
            if room is not None:
                self._set(i, room)


class Layer:
    """One layer's cross-attention keys and values, where a decoder layer reads them in a cache."""

    def __init__(self, keys, values):
        self.keys, self.values = keys, values


class StepCache(EncoderDecoderCache):
    """What a decoder layer reads: our self-attention cache and a filled cross-attention one.
    (No ``EncoderDecoderCache.__init__``: the layers only read these three attributes.)"""

    def __init__(self, self_attention: SelfAttention, cross: list[Layer]):  # noqa: D107
        self.self_attention_cache = self_attention
        self.cross_attention_cache = type("Cross", (), {"layers": cross})()
        self.is_updated = dict.fromkeys(range(len(cross)), True)


def cross_keys_values(decoder, hidden: torch.Tensor) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Each decoder layer's cross-attention keys and values (rows, heads, positions, dim) projected
    from the encoder's output ``hidden`` (rows, positions, features): what the layers would project
    at every step, done once."""
    out = []
    for layer in decoder.layers:
        attn = layer.encoder_attn
        shape = (*hidden.shape[:2], -1, attn.head_dim)
        out.append((attn.k_proj(hidden).view(shape).transpose(1, 2), attn.v_proj(hidden).view(shape).transpose(1, 2)))
    return out


def stacked(parts: list[torch.Tensor], width: int) -> torch.Tensor:
    """Keys/values (rows, heads, positions, dim) one after another in one new tensor, each
    zero-padded to ``width`` positions: one copy of each."""
    first = parts[0]
    out = first.new_zeros((sum(len(p) for p in parts), first.shape[1], width, first.shape[3]))
    start = 0
    for part in parts:
        out[start : start + len(part), :, : part.shape[2]] = part
        start += len(part)
    return out


class SlotSelfAttention:
    """What the decoder layers' self-attention writes and reads in the GPU's slots (chat.stepgraphs):
    each row's new key/value at its own position of its slot, then the slots' whole columns (a
    mask hides the ones a row lacks)."""

    def __init__(self, keys, values, rows, positions, columns: int):
        self.keys, self.values, self.rows, self.positions, self.columns = keys, values, rows, positions, columns

    def update(self, key, value, layer_idx, *args, **kwargs):
        keys, values = self.keys[layer_idx], self.values[layer_idx]
        keys[self.rows, :, self.positions] = key[:, :, 0]
        values[self.rows, :, self.positions] = value[:, :, 0]
        return keys[:, :, : self.columns], values[:, :, : self.columns]


def decoder_layer(layer, hidden, self_mask, cross_keys, cross_mask, cache: StepCache) -> torch.Tensor:
    """One decoder layer's step over ``cache``: passed by the keyword the installed transformers
    names it (``cache`` from 5.24, ``past_key_values`` before; a wrong name is swallowed by the
    layer's ``**kwargs`` and the step then attends to its own token alone)."""
    out = layer(hidden, self_mask, cross_keys, encoder_attention_mask=cross_mask, **{CACHE_KWARG: cache})
    return out[0] if isinstance(out, tuple) else out
