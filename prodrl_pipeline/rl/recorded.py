"""A round's recorded calls as columns: what the trainer reads of the `calls` table (docs/tables.md),
one flat array per column with offsets, taken from Arrow once.

The trainer selects and packs microbatches by slicing these arrays (`take`, then
logprobs.build_sequences), so no call becomes a Python dict between Delta and the tensors.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
from transformers import PreTrainedTokenizerBase

from prodrl_pipeline.records import support
from prodrl_pipeline.records.grammar_masks import GrammarMasks, resolved
from prodrl_pipeline.records.ragged import Ragged, combined, nulls_within, offsets, ranges
from prodrl_pipeline.records.schema import CALLS
from prodrl_pipeline.records.support import SupportColumns


@dataclass(frozen=True)
class RecordedCalls:
    """Per call: its ids, vocabulary, temperature and logit bias; per call, ragged: prompt and
    completion ids; per completion position (aligned with `completion.values`): log mu of the
    sampled id, the kept support's record (records/support.py) and, ragged, the top-K head (ids and
    log mu) and the extra samples. Built by `from_arrow`, which refuses a call whose per-position
    columns disagree in length (flattened, they would pair one position's head with another's
    token); calls pass records.validate before they are stored. A grammar-constrained call's
    GRAMMAR supports are recomputed from its recorded grammar and read as their BITMASK
    (records/grammar_masks.py), which needs the served tokenizer and refuses what it cannot replay."""

    call_id: list[str]
    trajectory_id: list[str]
    call_index: np.ndarray
    vocab_size: np.ndarray
    temperature: np.ndarray
    bias: list[tuple[list[int], list[float]] | None]
    prompt: Ragged
    completion: Ragged
    completion_logprobs: np.ndarray
    support: SupportColumns
    head_ids: Ragged
    head_logprobs: Ragged
    extra_ids: Ragged

    @classmethod
    def from_arrow(cls, table: pa.Table, tokenizer: PreTrainedTokenizerBase | None = None) -> RecordedCalls:
        """From rows of the `calls` table (any further columns are ignored); `tokenizer`: the one
        the calls were served with (a grammar-constrained call is refused without it)."""
        col = {name: combined(table.column(name)) for name in _READ if name in table.column_names}
        n = len(table)
        sampling = col["sampling"]
        temperature = pc.struct_field(sampling, "temperature")
        for name, values in [*((name, col[name]) for name in _REQUIRED), ("temperature", temperature)]:
            _refuse(table, _null(values), f"it has no {name}")
        for name, depth in _LISTS.items():  # a null inside a list would become a number below
            if name in col:
                nulls = nulls_within(col[name], depth, outer=name not in _WHOLLY_NULLABLE)
                _refuse(table, nulls, f"it has a null in {name}")
        completion = Ragged.of(col["completion_token_ids"], np.int64)
        per_call = completion.lengths
        for name in ("support_form", "support_mask"):
            if name in col:
                _refuse(table, ~_null(col[name]) & (_lengths(col[name]) != per_call))

        def per_position(name: str, dtype: type, optional: bool = False) -> Ragged:
            """A column with one list per completion position, as one list per position; an
            `optional` column may instead be empty for a whole call (its positions get none)."""
            lists = col[name]
            given = _lengths(lists)
            absent = (given == 0) & (per_call > 0) if optional else np.zeros(n, dtype=bool)
            _refuse(table, (given != per_call) & ~absent)
            inner = Ragged.of(pc.list_flatten(lists), dtype)
            if not absent.any():
                return inner
            lengths = np.zeros(int(per_call.sum()), dtype=np.int64)  # an absent call's positions: none
            lengths[ranges(completion.offsets[:-1][~absent], per_call[~absent])] = inner.lengths
            return Ragged(inner.values, offsets(lengths))

        flat = {}
        for name, dtype in (("completion_logprobs", np.float32), ("support_size", np.int64)):
            lists = Ragged.of(col[name], dtype)
            _refuse(table, lists.lengths != per_call)
            flat[name] = lists.values
        _refuse(table, _lengths(col["support_token_ids"]) != per_call)
        head_ids = per_position("topk_token_ids", np.int64)
        head_logprobs = per_position("topk_logprobs", np.float32)
        uneven = head_ids.lengths != head_logprobs.lengths  # per position: to its call
        _refuse(table, np.bincount(np.repeat(np.arange(n), per_call)[uneven], minlength=n) > 0)
        entries = pc.struct_field(sampling, "logit_bias")
        count = _lengths(entries)
        entry = pc.list_flatten(entries)
        token, value = pc.struct_field(entry, "token_id"), pc.struct_field(entry, "bias")
        missing = _null(entry) | _null(token) | _null(value)
        _refuse(
            table,
            np.bincount(np.repeat(np.arange(n), count)[missing], minlength=n) > 0,
            "it has a null logit_bias entry",
        )
        at, token_ids, biases = offsets(count), token.to_pylist(), value.to_pylist()
        bias = [
            (token_ids[at[i] : at[i + 1]], biases[at[i] : at[i + 1]]) if count[i] else None for i in range(n)
        ]
        call_id = col["call_id"].to_pylist()
        vocab = col["vocab_size"].to_numpy(zero_copy_only=False).astype(np.int64)
        kept = SupportColumns.of(
            {name: col[name] for name in support.COLUMNS if name in col}, head_ids, np.repeat(vocab, per_call)
        )
        extra_ids = per_position("extra_token_ids", np.int64, optional=True)
        grammars = col["grammar"].to_pylist() if "grammar" in col else [None] * n
        if any(g is not None for g in grammars) or (kept.form == support.Form.GRAMMAR).any():
            samples = (head_ids, extra_ids)
            kept = resolved(kept, call_id, grammars, completion, vocab, samples, GrammarMasks(tokenizer))
        return cls(
            call_id=call_id,
            trajectory_id=col["trajectory_id"].to_pylist(),
            call_index=np.array(col["call_index"].to_numpy(zero_copy_only=False), dtype=np.int64),
            vocab_size=vocab,
            temperature=temperature.to_numpy(zero_copy_only=False).astype(np.float32),
            bias=bias,
            prompt=Ragged.of(col["prompt_token_ids"], np.int64),
            completion=completion,
            completion_logprobs=flat["completion_logprobs"],
            support=kept,
            head_ids=head_ids,
            head_logprobs=head_logprobs,
            extra_ids=extra_ids,
        )

    @classmethod
    def from_rows(
        cls, rows: Sequence[dict], tokenizer: PreTrainedTokenizerBase | None = None
    ) -> RecordedCalls:
        """From calls as dicts (e.g. straight from a rollout, or retokenized)."""
        return cls.from_arrow(pa.Table.from_pylist(list(rows), schema=CALLS), tokenizer)

    def __len__(self) -> int:
        return len(self.call_id)

    @property
    def lengths(self) -> np.ndarray:
        """Prompt plus completion tokens of each call."""
        return self.prompt.lengths + self.completion.lengths

    def take(self, calls: Sequence[int] | np.ndarray) -> RecordedCalls:
        """These calls, in this order."""
        rows = np.asarray(calls, dtype=np.int64)
        positions = ranges(self.completion.offsets[:-1][rows], self.completion.lengths[rows])
        return RecordedCalls(
            call_id=[self.call_id[i] for i in rows],
            trajectory_id=[self.trajectory_id[i] for i in rows],
            call_index=self.call_index[rows],
            vocab_size=self.vocab_size[rows],
            temperature=self.temperature[rows],
            bias=[self.bias[i] for i in rows],
            prompt=self.prompt.take(rows),
            completion=self.completion.take(rows),
            completion_logprobs=self.completion_logprobs[positions],
            support=self.support.take(positions),
            head_ids=self.head_ids.take(positions),
            head_logprobs=self.head_logprobs.take(positions),
            extra_ids=self.extra_ids.take(positions),
        )


_READ = (
    "call_id",
    "trajectory_id",
    "call_index",
    "vocab_size",
    "sampling",
    "prompt_token_ids",
    "completion_token_ids",
    "completion_logprobs",
    "support_size",
    "support_form",
    "topk_token_ids",
    "topk_logprobs",
    "support_token_ids",
    "support_mask",
    "extra_token_ids",
    "grammar",
)
_REQUIRED = (
    "call_id",
    "trajectory_id",
    "call_index",
    "vocab_size",
    "prompt_token_ids",
    "completion_token_ids",
)
_LISTS = {  # the list columns read, and how deep their lists go
    "prompt_token_ids": 1,
    "completion_token_ids": 1,
    "completion_logprobs": 1,
    "support_size": 1,
    "support_form": 1,
    "topk_token_ids": 2,
    "topk_logprobs": 2,
    "support_token_ids": 2,
    "support_mask": 1,
    "extra_token_ids": 2,
}
_WHOLLY_NULLABLE = {  # the lists that may be null as a whole
    "extra_token_ids",  # no extra samples
    "support_form",  # a call recorded before support forms (records/support.py)
    "support_mask",
}
_DISAGREE = "its per-position columns disagree in length"


def _null(values: pa.Array) -> np.ndarray:
    return pc.is_null(values).to_numpy(zero_copy_only=False)


def _lengths(lists: pa.Array) -> np.ndarray:
    return pc.fill_null(pc.list_value_length(lists), 0).to_numpy(zero_copy_only=False)


def _refuse(table: pa.Table, bad: np.ndarray, reason: str = _DISAGREE) -> None:
    """Raise for the first call marked `bad`, with `reason`."""
    if bad.any():
        call_id = table.column("call_id")[int(np.flatnonzero(bad)[0])].as_py()
        raise ValueError(f"call {call_id!r}: {reason}")


def trained_calls(calls: pa.Table, advantages: list[dict]) -> pa.Table:
    """The rows of a round's `calls` that it trains on: those of the trajectories with an advantage."""
    ids = pa.array(sorted({a["trajectory_id"] for a in advantages}), pa.string())
    return calls.filter(pc.is_in(calls.column("trajectory_id"), value_set=ids))
