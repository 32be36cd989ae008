"""Lists of numbers held flat: one values array and offsets, read from an Arrow list column once
(for work over every entry of a column at numpy speed, with no Python object per entry)."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc


@dataclass(frozen=True)
class Ragged:
    """Lists of numbers as one flat array: list i is values[offsets[i] : offsets[i + 1]]."""

    values: np.ndarray
    offsets: np.ndarray  # int64, one more than there are lists; offsets[0] = 0

    @classmethod
    def of(cls, lists: pa.Array, dtype: type) -> Ragged:
        """From an Arrow list array (a null list is an empty one)."""
        lengths = pc.fill_null(pc.list_value_length(lists), 0).to_numpy(zero_copy_only=False)
        values = np.array(pc.list_flatten(lists).to_numpy(zero_copy_only=False), dtype=dtype)  # writable
        return cls(values, offsets(lengths))

    @property
    def lengths(self) -> np.ndarray:
        return np.diff(self.offsets)

    def take(self, lists: np.ndarray) -> Ragged:
        """The lists at these indices, in this order."""
        lengths = self.lengths[lists]
        return Ragged(self.values[ranges(self.offsets[lists], lengths)], offsets(lengths))

    def padded(self, pad: float) -> tuple[np.ndarray, np.ndarray]:
        """[lists, longest] right-padded with `pad`, and the mask of real entries."""
        lengths = self.lengths
        mask = np.arange(lengths.max(initial=0)) < lengths[:, None]
        out = np.full(mask.shape, pad, dtype=self.values.dtype)
        out[mask] = self.values
        return out, mask


def offsets(lengths: np.ndarray) -> np.ndarray:
    """[0, l0, l0 + l1, ...]: where each list starts, and the end."""
    out = np.zeros(len(lengths) + 1, dtype=np.int64)
    np.cumsum(lengths, out=out[1:])
    return out


def ranges(starts: np.ndarray, lengths: np.ndarray) -> np.ndarray:
    """The concatenation of range(s, s + n) for each (s, n)."""
    total = int(lengths.sum())
    first = np.repeat(starts - offsets(lengths)[:-1], lengths)
    return first + np.arange(total, dtype=np.int64)


def _large(kind: pa.DataType) -> pa.DataType:
    """`kind` with every list's and binary's offsets 64-bit (a column of several chunks may hold
    more than 2^31 values or bytes in all, more than 32-bit offsets can address once combined)."""
    if pa.types.is_list(kind) or pa.types.is_large_list(kind):
        return pa.large_list(_large(kind.value_type))
    if pa.types.is_binary(kind):
        return pa.large_binary()
    if pa.types.is_struct(kind):
        fields = [kind.field(i) for i in range(kind.num_fields)]
        return pa.struct([f.with_type(_large(f.type)) for f in fields])
    return kind


def combined(column: pa.ChunkedArray) -> pa.Array:
    """A table's column as one array, its lists with 64-bit offsets."""
    return column.cast(_large(column.type)).combine_chunks()


def nulls_within(lists: pa.Array, depth: int, outer: bool = True) -> np.ndarray:
    """Per entry of a `depth`-deep list array: is the list itself (when `outer`), or any list or
    value inside it, null."""
    n = len(lists)
    found = pc.is_null(lists).to_numpy(zero_copy_only=False).copy() if outer else np.zeros(n, dtype=bool)
    owner, arr = np.arange(n), lists
    for _ in range(depth):
        owner = np.repeat(owner, pc.fill_null(pc.list_value_length(arr), 0).to_numpy(zero_copy_only=False))
        arr = pc.list_flatten(arr)
        found |= np.bincount(owner[pc.is_null(arr).to_numpy(zero_copy_only=False)], minlength=n) > 0
    return found
