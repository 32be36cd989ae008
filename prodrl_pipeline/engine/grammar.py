"""Grammar-constrained decoding: JSON (any object, or a JSON schema) through llguidance, the
library behind vLLM's `guidance` structured-output backend.

A matcher tracks the completion's bytes against the grammar over the tokenizer's vocabulary; its
token bitmask is the logit mask (part of mu, as every mask is). The end-of-turn id is allowed once
the text is a complete match. Special tokens other than that id are never allowed: JSON text is
plain text. Whitespace between JSON tokens is flexible (vLLM's default for this backend).

A call records its constraint once (`GrammarConstraint.recorded`: the grammar, the tokenizer's
identity, the library's version), not each position's mask: a reader replays the completion
through the same library to recompute every mask (records/grammar_masks.py). Masks are filled by
llguidance into an int32 bitmask (bit v % 32 of word v // 32, as vLLM's backend fills them) and
unpacked by one numpy call.
"""

from __future__ import annotations

import hashlib
import json
import weakref
from functools import lru_cache
from importlib.metadata import version

import llguidance
import llguidance.hf
import llguidance.numpy
import numpy as np
import torch
from transformers import PreTrainedTokenizerBase

from prodrl_pipeline.engine.constraints import ConstraintError

LIBRARY = f"llguidance {version('llguidance')}"
"""The library whose masks a grammar-constrained call records; a reader must load the same."""
_TOKENIZERS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
MAX_FORCED = 256  # a forced chain longer than this is sampled on (one-token supports) instead


def ll_tokenizer(tokenizer: PreTrainedTokenizerBase, eos_id: int) -> tuple[llguidance.LLTokenizer, str]:
    """llguidance's view of `tokenizer` with `eos_id` as its end, and that view's identity: the
    sha256 of everything its masks depend on (the vocabulary size, the end id, each token's bytes
    and whether it is special). Built once per tokenizer and end id (~0.3 s at V = 151,669)."""
    cached = _TOKENIZERS.setdefault(tokenizer, {})
    if eos_id not in cached:
        ll = llguidance.hf.from_tokenizer(tokenizer, n_vocab=len(tokenizer), eos_token=eos_id)
        digest = hashlib.sha256(f"{ll.vocab_size} {eos_id}\n".encode())
        for v in range(ll.vocab_size):
            text = ll.decode_bytes([v])
            digest.update(len(text).to_bytes(4, "little") + text + bytes([ll.is_special_token(v)]))
        cached[eos_id] = ll, digest.hexdigest()
    return cached[eos_id]


def fill_mask(matcher: llguidance.LLMatcher, bits: np.ndarray, row: int = 0) -> None:
    """llguidance's mask of `matcher`'s next token into row `row` of `bits` ([N, W] int32, from
    `llguidance.numpy.allocate_token_bitmask`); ConstraintError if the matcher has failed (one that
    fails while filling leaves no id allowed)."""
    if matcher.is_error():
        raise ConstraintError(f"the grammar could not go on: {_short(matcher.get_error())}")
    llguidance.numpy.fill_next_token_bitmask(matcher, bits, row)


def unpack(bits: np.ndarray, n_vocab: int) -> np.ndarray:  # [..., n_vocab] bool
    """The allowed ids of int32 bitmasks `bits` [..., W] as booleans."""
    words = np.ascontiguousarray(bits, dtype="<i4").view(np.uint8)
    return np.unpackbits(words, axis=-1, bitorder="little")[..., :n_vocab].view(bool)


class GrammarConstraint:
    """Completions matching an llguidance grammar, then the end-of-turn id."""

    def __init__(
        self,
        tokenizer: PreTrainedTokenizerBase,
        grammar: str,
        eos_id: int,
        structured_outputs: dict | None = None,
    ):
        self.eos_id, self.n_vocab = eos_id, len(tokenizer)
        self.structured_outputs = structured_outputs
        """The same constraint as vLLM's `structured_outputs` request field (None: no such form)."""
        ll, identity = ll_tokenizer(tokenizer, eos_id)
        self.recorded = {
            "grammar": grammar,
            "tokenizer_sha256": identity,
            "eos_id": eos_id,
            "library": LIBRARY,
        }
        """The call's `grammar` column (docs/tables.md): what a reader needs to recompute its masks."""
        self.fresh = llguidance.LLMatcher(ll, grammar, log_level=0)
        if self.fresh.is_error():  # compiled once here; each completion starts from a copy
            raise ValueError(f"the grammar cannot be enforced: {_short(self.fresh.get_error())}")
        try:
            first = self.start().allowed()
        except ConstraintError as e:
            raise ValueError(f"the grammar cannot be enforced: {e}") from e
        if not set(first) - {eos_id}:
            raise ValueError("the grammar admits no text (nothing but the end of the turn can follow)")

    @classmethod
    def json(
        cls, tokenizer: PreTrainedTokenizerBase, eos_id: int, schema: dict | None = None
    ) -> GrammarConstraint:
        """JSON text matching `schema`; None: any JSON object (OpenAI's `json_object`). Compiled
        schemas are cached (a client repeats its schema on every call)."""
        text = json.dumps({"type": "object"} if schema is None else schema, sort_keys=True)
        return _json_constraint(tokenizer, eos_id, text)  # vLLM: {"json": schema}, the same grammar

    def start(self) -> GrammarState:
        return GrammarState(self.fresh.deep_copy(), self.eos_id, self.n_vocab)


@lru_cache(maxsize=64)
def _json_constraint(tokenizer: PreTrainedTokenizerBase, eos_id: int, schema: str) -> GrammarConstraint:
    try:
        grammar = llguidance.LLMatcher.grammar_from_json_schema(schema)
    except ValueError as e:
        raise ValueError(f"the JSON schema cannot be enforced: {_short(str(e))}") from e
    return GrammarConstraint(tokenizer, grammar, eos_id, {"json": json.loads(schema)})


def _short(error: str) -> str:
    """llguidance's error without the grammar dump it may append: its first line, bounded."""
    return error.strip().splitlines()[0][:300] if error.strip() else "unknown error"


class GrammarState:
    """One completion's matcher, with the mask of its current position cached."""

    def __init__(self, matcher: llguidance.LLMatcher, eos_id: int, n_vocab: int):
        self.matcher, self.eos_id, self.n_vocab = matcher, eos_id, n_vocab
        self.ended = False
        self.bits = llguidance.numpy.allocate_token_bitmask(1, n_vocab)  # [1, W] filled in place
        self._mask: np.ndarray | None = None

    def mask(self) -> np.ndarray:  # [n_vocab] bool
        if self._mask is None:
            fill_mask(self.matcher, self.bits)
            self._mask = unpack(self.bits[0], self.n_vocab)
        return self._mask

    def allowed(self) -> list[int]:
        return np.flatnonzero(self.mask()).tolist()

    def allow(self, row: torch.Tensor) -> None:
        row[: self.n_vocab] = torch.from_numpy(self.mask())

    def advance(self, token: int) -> None:
        if not (0 <= token < self.n_vocab and self.mask()[token]):
            raise ValueError(f"token {token} is not allowed here")
        self._mask = None
        if token == self.eos_id:
            self.ended = True
        elif not self.matcher.consume_token(token):
            raise ConstraintError(f"the grammar could not go on: {_short(self.matcher.get_error())}")

    def forced(self) -> list[int]:
        mask = self.mask()
        if np.count_nonzero(mask) != 1:  # the common case: nothing forced
            return []
        chain, matcher, bits = [], self.matcher.deep_copy(), self.bits.copy()
        while len(chain) < MAX_FORCED and np.count_nonzero(mask) == 1:
            tok = int(np.flatnonzero(mask)[0])
            chain.append(tok)
            if tok == self.eos_id or not matcher.consume_token(tok):
                break
            fill_mask(matcher, bits)
            mask = unpack(bits[0], self.n_vocab)
        return chain

    @property
    def finished(self) -> bool:
        return self.ended
