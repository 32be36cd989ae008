"""The masks of a grammar-constrained call, recomputed from its recorded constraint.

A call served under a grammar (JSON mode) records the constraint once, in its `grammar` column
(`GrammarConstraint.recorded`, engine/grammar.py): the llguidance grammar, the identity of
llguidance's view of the tokenizer (`tokenizer_sha256`), the end id and the library's version. A
position whose kept support is the grammar's whole mask records no ids: a reader replays the
completion through a matcher of the same library over the same tokenizer and gets each position's
mask exactly as the engine applied it. A call that cannot be replayed exactly (another library
version or tokenizer loaded, a sampled id the mask does not allow) is refused by name.
"""

from __future__ import annotations

from collections.abc import Sequence

import llguidance
import llguidance.numpy
import numpy as np
from transformers import PreTrainedTokenizerBase

from prodrl_pipeline.engine.grammar import LIBRARY, fill_mask, ll_tokenizer

FIELDS = ("grammar", "tokenizer_sha256", "eos_id", "library")
"""The fields of a call's `grammar` record (records/schema.py GRAMMAR)."""


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
