"""Grammar-constrained decoding: JSON (any object, or a JSON schema) through llguidance, the
library behind vLLM's `guidance` structured-output backend.

A matcher tracks the completion's bytes against the grammar over the tokenizer's vocabulary; its
token bitmask is the logit mask (part of mu, as every mask is). The end-of-turn id is allowed once
the text is a complete match. Special tokens other than that id are never allowed: JSON text is
plain text. Whitespace between JSON tokens is flexible (vLLM's default for this backend).
"""

from __future__ import annotations

import json
import weakref
from functools import lru_cache

import llguidance
import llguidance.hf
import numpy as np
import torch
from transformers import PreTrainedTokenizerBase

from prodrl_pipeline.engine.constraints import ConstraintError

_TOKENIZERS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
MAX_FORCED = 256  # a forced chain longer than this is sampled on (one-token supports) instead


def _ll_tokenizer(tokenizer: PreTrainedTokenizerBase, eos_id: int) -> llguidance.LLTokenizer:
    """llguidance's view of `tokenizer` (built once per tokenizer and end id: ~0.1 s)."""
    cached = _TOKENIZERS.setdefault(tokenizer, {})
    if eos_id not in cached:
        cached[eos_id] = llguidance.hf.from_tokenizer(tokenizer, n_vocab=len(tokenizer), eos_token=eos_id)
    return cached[eos_id]


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
        self.fresh = llguidance.LLMatcher(_ll_tokenizer(tokenizer, eos_id), grammar, log_level=0)
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
        self._mask: np.ndarray | None = None

    @staticmethod
    def _allowed(matcher: llguidance.LLMatcher, n_vocab: int) -> np.ndarray:  # [n_vocab] bool
        if matcher.is_error():
            raise ConstraintError(f"the grammar could not go on: {_short(matcher.get_error())}")
        words = np.frombuffer(matcher.compute_bitmask(), dtype=np.uint8)
        return np.unpackbits(words, bitorder="little")[:n_vocab].astype(bool)

    def mask(self) -> np.ndarray:
        if self._mask is None:
            self._mask = self._allowed(self.matcher, self.n_vocab)
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
        if mask.sum() != 1:  # the common case: nothing forced
            return []
        chain, matcher = [], self.matcher.deep_copy()
        while len(chain) < MAX_FORCED and mask.sum() == 1:
            tok = int(np.flatnonzero(mask)[0])
            chain.append(tok)
            if tok == self.eos_id or not matcher.consume_token(tok):
                break
            mask = self._allowed(matcher, self.n_vocab)
        return chain

    @property
    def finished(self) -> bool:
        return self.ended
