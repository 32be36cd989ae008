"""Structured outputs: what a constrained completion may contain, one token at a time.

A `Constraint` is the request's rule; `start()` gives the per-completion state the engine steps:
`allow` marks the ids allowed next (a logit mask that becomes part of the processed distribution
mu, as in vLLM's guided decoding), `advance` consumes the sampled id, `forced` is the chain of ids
that are the only ones allowed from here on (fed without sampling, recorded with log-prob 0 under
a one-token support), `finished` says that no id may follow.

`ChoiceConstraint` (one of a set of token sequences) serves tool calls over an enum;
`engine/grammar.py` serves JSON schemas; `AfterReasoning` applies either once a reasoning
segment has ended.
"""

from __future__ import annotations

from bisect import bisect_left, bisect_right
from collections.abc import Sequence
from itertools import chain
from operator import itemgetter
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
    recorded: dict | None
    """The call's `grammar` column: the constraint recorded once, from which a reader recomputes
    each position's mask (engine/grammar.py); None: positions record their supports themselves."""

    def start(self) -> ConstraintState:
        """A fresh state for one completion."""


class ChoiceConstraint:
    """Allowed completions: one of a set of token-id sequences, none a prefix of another. They are
    kept sorted, so the sequences that agree with what a completion has consumed so far are one
    contiguous range of them: a state is that range, and nothing else is built (a lab turn builds
    a constraint over ~35 sequences of ~19 ids and walks one path through it)."""

    recorded = None  # its supports are few ids: recorded per position

    def __init__(self, sequences: Sequence[Sequence[int]]):
        """`sequences` of ids in any form (lists, tensors) are read as plain ints; tuples that hold
        plain ints already (the lab's cached tool calls) are kept as they are."""
        if not sequences:
            raise ValueError("a choice constraint needs at least one allowed sequence")
        self.sequences = tuple(s if type(s) is tuple else tuple(map(int, s)) for s in sequences)
        if not set(map(type, chain.from_iterable(self.sequences))) <= {int}:  # e.g. numpy ints, bools
            self.sequences = tuple(tuple(map(int, s)) for s in self.sequences)
        ordered = sorted(self.sequences)  # a lab turn's come in order already: no comparison is wasted
        if not ordered[0]:
            raise ValueError("allowed sequences must be non-empty")
        self.ordered = ordered[:1]
        for seq in ordered[1:]:  # a sequence that is a prefix of others comes right before them
            last = self.ordered[-1]
            if seq == last:
                continue
            if seq[: len(last)] == last:
                raise ValueError(f"allowed sequence {list(last)} is a prefix of another")
            self.ordered.append(seq)

    def start(self) -> ChoiceState:
        return ChoiceState(self.ordered, 0, len(self.ordered), 0)

    @property
    def structured_outputs(self) -> dict:
        """The same constraint for vLLM's guidance backend: a Lark grammar of token-id references
        (`<[id]>`), so vLLM enforces exactly these token sequences, special tokens included."""
        alternatives = (" ".join(f"<[{t}]>" for t in seq) for seq in self.sequences)
        return {"grammar": "start: " + " | ".join(alternatives)}


class ChoiceState:
    """A completion's place in a `ChoiceConstraint`: `ordered[lo:hi]` are the sequences whose first
    `depth` ids it has consumed. Sorted sequences sharing their first `depth` ids have their next
    ids in ascending order, so a token's sequences are found by bisection, and the range agrees on
    its next id exactly when its first and last sequences do."""

    def __init__(self, ordered: list[tuple[int, ...]], lo: int, hi: int, depth: int):
        self.ordered, self.lo, self.hi, self.depth = ordered, lo, hi, depth

    def allowed(self) -> list[int]:
        """The distinct next ids, ascending: one bisection per id, not one visit per sequence (a
        client's enum may keep 1,000 long sequences in range for hundreds of steps)."""
        if self.finished:
            return []
        key, ids, i = itemgetter(self.depth), [], self.lo
        while i < self.hi:
            ids.append(self.ordered[i][self.depth])
            i = bisect_right(self.ordered, ids[-1], i, self.hi, key=key)
        return ids

    def allow(self, row: torch.Tensor) -> None:
        row[self.allowed()] = True

    def advance(self, token: int) -> None:
        if type(token) is int and not self.finished:
            key = itemgetter(self.depth)
            lo = bisect_left(self.ordered, token, self.lo, self.hi, key=key)
            hi = bisect_right(self.ordered, token, lo, self.hi, key=key)
            if lo < hi:
                self.lo, self.hi, self.depth = lo, hi, self.depth + 1
                return
        raise ValueError(f"token {token} is not allowed here")

    def forced(self) -> list[int]:
        ids = []
        first, last = self.ordered[self.lo], self.ordered[self.hi - 1]
        for a, b in zip(first[self.depth :], last[self.depth :], strict=False):
            if a != b:
                break
            ids.append(a)
        return ids

    @property
    def finished(self) -> bool:
        return self.depth == len(self.ordered[self.lo])


class AfterReasoning:
    """`inner` from the end of the reasoning on: every id is allowed until `end_id` (the template's
    end-of-reasoning marker, Qwen3's `</think>`) has been sampled, then `inner` decides, as vLLM's
    structured outputs do under a reasoning parser. `inner` must record its supports per position
    (`recorded` None): a recorded grammar would not describe the reasoning."""

    recorded = None

    def __init__(self, inner: Constraint, end_id: int):
        if inner.recorded is not None:
            raise ValueError("a constraint after reasoning records its supports per position")
        self.inner, self.end_id = inner, end_id

    def start(self) -> AfterReasoningState:
        return AfterReasoningState(self.inner.start(), self.end_id)


class AfterReasoningState:
    def __init__(self, inner: ConstraintState, end_id: int):
        self.inner, self.end_id, self.reasoning = inner, end_id, True

    def allow(self, row: torch.Tensor) -> None:
        if self.reasoning:
            row[:] = True
        else:
            self.inner.allow(row)

    def advance(self, token: int) -> None:
        if self.reasoning:
            self.reasoning = token != self.end_id
        else:
            self.inner.advance(token)

    def forced(self) -> list[int]:
        return [] if self.reasoning else self.inner.forced()

    @property
    def finished(self) -> bool:
        return not self.reasoning and self.inner.finished
