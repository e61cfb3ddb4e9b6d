"""The running batch's KV cache: one left-padded cache that sequences join and leave.

Continuous batching needs every running sequence in one forward pass, so one base-layer request
carries all their rows. Sequences have different lengths; we keep them in one cache padded on the
left (like ``generate`` with a left-padded batch), with a 2-D attention mask marking real tokens
and per-row position ids. Joining pads the shorter of two caches on the left and concatenates
them on the batch axis; leaving selects the remaining rows and drops leading columns that are
padding in every row. Both copy the cache once per event.

A decode step does not copy the cache: each layer keeps its keys and values in buffers with spare
columns for the tokens the running sequences may still generate (:class:`RoomyLayer`), and a step
writes its one new column in place. (``transformers``' ``DynamicLayer`` concatenates, copying the
whole cache every step.) The model sees the filled columns as views, the same numbers in the same
layout per row, so attention is computed exactly as over a plain cache.

A row's real tokens always occupy contiguous columns at the right, so column distances equal
position distances and sliding-window masks stay right.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from transformers import DynamicCache
from transformers.cache_utils import DynamicLayer

from symbiosis.errors import SymbiosisError


class UnsupportedCacheError(SymbiosisError):
    """The model's cache is not a plain key/value cache this server can pad and merge."""


class RoomyLayer(DynamicLayer):
    """A ``DynamicLayer`` whose keys/values are the filled columns of buffers with spare room."""

    def __init__(self, spare_columns: int = 0) -> None:
        super().__init__()
        self.spare_columns = spare_columns  # room added whenever the buffers are (re)allocated
        self._key_buffer: torch.Tensor | None = None
        self._value_buffer: torch.Tensor | None = None

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        used = self.get_seq_length()
        needed = used + key_states.shape[-2]
        if self._key_buffer is None or needed > self._key_buffer.shape[-2]:
            self._grow(needed, key_states, value_states)
        self._key_buffer[..., used:needed, :].copy_(key_states)
        self._value_buffer[..., used:needed, :].copy_(value_states)
        self.keys = self._key_buffer[..., :needed, :]
        self.values = self._value_buffer[..., :needed, :]
        return self.keys, self.values

    def _grow(self, needed: int, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        old = 0 if self._key_buffer is None else self._key_buffer.shape[-2]
        capacity = max(needed + self.spare_columns, 2 * old)  # doubling: a sequence that outgrows its room
        used = self.get_seq_length()
        buffers = []
        for states, filled in ((key_states, self.keys), (value_states, self.values)):
            buffer = states.new_empty((*states.shape[:-2], capacity, states.shape[-1]))
            if used:
                buffer[..., :used, :].copy_(filled)
            buffers.append(buffer)
        self._key_buffer, self._value_buffer = buffers

    def buffer_bytes(self) -> int:
        if self._key_buffer is None:
            return 0
        return self._key_buffer.nbytes + self._value_buffer.nbytes


def roomy_cache(spare_columns: int) -> DynamicCache:
    """An empty ``DynamicCache`` whose layers are :class:`RoomyLayer` objects with ``spare_columns`` of room."""
    cache = DynamicCache()
    cache.layer_class_to_replicate = lambda: RoomyLayer(spare_columns)
    return cache


def _layers(cache: DynamicCache) -> list[RoomyLayer]:
    layers = list(cache.layers)
    for layer in layers:
        if not isinstance(layer, RoomyLayer):
            raise UnsupportedCacheError(
                f"the model built a {type(layer).__name__} cache layer; the api server batches sequences in a "
                "left-padded key/value cache and supports models whose attention keeps plain key/value tensors"
            )
    return layers


def _pad_left(tensor: torch.Tensor, columns: int, dim: int) -> torch.Tensor:
    if columns == 0:
        return tensor
    shape = list(tensor.shape)
    shape[dim] = columns
    return torch.cat([tensor.new_zeros(shape), tensor], dim=dim)


@dataclass
class PaddedBatch:
    """Rows of running sequences: their cache, which cache columns are real, and next positions."""

    cache: DynamicCache
    mask: torch.Tensor  # [rows, columns] int64, 1 where the column holds a real token of the row
    positions: torch.Tensor  # [rows] int64, position id of each row's next token

    @property
    def rows(self) -> int:
        return int(self.mask.shape[0])

    @property
    def columns(self) -> int:
        return int(self.mask.shape[1])

    def merge(self, other: PaddedBatch, spare_columns: int) -> PaddedBatch:
        """One batch holding this batch's rows, then ``other``'s, with room for ``spare_columns`` more."""
        width = max(self.columns, other.columns)
        mine, theirs = _layers(self.cache), _layers(other.cache)
        if len(mine) != len(theirs):
            raise UnsupportedCacheError("the two caches have different numbers of layers")
        merged = roomy_cache(spare_columns)
        for index, (a, b) in enumerate(zip(mine, theirs)):
            keys = torch.cat(
                [_pad_left(a.keys, width - self.columns, -2), _pad_left(b.keys, width - other.columns, -2)]
            )
            values = torch.cat(
                [_pad_left(a.values, width - self.columns, -2), _pad_left(b.values, width - other.columns, -2)]
            )
            merged.update(keys, values, index)
        mask = torch.cat(
            [_pad_left(self.mask, width - self.columns, 1), _pad_left(other.mask, width - other.columns, 1)]
        )
        return PaddedBatch(merged, mask, torch.cat([self.positions, other.positions]))

    def select(self, keep: list[int], spare_columns: int) -> PaddedBatch:
        """Only rows ``keep`` (in that order), without the columns that are padding in all of them,
        with room for ``spare_columns`` more."""
        index = torch.tensor(keep, dtype=torch.long)
        mask = self.mask.index_select(0, index)
        real_columns = mask.any(dim=0).nonzero()
        start = int(real_columns[0]) if len(real_columns) else mask.shape[1]
        kept = roomy_cache(spare_columns)
        for number, layer in enumerate(_layers(self.cache)):
            kept.update(
                layer.keys.index_select(0, index)[..., start:, :],
                layer.values.index_select(0, index)[..., start:, :],
                number,
            )
        return PaddedBatch(kept, mask[:, start:].contiguous(), self.positions.index_select(0, index))

    def cache_bytes(self) -> int:
        return sum(layer.buffer_bytes() for layer in _layers(self.cache))


def left_pad(prompts: list[list[int]], pad_id: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``input_ids``, ``attention_mask`` and ``position_ids`` of prompts padded on the left."""
    width = max(len(p) for p in prompts)
    ids = torch.full((len(prompts), width), pad_id, dtype=torch.long)
    mask = torch.zeros((len(prompts), width), dtype=torch.long)
    for row, prompt in enumerate(prompts):
        ids[row, width - len(prompt) :] = torch.tensor(prompt, dtype=torch.long)
        mask[row, width - len(prompt) :] = 1
    positions = (mask.cumsum(-1) - 1).clamp(min=0)
    return ids, mask, positions
