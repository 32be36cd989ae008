"""What a lab mode's recorded calls hold (docs/lab.md): the tokens a call samples, whether its text
parses to a move call, and how its move is spelled.

A sampled move is spelled canonically when the ids that cover the argument's characters are, and
are exactly, the tokenizer's encoding of the move; any other token sequence that decodes to the same
text (a non-canonical spelling: `Bxf|3` against `B|xf|3`, or a token that also holds the quote)
plays the same move, but re-encoding the decoded text gives other ids than were served.
"""

from __future__ import annotations

import json
import statistics
from collections.abc import Iterable
from itertools import accumulate

from transformers import PreTrainedTokenizerBase

from prodrl_pipeline.envs.chat import TOOL_CALL_OPEN, parse_assistant_text
from prodrl_pipeline.envs.chess_env import parse_move_call
from prodrl_pipeline.records import support


def move_spelling(tokenizer: PreTrainedTokenizerBase, completion_ids: list[int]) -> tuple[str, bool] | None:
    """The move a completion's call names and whether its ids spell it canonically (module
    docstring); None when the completion holds no well-formed move call."""
    pieces = [tokenizer.decode([t], skip_special_tokens=False) for t in completion_ids]
    text = "".join(pieces)
    move = parse_move_call(parse_assistant_text(text))
    if move is None:
        return None
    quoted = json.dumps(move, ensure_ascii=False)
    found = text.rfind(quoted, max(text.rfind(TOOL_CALL_OPEN), 0))
    if found < 0:  # the argument was written with escapes: not the tokenizer's spelling
        return move, False
    start, end = found + 1, found + 1 + len(move)
    ends = list(accumulate(len(p) for p in pieces))
    covering = [i for i, e in enumerate(ends) if e > start and e - len(pieces[i]) < end]
    aligned = ends[covering[0]] - len(pieces[covering[0]]) == start and ends[covering[-1]] == end
    canonical = [completion_ids[i] for i in covering] == tokenizer.encode(move, add_special_tokens=False)
    return move, aligned and canonical


def traffic_stats(tokenizer: PreTrainedTokenizerBase, calls: Iterable[dict]) -> dict[str, float]:
    """Over recorded calls: how many; the median of sampled tokens per call (positions whose kept
    support holds more than one id: forced tokens excluded); the share whose completion holds a
    well-formed move call; of those calls' moves, how many are spelled non-canonically, per 1,000."""
    sampled, moves, non_canonical, n = [], 0, 0, 0
    for call in calls:
        n += 1
        sampled.append(sum(s.size > 1 for s in support.of_call(call)))
        spelled = move_spelling(tokenizer, list(call["completion_token_ids"]))
        if spelled is not None:
            moves += 1
            non_canonical += not spelled[1]
    return {
        "calls": n,
        "sampled_tokens_median": statistics.median(sampled) if sampled else float("nan"),
        "parse_rate": moves / n if n else float("nan"),
        "moves": moves,
        "non_canonical_per_1000": 1000 * non_canonical / moves if moves else float("nan"),
    }
