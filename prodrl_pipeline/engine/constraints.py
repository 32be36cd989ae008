"""Structured outputs: a completion constrained to one of a set of token sequences.

As in vLLM's guided decoding with a `choice` grammar, the constraint is a token trie. At each
position only the trie's children are allowed (a logit mask that becomes part of the processed
distribution); a node with one child forces that token.
"""

from __future__ import annotations

from collections.abc import Sequence
from functools import lru_cache

from transformers import PreTrainedTokenizerBase

from prodrl_pipeline.envs.chat import IM_END, tool_call_prefix


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


@lru_cache(maxsize=1 << 16)
def tool_call_ids(
    tokenizer: PreTrainedTokenizerBase, tool_name: str, argument: str, value: str
) -> tuple[int, ...]:
    """The completion ids of one tool call `tool_name({argument: value})` ending the turn. Cached:
    a lab round builds a constraint per turn over ~35 legal moves, drawn from a few thousand."""
    text = f'{tool_call_prefix(tool_name)}{{"{argument}": "{value}"}}}}</tool_call>{IM_END}'
    return tuple(tokenizer.encode(text, add_special_tokens=False))


def tool_choice_constraint(
    tokenizer: PreTrainedTokenizerBase, tool_name: str, argument: str, values: Sequence[str]
) -> ChoiceConstraint:
    """One tool call `tool_name({argument: v})` with v among `values`, then the end of the turn.
    The wrapper tokens are forced; only the argument's tokens are choices."""
    return ChoiceConstraint([tool_call_ids(tokenizer, tool_name, argument, v) for v in values])
