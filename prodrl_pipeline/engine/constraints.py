"""Structured outputs: what a constrained completion may contain, one token at a time.

A `Constraint` is the request's rule; `start()` gives the per-completion state the engine steps:
`allow` marks the ids allowed next (a logit mask that becomes part of the processed distribution
mu, as in vLLM's guided decoding), `advance` consumes the sampled id, `forced` is the chain of ids
that are the only ones allowed from here on (fed without sampling, recorded with log-prob 0 under
a one-token support), `finished` says that no id may follow.

`ChoiceConstraint` (a token trie: one of a set of sequences) serves tool calls over an enum;
`engine/grammar.py` serves JSON schemas.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

import torch


class ConstraintError(ValueError):
    """The request's constraint cannot go on (e.g. a grammar parser hit its limits): the request's
    fault, reported to it alone."""


class ConstraintState(Protocol):
    def allow(self, row: torch.Tensor) -> None:
        """Set `row` (a [V] bool tensor, all False) True at every id allowed next."""

    def advance(self, token: int) -> None:
        """Consume `token` (ValueError if it was not allowed)."""

    def forced(self) -> list[int]:
        """The ids forced from here on (each the only allowed one), without consuming them."""

    @property
    def finished(self) -> bool:
        """No id may follow: the completion is over."""


class Constraint(Protocol):
    def start(self) -> ConstraintState:
        """A fresh state for one completion."""


class ChoiceConstraint:
    """Allowed completions as a trie over token ids (a node is a dict of child nodes)."""

    def __init__(self, sequences: Sequence[Sequence[int]]):
        if not sequences:
            raise ValueError("a choice constraint needs at least one allowed sequence")
        self.sequences = tuple(tuple(map(int, seq)) for seq in sequences)
        ordered = sorted(set(self.sequences))
        if not ordered[0]:
            raise ValueError("allowed sequences must be non-empty")
        # sorted, a sequence that is a prefix of others comes right before the first of them
        for a, b in zip(ordered, ordered[1:], strict=False):
            if b[: len(a)] == a:
                raise ValueError(f"allowed sequence {list(a)} is a prefix of another")
        self.root: dict[int, dict] = {}
        for seq in ordered:
            node = self.root
            for tok in seq:
                node = node.setdefault(tok, {})

    def start(self) -> TrieState:
        return TrieState(self.root)

    @property
    def structured_outputs(self) -> dict:
        """The same constraint for vLLM's guidance backend: a Lark grammar of token-id references
        (`<[id]>`), so vLLM enforces exactly these token sequences, special tokens included."""
        alternatives = (" ".join(f"<[{t}]>" for t in seq) for seq in self.sequences)
        return {"grammar": "start: " + " | ".join(alternatives)}


class TrieState:
    """A position in a `ChoiceConstraint`'s trie."""

    def __init__(self, node: dict[int, dict]):
        self.node = node

    def allowed(self) -> list[int]:
        return sorted(self.node)

    def allow(self, row: torch.Tensor) -> None:
        row[list(self.node)] = True

    def advance(self, token: int) -> None:
        if token not in self.node:
            raise ValueError(f"token {token} is not allowed here")
        self.node = self.node[token]

    def forced(self) -> list[int]:
        chain, node = [], self.node
        while len(node) == 1:
            ((tok, node),) = node.items()
            chain.append(tok)
        return chain

    @property
    def finished(self) -> bool:
        return not self.node
