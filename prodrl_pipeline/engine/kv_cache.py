"""A KV cache that is preallocated and grows by doubling (instead of `DynamicCache`'s per-step concat).

Each layer keeps keys and values in a buffer [N, H, capacity, D]; `keys`/`values` are the views
[:, :, :length]. A decode step writes its token's keys into the buffer in place: copying the whole
cache every step (a concatenation per layer per step) costs O(length) and was 7-12% of decoding.
When a write does not fit, the buffer is reallocated at twice the needed length, so a completion of
T tokens copies its cache O(log T) times.
"""

from __future__ import annotations

import torch
from transformers.cache_utils import Cache, DynamicLayer


class GrowingLayer(DynamicLayer):
    """One layer's keys and values in a preallocated buffer; assigning `keys`/`values` replaces it."""

    def __init__(self) -> None:
        self._k: torch.Tensor | None = None
        self._v: torch.Tensor | None = None
        self.length = 0
        super().__init__()

    @property
    def keys(self) -> torch.Tensor | None:
        return None if self._k is None else self._k[:, :, : self.length]

    @keys.setter
    def keys(self, value: None) -> None:  # DynamicLayer's reset; anything else goes through update
        _refuse_tensor(value)
        self._k, self.length = value, 0

    @property
    def values(self) -> torch.Tensor | None:
        return None if self._v is None else self._v[:, :, : self.length]

    @values.setter
    def values(self, value: None) -> None:
        _refuse_tensor(value)
        self._v = value

    def update(
        self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs
    ) -> tuple[torch.Tensor, torch.Tensor]:
        if not self.is_initialized or self._k is None or self._k.dim() < 3:
            self.device, self.is_initialized = key_states.device, True
            self._k, self._v, self.length = key_states, value_states, key_states.shape[2]
            return self.keys, self.values
        end = self.length + key_states.shape[2]
        if end > self._k.shape[2]:
            self._k, self._v = _grown(self.keys, 2 * end), _grown(self.values, 2 * end)
        self._k[:, :, self.length : end] = key_states
        self._v[:, :, self.length : end] = value_states
        self.length = end
        return self.keys, self.values

    def get_seq_length(self) -> int:
        return self.length if self.is_initialized else 0

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        if self.length:
            self._k, self._v = self._k[indices], self._v[indices]

    def stack_below(self, other: GrowingLayer, length: int) -> None:
        """Append `other`'s rows to this layer's batch, both left-padded to `length` positions."""
        self._k = torch.cat([left_pad(self.keys, length, dim=2), left_pad(other.keys, length, dim=2)])
        self._v = torch.cat([left_pad(self.values, length, dim=2), left_pad(other.values, length, dim=2)])
        self.length = length

    def cut_left(self, start: int) -> None:
        """Drop the first `start` positions (columns no row attends to any more)."""
        self._k, self._v = self._k[:, :, start:], self._v[:, :, start:]  # keeps the spare capacity
        self.length -= start


def _refuse_tensor(value: object) -> None:
    """An inherited method assigning a tensor (crop, reorder, offload) would lose the length."""
    if value is not None:
        raise TypeError("a GrowingLayer is written through update, stack_below and cut_left only")


def growing_cache() -> Cache:
    """An empty cache whose layers are `GrowingLayer`s (created as the model first writes them)."""
    return Cache(layer_class_to_replicate=GrowingLayer)


def stacked(caches: list[Cache], length: int, rows: torch.Tensor) -> Cache:
    """One cache of every row of `caches` (each left-padded to `length` positions), taken in the
    order `rows` indexes the stacked rows."""
    out = growing_cache()
    for parts in zip(*(c.layers for c in caches), strict=True):
        layer = GrowingLayer()
        keys = torch.cat([left_pad(p.keys, length, dim=2) for p in parts])[rows]
        values = torch.cat([left_pad(p.values, length, dim=2) for p in parts])[rows]
        layer.update(keys, values)
        out.layers.append(layer)
    return out


def _grown(x: torch.Tensor, capacity: int) -> torch.Tensor:
    out = x.new_empty((x.shape[0], x.shape[1], capacity, x.shape[3]))
    out[:, :, : x.shape[2]] = x
    return out


def left_pad(x: torch.Tensor, length: int, dim: int = 1) -> torch.Tensor:
    """`x` with zeros prepended along `dim` up to `length` entries."""
    short = length - x.shape[dim]
    if short == 0:
        return x
    shape = list(x.shape)
    shape[dim] = short
    return torch.cat([x.new_zeros(shape), x], dim=dim)
