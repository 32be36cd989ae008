"""The kept support of mu at a completion position: how it is recorded and read back (docs/tables.md).

A position records its support's size (`support_size`) and a form tag (`support_form`, a small
enum) naming where the set is, in whichever exact form is smallest:
- VOCABULARY: the whole vocabulary (unrestricted), nothing more;
- HEAD: the recorded top-K head is the support (`support_size` = len(head)), nothing more;
- IDS: `support_token_ids` lists the kept ids, ascending (4 bytes an id);
- COMPLEMENT: `support_token_ids` lists the ids *not* kept, ascending (4 bytes an id);
- BITMASK: `support_mask` holds ceil(V / 8) bytes, bit v % 8 (least significant first) of byte
  v // 8 set iff v is kept, the bits past V zero (the layout of numpy's little-endian `packbits`,
  Arrow's validity bitmaps and llguidance's token masks);
- GRAMMAR: the whole mask of the call's recorded grammar (its `grammar` column), larger than the
  head and smaller than the vocabulary, nothing more: the trainer's reader recomputes it
  (records/grammar_masks.py) and reads it as that BITMASK. The validator and the screen check its
  shape only; whether the sampled ids lie in it is the replay's check, which refuses the call.
The payload is at most ceil(V / 8) bytes. The tag is an extensible int8 enum, and a reader refuses
a value it does not know. A call recorded before the tag existed (its `support_form` null, the older schema)
is read as it was meant: the whole vocabulary, the head, else the listed ids in any order.

Every writer (engine/rows.py, engine/vllm.py, the gateway, the rollout, retokenization) builds a
position's record with `encode`/`from_ids` and a row's columns with `columns`; every reader decodes
through `of_call` (a dict record) or `SupportColumns` (Arrow columns, vectorised).
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from dataclasses import dataclass
from enum import IntEnum
from typing import NamedTuple

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from prodrl_pipeline.records.ragged import Ragged, offsets, ranges


class Form(IntEnum):
    VOCABULARY = 0
    HEAD = 1
    IDS = 2
    COMPLEMENT = 3
    BITMASK = 4
    GRAMMAR = 5


COLUMNS = ("support_size", "support_form", "support_token_ids", "support_mask")
"""The calls columns a position's support is recorded in."""
ID_BYTES = 4  # an int32 id
LEGACY = -1  # the form of a position recorded before the tag existed, until it is derived
NO_IDS = np.empty(0, dtype=np.int64)
NO_IDS.flags.writeable = False


class Support(NamedTuple):
    """One position's record: its size, form and the form's payload (ids, or a mask's bytes)."""

    size: int
    form: int
    ids: np.ndarray | Sequence[int] = NO_IDS
    mask: bytes = b""


def mask_bytes(vocab: int) -> int:
    return (vocab + 7) // 8


def payload_bytes(form: int, size: int, vocab: int) -> int:
    """The bytes a support of `size` ids takes in `form` (the tag and size aside)."""
    if form == Form.IDS:
        return ID_BYTES * size
    if form == Form.COMPLEMENT:
        return ID_BYTES * (vocab - size)
    return mask_bytes(vocab) if form == Form.BITMASK else 0


def form_for(size: int, head: int, vocab: int) -> Form:
    """The smallest exact form of a support of `size` ids beside a head of `head` ids (ties: the
    earlier form)."""
    if size >= vocab:
        return Form.VOCABULARY
    if size <= head:
        return Form.HEAD
    return min((Form.IDS, Form.COMPLEMENT, Form.BITMASK), key=lambda f: payload_bytes(f, size, vocab))


@functools.cache
def unrestricted(vocab: int) -> Support:
    return Support(vocab, Form.VOCABULARY)


def encode(kept: np.ndarray, head: int, form: Form | None = None) -> Support:
    """The record of the support `kept` ([V] bool) beside a head of `head` ids, in its smallest
    form (or in `form`, which must be exact: HEAD needs the head to hold the support)."""
    vocab, size = len(kept), int(np.count_nonzero(kept))
    form = form_for(size, head, vocab) if form is None else form
    if form == Form.IDS:
        return Support(size, form, np.flatnonzero(kept))
    if form == Form.COMPLEMENT:
        return Support(size, form, np.flatnonzero(~kept))
    if form == Form.BITMASK:
        return Support(size, form, NO_IDS, np.packbits(kept, bitorder="little").tobytes())
    return unrestricted(vocab) if form == Form.VOCABULARY else Support(size, form)


def encode_rows(kept: np.ndarray, heads: Sequence[int]) -> list[Support]:
    """`encode` of each row of `kept` [N, V] bool; the bitmasks packed in one call."""
    vocab = kept.shape[1]
    sizes = np.count_nonzero(kept, axis=1).tolist()
    forms = [form_for(s, h, vocab) for s, h in zip(sizes, heads, strict=True)]
    masked = [i for i, f in enumerate(forms) if f == Form.BITMASK]
    packed = dict(zip(masked, np.packbits(kept[masked], axis=1, bitorder="little"), strict=True))
    out = []
    for i, (size, form) in enumerate(zip(sizes, forms, strict=True)):
        if form == Form.BITMASK:
            out.append(Support(size, form, NO_IDS, packed[i].tobytes()))
        elif form in (Form.IDS, Form.COMPLEMENT):
            out.append(Support(size, form, np.flatnonzero(kept[i] if form == Form.IDS else ~kept[i])))
        else:
            out.append(unrestricted(vocab) if form == Form.VOCABULARY else Support(size, form))
    return out


def from_ids(ids: Sequence[int] | np.ndarray | None, head: int, vocab: int) -> Support:
    """The record of the support listing `ids` (None: the whole vocabulary)."""
    if ids is None:
        return unrestricted(vocab)
    kept = np.zeros(vocab, dtype=bool)
    kept[np.asarray(ids, dtype=np.int64)] = True
    return encode(kept, head)


def columns(supports: Sequence[Support]) -> dict[str, list]:
    """A call row's support columns from its positions' records."""
    return {
        "support_size": [s.size for s in supports],
        "support_form": [int(s.form) for s in supports],
        "support_token_ids": [s.ids for s in supports],
        "support_mask": [s.mask for s in supports],
    }


def of_call(call: dict) -> list[Support]:
    """A dict record's supports; a call from before the form tag (none given) read as it was meant."""
    sizes, ids = call["support_size"], call["support_token_ids"]
    forms, masks = call.get("support_form"), call.get("support_mask")
    if forms is None:
        heads, vocab = call["topk_token_ids"], call["vocab_size"]
        return [_legacy(s, len(h), vocab, i) for s, h, i in zip(sizes, heads, ids, strict=True)]
    masks = [b""] * len(sizes) if masks is None else masks
    return [Support(*fields) for fields in zip(sizes, forms, ids, masks, strict=True)]


def _legacy(size: int, head: int, vocab: int, ids: Sequence[int]) -> Support:
    """An older record's position: the ids were listed (in any order) only when larger than the
    head and smaller than the vocabulary, and read only then."""
    if size >= vocab:
        return Support(size, Form.VOCABULARY)
    if size <= head:
        return Support(size, Form.HEAD)
    return Support(size, Form.IDS, np.sort(np.asarray(ids, dtype=np.int64)))


def problem(s: Support, head: Sequence[int] | np.ndarray, vocab: int) -> str | None:
    """The first rule a position's record breaks, or None: the form is known, its payload is the
    one it needs (ids in [0, V), strictly ascending; a mask of ceil(V / 8) bytes, nothing past V)
    and it holds exactly `size` kept ids. `size` itself is bounded by the caller."""
    form, size, ids = s.form, s.size, np.asarray(s.ids, dtype=np.int64)
    if form not in Form._value2member_map_:
        return f"support form {form} is not one this reader knows ({', '.join(f.name for f in Form)})"
    if (len(ids) and form not in (Form.IDS, Form.COMPLEMENT)) or (len(s.mask) and form != Form.BITMASK):
        return f"a {Form(form).name} support carries a payload of another form"
    if form == Form.VOCABULARY and size != vocab:
        return f"a VOCABULARY support of size {size} in a vocabulary of {vocab}"
    if form == Form.HEAD and size != len(head):
        return f"a HEAD support of size {size} beside a head of {len(head)}"
    if form == Form.GRAMMAR and not len(head) < size < vocab:
        return f"a GRAMMAR support of size {size} beside a head of {len(head)} in a vocabulary of {vocab}"
    if form in (Form.IDS, Form.COMPLEMENT):
        want = size if form == Form.IDS else vocab - size
        if len(ids) != want:
            return f"restricted support of {size} tokens is not recorded ({Form(form).name}: {len(ids)} ids)"
        if len(ids) and (ids.min() < 0 or ids.max() >= vocab):
            return f"a support id is outside [0, {vocab})"
        steps = np.diff(ids)
        if (steps == 0).any():
            return "repeated ids in the support"
        if (steps < 0).any():
            return "support ids are not in ascending order"
    if form == Form.BITMASK:
        if len(s.mask) != mask_bytes(vocab):
            return f"support bitmask of {len(s.mask)} bytes, not {mask_bytes(vocab)} (V = {vocab})"
        bits = np.unpackbits(np.frombuffer(s.mask, dtype=np.uint8), bitorder="little")
        if bits[vocab:].any():
            return "support bitmask sets bits past the vocabulary"
        if (kept := int(bits.sum())) != size:
            return f"support bitmask keeps {kept} ids, not support_size {size}"
    return None


def contains(
    s: Support, query: Sequence[int] | np.ndarray, head: Sequence[int] | np.ndarray, vocab: int
) -> np.ndarray:
    """[Q] whether each id of `query` is kept, of a record `problem` passes (an id outside [0, V)
    is not; in a GRAMMAR support every id inside is, until the replay judges it)."""
    query = np.asarray(query, dtype=np.int64)
    inside = (query >= 0) & (query < vocab)
    if s.form in (Form.VOCABULARY, Form.GRAMMAR):
        return inside
    if s.form == Form.BITMASK:
        mask = np.frombuffer(s.mask, dtype=np.uint8)
        at = np.where(inside, query, 0)
        return inside & ((mask[at // 8] >> (at % 8).astype(np.uint8)) & 1 == 1)
    listed = np.isin(query, np.asarray(head if s.form == Form.HEAD else s.ids, dtype=np.int64))
    return inside & (~listed if s.form == Form.COMPLEMENT else listed)


def kept_ids(s: Support, head: Sequence[int] | np.ndarray, vocab: int) -> np.ndarray | None:
    """The kept ids, ascending (the head's in its order), or None for the whole vocabulary; of a
    record `problem` passes."""
    if s.form == Form.VOCABULARY:
        return None
    if s.form == Form.HEAD:
        return np.asarray(head, dtype=np.int64)
    if s.form == Form.IDS:
        return np.asarray(s.ids, dtype=np.int64)
    if s.form == Form.COMPLEMENT:
        keep = np.ones(vocab, dtype=bool)
        keep[np.asarray(s.ids, dtype=np.int64)] = False
        return np.flatnonzero(keep)
    if s.form == Form.GRAMMAR:
        raise ValueError("a GRAMMAR support is read as its recomputed mask (records/grammar_masks.py)")
    return np.flatnonzero(np.unpackbits(np.frombuffer(s.mask, dtype=np.uint8), bitorder="little")[:vocab])


@dataclass(frozen=True)
class SupportColumns:
    """Every position's support record of a table of calls, flat: `size`, `form` [positions] and,
    ragged, the ids and the mask bytes; older calls' positions already derived (`of_call`)."""

    size: np.ndarray  # [P] int64
    form: np.ndarray  # [P] int64
    ids: Ragged  # int64
    mask: Ragged  # uint8

    @classmethod
    def of(cls, col: dict[str, pa.Array], head: Ragged, vocab: np.ndarray) -> SupportColumns:
        """From the calls' columns (one array a column, a call an entry; lists aligned with the
        completion, checked by the caller), their positions' heads and vocabularies [P]."""
        size = _flat(col["support_size"], np.int64)
        ids = Ragged.of(pc.list_flatten(col["support_token_ids"]), np.int64)
        per_call = pc.fill_null(pc.list_value_length(col["support_size"]), 0).to_numpy(zero_copy_only=False)
        forms, masks = col.get("support_form"), col.get("support_mask")
        legacy = np.ones(len(per_call), dtype=bool) if forms is None else _null(forms)
        form = np.full(len(size), LEGACY, dtype=np.int64)
        if forms is not None:
            form[~np.repeat(legacy, per_call)] = _flat(forms.filter(pa.array(~legacy)), np.int64)
        given = np.zeros(len(per_call), dtype=bool) if masks is None else ~_null(masks)
        mask = _byte_lists(pc.list_flatten(masks.filter(pa.array(given))) if given.any() else None)
        lengths = np.zeros(len(size), dtype=np.int64)
        lengths[ranges(offsets(per_call)[:-1][given], per_call[given])] = mask.lengths
        mask = Ragged(mask.values, offsets(lengths))
        if (old := form == LEGACY).any():
            form, ids = _derived(old, size, form, ids, head.lengths, vocab)
        return cls(size, form, ids, mask)

    def take(self, positions: np.ndarray) -> SupportColumns:
        return SupportColumns(
            self.size[positions], self.form[positions], self.ids.take(positions), self.mask.take(positions)
        )

    def problems(self, head: Ragged, vocab: np.ndarray) -> np.ndarray:
        """[P] positions breaking a rule of `problem` (the same rules, over whole columns)."""
        form, size, ids, n = self.form, self.size, self.ids, len(self.size)
        listed = (form == Form.IDS) | (form == Form.COMPLEMENT)
        bad = ~np.isin(form, list(Form))
        bad |= ((ids.lengths > 0) & ~listed) | ((self.mask.lengths > 0) & (form != Form.BITMASK))
        bad |= (form == Form.VOCABULARY) & (size != vocab)
        bad |= (form == Form.HEAD) & (size != head.lengths)
        bad |= (form == Form.GRAMMAR) & ((size <= head.lengths) | (size >= vocab))
        bad |= (form == Form.IDS) & (ids.lengths != size)
        bad |= (form == Form.COMPLEMENT) & (ids.lengths != vocab - size)
        at = np.repeat(np.arange(n), ids.lengths)
        bad |= np.bincount(at[(ids.values < 0) | (ids.values >= vocab[at])], minlength=n) > 0
        later = np.ones(len(ids.values), dtype=bool)  # an entry that is not its list's first
        later[ids.offsets[:-1][ids.lengths > 0]] = False
        falling = later & np.concatenate([[False], ids.values[1:] <= ids.values[:-1]])
        bad |= np.bincount(at[falling], minlength=n) > 0
        width = (vocab + 7) // 8
        bad |= (form == Form.BITMASK) & (self.mask.lengths != width)
        whole = (form == Form.BITMASK) & (self.mask.lengths == width)
        byte_at = np.repeat(np.arange(n), self.mask.lengths)
        picked = whole[byte_at]
        owner, values = byte_at[picked], self.mask.values[picked]
        last = np.flatnonzero(picked) - self.mask.offsets[owner] == width[owner] - 1
        spare = (vocab[owner] % 8).astype(np.uint8)  # the last byte's bits past V must be zero
        bad |= np.bincount(owner[last & (spare > 0) & ((values >> spare) != 0)], minlength=n) > 0
        bad |= whole & (np.bincount(owner, weights=_POPCOUNT[values], minlength=n) != size)
        return bad

    def contains(self, at: np.ndarray, query: np.ndarray, head: Ragged, vocab: np.ndarray) -> np.ndarray:
        """[Q] whether id `query[q]` is in the kept support of position `at[q]` (of records that
        pass `problems`; an id outside [0, V) is not; in a GRAMMAR support every id inside is,
        until the replay judges it)."""
        form = self.form[at]
        inside = (query >= 0) & (query < vocab[at])
        out = inside & ((form == Form.VOCABULARY) | (form == Form.GRAMMAR))
        stride = int(vocab.max(initial=0)) + 1  # (position, id) keys: unique per pair

        def keys(ids: Ragged, where: np.ndarray) -> np.ndarray:
            """Outside [0, V) an id is left out: keyed, it could name another position's id."""
            owner = np.repeat(np.arange(len(ids.lengths)), ids.lengths)
            picked = where[owner] & (ids.values >= 0) & (ids.values < vocab[owner])
            return owner[picked] * stride + ids.values[picked]

        query_keys = at * stride + query
        listed = np.isin(
            query_keys,
            np.concatenate([keys(head, self.form == Form.HEAD), keys(self.ids, self.form == Form.IDS)]),
        )
        out |= inside & ((form == Form.HEAD) | (form == Form.IDS)) & listed
        excluded = np.isin(query_keys, keys(self.ids, self.form == Form.COMPLEMENT))
        out |= inside & (form == Form.COMPLEMENT) & ~excluded
        bitmask = inside & (form == Form.BITMASK)
        byte = self.mask.offsets[at] + np.where(bitmask, query, 0) // 8
        held = bitmask & (byte < self.mask.offsets[at + 1])
        bits = np.zeros(len(at), dtype=np.uint8)
        bits[held] = (self.mask.values[byte[held]] >> (query[held] % 8).astype(np.uint8)) & 1
        return out | (held & (bits == 1))

    def kept_ids(self, t: int, head: Ragged, vocab: int) -> np.ndarray | None:
        """Position t's kept ids (`kept_ids` of its record)."""
        ids = self.ids.values[self.ids.offsets[t] : self.ids.offsets[t + 1]]
        mask = self.mask.values[self.mask.offsets[t] : self.mask.offsets[t + 1]].tobytes()
        heads = head.values[head.offsets[t] : head.offsets[t + 1]]
        return kept_ids(Support(int(self.size[t]), int(self.form[t]), ids, mask), heads, vocab)


_POPCOUNT = np.unpackbits(np.arange(256, dtype=np.uint8)[:, None], axis=1).sum(1)  # set bits per byte


def _null(values: pa.Array) -> np.ndarray:
    return pc.is_null(values).to_numpy(zero_copy_only=False)


def _flat(lists: pa.Array, dtype: type) -> np.ndarray:
    return np.asarray(pc.list_flatten(lists).to_numpy(zero_copy_only=False), dtype=dtype)


def _byte_lists(values: pa.Array | None) -> Ragged:
    """A binary array's entries as lists of bytes (uint8); a null entry is an empty one."""
    if values is None or not len(values):
        return Ragged(np.zeros(0, dtype=np.uint8), np.zeros(1, dtype=np.int64))
    values = values.cast(pa.large_binary())
    lengths = pc.fill_null(pc.binary_length(values), 0).to_numpy(zero_copy_only=False).astype(np.int64)
    _, starts_buffer, data = values.buffers()
    starts = np.frombuffer(starts_buffer, dtype=np.int64)[values.offset : values.offset + len(values)]
    data = np.frombuffer(data, dtype=np.uint8) if data is not None else np.zeros(0, dtype=np.uint8)
    return Ragged(data[ranges(starts, lengths)], offsets(lengths))


def _derived(
    old: np.ndarray, size: np.ndarray, form: np.ndarray, ids: Ragged, head: np.ndarray, vocab: np.ndarray
) -> tuple[np.ndarray, Ragged]:
    """Older positions (`old`) read as `_legacy` reads one: their form derived, their listed ids
    sorted where they are the support and dropped where they were never read."""
    form = form.copy()
    form[old] = np.where(size >= vocab, Form.VOCABULARY, np.where(size <= head, Form.HEAD, Form.IDS))[old]
    at = np.repeat(np.arange(len(size)), ids.lengths)
    keep = ~old[at] | (form[at] == Form.IDS)
    order = np.lexsort((np.where(old[at], ids.values, np.arange(len(at))), at))  # older lists sorted
    kept = order[keep[order]]
    return form, Ragged(ids.values[kept], offsets(np.bincount(at[kept], minlength=len(size))))
