"""Structured outputs: a completion constrained to one of a set of token sequences.

As in vLLM's guided decoding with a `choice` grammar, the constraint is a token trie. At each
position only the trie's children are allowed (a logit mask that becomes part of the processed
distribution); a node with one child forces that token.
"""

from __future__ import annotations

from collections.abc import Sequence


class ChoiceConstraint:
    """Allowed completions as a trie over token ids. A state is a trie node (a dict)."""

    def __init__(self, sequences: Sequence[Sequence[int]]):
        if not sequences:
            raise ValueError("a choice constraint needs at least one allowed sequence")
        self.root: dict[int, dict] = {}
        for seq in sequences:
            if not seq:
                raise ValueError("allowed sequences must be non-empty")
            node = self.root
            for tok in seq:
                node = node.setdefault(int(tok), {})
        self._check_prefix_free(self.root, sequences)

    @staticmethod
    def _check_prefix_free(root: dict, sequences: Sequence[Sequence[int]]) -> None:
        for seq in sequences:
            node = root
            for tok in seq:
                node = node[int(tok)]
            if node:
                raise ValueError(f"allowed sequence {list(seq)} is a prefix of another")

    def allowed(self, state: dict) -> list[int]:
        return sorted(state)

    @staticmethod
    def advance(state: dict, token: int) -> dict:
        if token not in state:
            raise ValueError(f"token {token} is not allowed here")
        return state[token]

    @staticmethod
    def is_done(state: dict) -> bool:
        return not state

    @staticmethod
    def forced(state: dict) -> list[int]:
        """The tokens forced from `state` on (single-child chain): fed without sampling."""
        chain = []
        while len(state) == 1:
            ((tok, state),) = state.items()
            chain.append(tok)
        return chain
