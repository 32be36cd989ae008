"""The masks of a grammar-constrained call, recomputed from its recorded constraint.

A call served under a grammar (JSON mode) records the constraint once, in its `grammar` column
(`GrammarConstraint.recorded`, engine/grammar.py): the llguidance grammar, the identity of
llguidance's view of the tokenizer (`tokenizer_sha256`), the end id and the library's version. A
position whose kept support is the grammar's whole mask records no ids: a reader replays the
completion through a matcher of the same library over the same tokenizer and gets each position's
mask exactly as the engine applied it. A call that cannot be replayed exactly (another library
version or tokenizer loaded, a sampled id the mask does not allow) is refused by name.

`resolved` turns a table's GRAMMAR supports (records/support.py) into the BITMASK of their
recomputed masks, so every later reader (the trainer's restricted-support normalisation) sees one
exact form.
"""

from __future__ import annotations

from collections.abc import Sequence

import llguidance
import llguidance.numpy
import numpy as np
from transformers import PreTrainedTokenizerBase

from prodrl_pipeline.engine.grammar import LIBRARY, fill_mask, ll_tokenizer
from prodrl_pipeline.records.ragged import Ragged, offsets, ranges
from prodrl_pipeline.records.schema import GRAMMAR
from prodrl_pipeline.records.support import Form, SupportColumns

FIELDS = tuple(GRAMMAR.names)
"""The fields of a call's `grammar` record."""


class GrammarMasks:
    """Recomputes the masks of calls served with `tokenizer` (compiled grammars cached by text)."""

    def __init__(self, tokenizer: PreTrainedTokenizerBase | None):
        """`tokenizer` None: a reader without the served tokenizer, which refuses every grammar call."""
        self.tokenizer = tokenizer
        self._compiled: dict[tuple[str, int], llguidance.LLMatcher] = {}

    def masks(self, call_id: str, record: dict, completion: Sequence[int], vocab: int) -> np.ndarray:
        """[T, ceil(vocab / 8)] uint8: the ids allowed before each of the `completion` ids (bit
        v % 8 of byte v // 8, least significant first; none past the tokenizer's vocabulary), with
        the completion's ids consumed in turn. ValueError naming `call_id` when the record is not
        one this reader can replay exactly, or a completion id is not allowed where it stands."""
        refuse = _refusal(call_id)
        if set(record or {}) != set(FIELDS) or any(record[f] is None for f in FIELDS):
            raise refuse(f"its grammar record is not one of {', '.join(FIELDS)}: {record!r:.200}")
        if record["library"] != LIBRARY:
            raise refuse(f"its masks were computed by {record['library']}, this reader loads {LIBRARY}")
        if self.tokenizer is None:
            raise refuse("it was served under a grammar: reading it needs the served tokenizer")
        n_vocab, eos = len(self.tokenizer), int(record["eos_id"])
        if not 0 <= eos < n_vocab <= vocab:
            raise refuse(f"end id {eos} and tokenizer of {n_vocab} ids do not fit its vocabulary of {vocab}")
        _, identity = ll_tokenizer(self.tokenizer, eos)
        if record["tokenizer_sha256"] != identity:
            raise refuse("it was served with another tokenizer than the one loaded (its sha256 differs)")
        matcher = self._matcher(record["grammar"], eos, refuse).deep_copy()
        bits = llguidance.numpy.allocate_token_bitmask(len(completion), n_vocab)  # [T, W] int32
        ended = False
        for t, tok in enumerate(completion):
            if ended:
                raise refuse(f"position {t}: an id after the end of its grammar")
            try:
                fill_mask(matcher, bits, t)
            except ValueError as e:
                raise refuse(f"position {t}: {e}") from e
            word, bit = divmod(int(tok), 32)
            if not (0 <= tok < n_vocab and (int(bits[t, word]) >> bit) & 1):
                raise refuse(f"position {t}: sampled id {tok} is not allowed by the recomputed grammar mask")
            ended = tok == eos
            if not ended and not matcher.consume_token(int(tok)):
                raise refuse(f"position {t}: the grammar could not go on after id {tok}")
        out = np.zeros((len(completion), (vocab + 7) // 8), dtype=np.uint8)
        kept = (n_vocab + 7) // 8
        out[:, :kept] = bits.astype("<i4", copy=False).view(np.uint8)[:, :kept]
        if n_vocab % 8:  # the bits of the last byte past the tokenizer's vocabulary
            out[:, kept - 1] &= (1 << (n_vocab % 8)) - 1
        return out

    def _matcher(self, grammar: str, eos: int, refuse) -> llguidance.LLMatcher:  # noqa: ANN001
        key = (grammar, eos)
        if key not in self._compiled:
            matcher = llguidance.LLMatcher(ll_tokenizer(self.tokenizer, eos)[0], grammar, log_level=0)
            if matcher.is_error():
                raise refuse(f"its grammar does not compile: {matcher.get_error().splitlines()[0][:300]}")
            self._compiled[key] = matcher
        return self._compiled[key]


def _refusal(call_id: str):  # noqa: ANN202
    return lambda reason: ValueError(f"call {call_id!r}: {reason}")


def resolved(
    kept: SupportColumns,
    call_ids: list[str],
    grammars: list[dict | None],
    completion: Ragged,
    vocab: np.ndarray,  # [calls]
    samples: Sequence[Ragged],
    masks: GrammarMasks,
) -> SupportColumns:
    """`kept` (every completion position's support) with each GRAMMAR position as the BITMASK of
    its recomputed mask. Every call with a grammar record is replayed (`GrammarMasks.masks`: its
    sampled ids checked against each mask); ValueError naming the call for a GRAMMAR position in a
    call without a record or with a payload, a recomputed mask of another size than the recorded
    one, or an id of `samples` (ragged per position: the head, the extra samples) outside it."""
    grammar = kept.form == Form.GRAMMAR
    owner = np.repeat(np.arange(len(call_ids)), completion.lengths)  # [positions]
    recorded = np.array([g is not None for g in grammars], dtype=bool)
    wrong = grammar & (~recorded[owner] | (kept.ids.lengths > 0) | (kept.mask.lengths > 0))
    if wrong.any():
        raise ValueError(
            f"call {call_ids[owner[np.flatnonzero(wrong)[0]]]!r}: a GRAMMAR support in a call that "
            "recorded no grammar, or with a payload"
        )
    at, rows = [], []
    for c in np.flatnonzero(recorded):
        start, end = completion.offsets[c], completion.offsets[c + 1]
        recomputed = masks.masks(call_ids[c], grammars[c], completion.values[start:end], int(vocab[c]))
        picked = np.flatnonzero(grammar[start:end])
        counts = np.bitwise_count(recomputed[picked]).sum(axis=1)
        problems = [
            (t, f"its recomputed mask keeps {n} ids, its record {kept.size[start + t]}")
            for t, n in zip(picked, counts, strict=True)
            if n != kept.size[start + t]
        ]
        for ids in samples:
            lengths = ids.lengths[start + picked]
            t = np.repeat(picked, lengths)
            v = ids.values[ranges(ids.offsets[start + picked], lengths)]
            inside = (v >= 0) & (v < vocab[c])
            v = np.where(inside, v, 0)
            held = inside & ((recomputed[t, v // 8] >> (v % 8).astype(np.uint8)) & 1 == 1)
            problems += [
                (int(t[q]), f"its head or extra id {v[q]} is outside its recomputed mask")
                for q in np.flatnonzero(~held)[:1]
            ]
        if problems:
            t, problem = min(problems)
            raise ValueError(f"call {call_ids[c]!r}: position {t}: {problem}")
        at.append(start + picked)
        rows += list(recomputed[picked])
    if not rows:
        return kept
    at = np.concatenate(at)
    form = kept.form.copy()
    form[at] = Form.BITMASK
    lengths = kept.mask.lengths.copy()
    lengths[at] = [len(r) for r in rows]
    starts = offsets(lengths)
    values = np.empty(starts[-1], dtype=np.uint8)
    values[ranges(starts[:-1], kept.mask.lengths)] = kept.mask.values  # GRAMMAR positions had none
    values[ranges(starts[at], lengths[at])] = np.concatenate(rows)
    return SupportColumns(kept.size, form, kept.ids, Ragged(values, starts))
