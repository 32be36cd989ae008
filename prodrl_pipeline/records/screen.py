"""The data contract's rules over whole Arrow columns: which stored calls certainly keep them.

`sound_calls` applies every rule of `validate.call_problem` to a table of calls at numpy speed,
with no Python object per call or position. It is a screen, not a second judge: a call it passes
keeps every rule; a call it flags goes to `call_problem`, which names the first rule broken (or
finds none: a null anywhere, or a float within a margin of a rule's bound, is flagged, so a call
on an edge is looked at twice rather than passed unchecked).
"""

from __future__ import annotations

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from prodrl_pipeline.records import support
from prodrl_pipeline.records.ragged import Ragged, combined, nulls_within, offsets, ranges
from prodrl_pipeline.records.schema import GRAMMAR
from prodrl_pipeline.records.support import SupportColumns
from prodrl_pipeline.records.validate import HEAD_MASS_TOLERANCE

PER_POSITION = {  # the columns with one entry per completion position, and their list depth
    "completion_logprobs": 1,
    "support_size": 1,
    "topk_token_ids": 2,
    "topk_logprobs": 2,
    "support_token_ids": 2,
}
NEWER = ("support_form", "support_mask")  # per position, null for a whole call recorded before them
MARGIN = 1e-6  # the head's log-mass is flagged this much below call_problem's bound (its sum may
# round differently here); every other comparison is on the stored value itself, as call_problem's


def sound_calls(table: pa.Table) -> np.ndarray:
    """[calls] True where a call of `table` (rows of the `calls` table) keeps every contract rule."""
    sound = ~_call_problems(table)
    kept = np.flatnonzero(sound)
    if len(kept):
        sound[kept[_position_problems(table.take(kept))]] = False
    return sound


def _column(table: pa.Table, name: str) -> pa.Array:
    return combined(table.column(name))


def _numpy(values: pa.Array) -> np.ndarray:
    return values.to_numpy(zero_copy_only=False)


def _lengths(lists: pa.Array) -> np.ndarray:
    return _numpy(pc.fill_null(pc.list_value_length(lists), 0))


def _any_per(owner: np.ndarray, flags: np.ndarray, n: int) -> np.ndarray:
    """[n] True where any flag of that owner is set."""
    return np.bincount(owner[flags], minlength=n) > 0


def _call_problems(table: pa.Table) -> np.ndarray:
    """[calls] a null, an empty prompt or completion, a per-position column of the wrong length,
    an id outside the vocabulary, or sampling outside its ranges."""
    n = len(table)
    vocab_col = _column(table, "vocab_size")
    bad = _numpy(pc.is_null(vocab_col)) | _numpy(pc.is_null(_column(table, "call_id")))
    vocab = np.nan_to_num(_numpy(vocab_col).astype(np.float64))
    per_call = _lengths(_column(table, "completion_token_ids"))
    for name in ("prompt_token_ids", "completion_token_ids"):
        bad |= nulls_within(_column(table, name), 1)
    for name, depth in PER_POSITION.items():
        lists = _column(table, name)
        bad |= nulls_within(lists, depth) | (_lengths(lists) != per_call)
    extra = _column(table, "extra_token_ids")
    bad |= nulls_within(extra, 2, outer=False) | ((_lengths(extra) != 0) & (_lengths(extra) != per_call))
    for name in NEWER:
        lists = _column(table, name)
        given = ~_numpy(pc.is_null(lists))
        bad |= nulls_within(lists, 1, outer=False) | (given & (_lengths(lists) != per_call))
    bad |= (per_call == 0) | (_lengths(_column(table, "prompt_token_ids")) == 0)
    if "grammar" in table.column_names:  # a grammar record given is given whole
        grammar = _column(table, "grammar")
        given = ~_numpy(pc.is_null(grammar))
        for name in GRAMMAR.names:
            bad |= given & _numpy(pc.is_null(pc.struct_field(grammar, name)))
    for name in ("prompt_token_ids", "completion_token_ids"):
        ids = Ragged.of(_column(table, name), np.float64)
        owner = np.repeat(np.arange(n), ids.lengths)
        bad |= _any_per(owner, (ids.values < 0) | (ids.values >= vocab[owner]), n)
    return bad | _sampling_problems(_column(table, "sampling"), vocab)


def _has_grammar(table: pa.Table) -> np.ndarray:
    """[calls] whether a call recorded a grammar (a table from before the column: none did)."""
    if "grammar" not in table.column_names:
        return np.zeros(len(table), dtype=bool)
    return ~_numpy(pc.is_null(_column(table, "grammar")))


def _sampling_problems(sampling: pa.StructArray, vocab: np.ndarray) -> np.ndarray:
    def field(values: pa.Array, name: str) -> np.ndarray:
        return _numpy(pc.struct_field(values, name)).astype(np.float64)  # null: nan

    temperature, top_p, top_k = (field(sampling, k) for k in ("temperature", "top_p", "top_k"))
    bad = _numpy(pc.is_null(sampling)) | ~(np.isfinite(temperature) & (temperature > 0))
    given = {k: ~_numpy(pc.is_null(pc.struct_field(sampling, k))) for k in ("top_p", "top_k")}  # NaN is given
    bad |= given["top_p"] & ~((top_p > 0) & (top_p <= 1))
    bad |= given["top_k"] & ~(top_k >= 0)
    entries = pc.struct_field(sampling, "logit_bias")
    owner = np.repeat(np.arange(len(vocab)), _lengths(entries))
    flat = pc.list_flatten(entries)
    token, bias = field(flat, "token_id"), field(flat, "bias")
    wrong = _numpy(pc.is_null(flat)) | np.isnan(token) | np.isnan(bias)
    wrong |= (token < 0) | (token >= vocab[owner]) | (bias < -100) | (bias > 100)
    return bad | _any_per(owner, wrong, len(vocab))


def _position_problems(table: pa.Table) -> np.ndarray:
    """[calls] a position that breaks a rule, for calls with no null and aligned columns."""
    n = len(table)
    per_call = _lengths(_column(table, "completion_token_ids"))
    owner = np.repeat(np.arange(n), per_call)  # [positions]
    vocab = _numpy(_column(table, "vocab_size")).astype(np.int64)[owner]
    token = _numpy(pc.list_flatten(_column(table, "completion_token_ids"))).astype(np.int64)
    lp = _numpy(pc.list_flatten(_column(table, "completion_logprobs"))).astype(np.float64)

    def per_position(name: str, dtype: type) -> Ragged:
        return Ragged.of(pc.list_flatten(_column(table, name)), dtype)

    head, head_lp = per_position("topk_token_ids", np.int64), per_position("topk_logprobs", np.float64)
    kept = SupportColumns.of({name: _column(table, name) for name in support.COLUMNS}, head, vocab)
    extra = _extras(_column(table, "extra_token_ids"), per_call)
    k, size = head.lengths, kept.size
    with np.errstate(invalid="ignore", over="ignore"):
        bad = ~np.isfinite(lp) | (lp > 0)
        bad |= (k == 0) | (k != head_lp.lengths) | (size < k) | (size > vocab)
        bad |= kept.problems(head, vocab)
        bad |= (kept.form == support.Form.GRAMMAR) & ~_has_grammar(table)[owner]
        for ids in (head, extra):
            at = np.repeat(np.arange(len(k)), ids.lengths)
            bad |= _any_per(at, (ids.values < 0) | (ids.values >= vocab[at]), len(k))
        bad |= _repeated(head, vocab)
        at = np.repeat(np.arange(len(k)), head_lp.lengths)
        bad |= _any_per(at, ~np.isfinite(head_lp.values) | (head_lp.values > HEAD_MASS_TOLERANCE), len(k))
        bad |= _head_mass(head_lp) > HEAD_MASS_TOLERANCE - MARGIN
    bad |= _outside_support(token, kept, head, extra, vocab)
    calls_bad = _any_per(owner, bad, n)
    # the extra samples: one count for every position of a call
    widths = extra.lengths
    low, high = np.full(n, np.inf), np.full(n, -np.inf)
    np.minimum.at(low, owner, widths)
    np.maximum.at(high, owner, widths)
    return calls_bad | ((per_call > 0) & (low != high))


def _extras(lists: pa.Array, per_call: np.ndarray) -> Ragged:
    """The extra samples per position; a call that recorded none has none at each position."""
    given = _lengths(lists) > 0
    inner = Ragged.of(pc.list_flatten(lists), np.int64)
    lengths = np.zeros(int(per_call.sum()), dtype=np.int64)
    lengths[ranges(offsets(per_call)[:-1][given], per_call[given])] = inner.lengths
    return Ragged(inner.values, offsets(lengths))


def _keyed(ids: Ragged, vocab: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(key, position) of each id inside [0, its position's vocabulary), key = position * stride +
    id: unique per (position, id). An id outside is flagged by the range rule; keyed, it could
    name another position's id."""
    at = np.repeat(np.arange(len(ids.lengths)), ids.lengths)
    inside = (ids.values >= 0) & (ids.values < vocab[at])
    return at[inside] * (int(vocab.max(initial=0)) + 1) + ids.values[inside], at[inside]


def _repeated(ids: Ragged, vocab: np.ndarray) -> np.ndarray:
    """[positions] an id that appears twice in the position's list."""
    keys, at = _keyed(ids, vocab)
    order = np.argsort(keys, kind="stable")
    twice = keys[order][1:] == keys[order][:-1]
    out = np.zeros(len(ids.lengths), dtype=bool)
    out[at[order][1:][twice]] = True
    return out


def _head_mass(head_lp: Ragged) -> np.ndarray:
    """[positions] log of the head's total probability (-inf for an empty head)."""
    out = np.full(len(head_lp.lengths), -np.inf)
    filled = np.flatnonzero(head_lp.lengths > 0)
    if len(filled):
        starts = head_lp.offsets[filled]
        top = np.maximum.reduceat(head_lp.values, starts)
        at = np.repeat(np.arange(len(filled)), head_lp.lengths[filled])
        out[filled] = top + np.log(np.add.reduceat(np.exp(head_lp.values - top[at]), starts))
    return out


def _outside_support(
    token: np.ndarray, kept: SupportColumns, head: Ragged, extra: Ragged, vocab: np.ndarray
) -> np.ndarray:
    """[positions] positions whose sampled id, extra samples or head ids are not all in the kept
    support."""
    n = len(token)
    out = np.zeros(n, dtype=bool)
    for ids in (Ragged(token, np.arange(n + 1)), extra, head):
        at = np.repeat(np.arange(n), ids.lengths)
        out |= _any_per(at, ~kept.contains(at, ids.values, head, vocab), n)
    return out
