"""What a lab mode's recorded calls hold (docs/lab.md): the tokens a call samples, whether its text
parses to a move call, and whether the move call's arguments are spelled as the tokenizer encodes
them (`rl.retokenize_causes.spellings`): any other token sequence that decodes to the same text
(`Bxf|3` against `B|xf|3`) plays the same move, but re-encoding the decoded text gives other ids
than were served.
"""

from __future__ import annotations

import statistics
from collections.abc import Iterable

from transformers import PreTrainedTokenizerBase

from prodrl_pipeline.envs.chat import parse_assistant_text
from prodrl_pipeline.envs.chess_env import parse_move_call
from prodrl_pipeline.records import support
from prodrl_pipeline.rl.retokenize_causes import spellings


def traffic_stats(tokenizer: PreTrainedTokenizerBase, calls: Iterable[dict]) -> dict[str, float]:
    """Over recorded calls: how many; the median of sampled tokens per call (positions whose kept
    support holds more than one id: forced tokens excluded); the share whose completion holds a
    well-formed move call; of those calls, how many spell the call's arguments non-canonically, per
    1,000."""
    sampled, moves, non_canonical, n = [], 0, 0, 0
    for call in calls:
        n += 1
        sampled.append(sum(s.size > 1 for s in support.of_call(call)))
        text = tokenizer.decode(list(call["completion_token_ids"]), skip_special_tokens=False)
        if parse_move_call(parse_assistant_text(tokenizer, text)) is not None:
            moves += 1
            non_canonical += spellings(call, tokenizer)["arguments"] > 0
    return {
        "calls": n,
        "sampled_tokens_median": statistics.median(sampled) if sampled else float("nan"),
        "parse_rate": moves / n if n else float("nan"),
        "moves": moves,
        "non_canonical_per_1000": 1000 * non_canonical / moves if moves else float("nan"),
    }
