"""The naive retokenizing pipeline, kept to measure what it costs (docs/estimators.md).

Many RL stacks do not keep the served token ids: they rebuild each example from the stored
conversation through the chat template and tokenize the text again. `retokenize_call` does exactly
that with a recorded call:

- prompt ids: the template rendered over `messages_json` without its last (assistant) message, with
  the generation prompt, then tokenized; completion ids: the whole conversation rendered and
  tokenized, minus that many leading tokens (what a pipeline that masks the prompt by length does);
- recorded per-position data (sampled log-prob, head, support, extra samples) is kept on the
  completion's longest prefix whose ids equal the recorded ids; from the first disagreement on,
  a position gets NaN in place of the recorded log-probs, a head of just its own token, an
  unrestricted support, and its own token as every extra sample. The trainer fills NaN behaviour
  log-probs with its round-start pi_k, as a pipeline that recomputes log-probs would: such tokens
  look on-policy to every estimator, except samples-form score centering, where a token centered
  on copies of itself gets weight 0.

`retokenize_calls` also says where the new ids differ from the recorded ones, each differing
stretch by cause (`rl/retokenize_causes.py`).

The command prints, for a round's recorded calls, how a pipeline that renders each trajectory's
whole conversation once would differ from what was served (`round_causes`: trajectories whose ids
differ, by cause, and differing stretches by cause) and how often the engine sampled non-canonical
spellings (`round_spellings`):

    python -m prodrl_pipeline.rl.retokenize TABLES --round N --tokenizer DIR [--trajectories]

TABLES: the tables' folder or s3:// URI (object-store options from PRODRL_STORAGE_OPTIONS, a JSON
object); DIR: the served model's tokenizer with its chat template. Exit status 1 when the round
has no calls or the table cannot be read, 2 for bad arguments.
"""

from __future__ import annotations

import argparse
import math
import os
import sys
from collections import Counter
from collections.abc import Iterable

from transformers import PreTrainedTokenizerBase

from prodrl_pipeline.artifacts import storage_options_from_environment
from prodrl_pipeline.chat.render import TemplateError, is_harmony, load_tokenizer, render_ids
from prodrl_pipeline.records import support
from prodrl_pipeline.records.store import DeltaStore, StorageError
from prodrl_pipeline.rl.retokenize_causes import (
    CAUSES,
    conversation,
    round_causes,
    round_spellings,
    stretch_causes,
)

NAN = math.nan


def _rendered(tokenizer: PreTrainedTokenizerBase, messages: list[dict]) -> tuple[list[int], list[int]]:
    """The prompt and completion ids of `messages` rendered; TemplateError if the template refuses."""
    try:
        prompt = render_ids(tokenizer, messages[:-1])
        return prompt, render_ids(tokenizer, messages, add_generation_prompt=False)[len(prompt) :]
    except TemplateError:
        raise
    except Exception as e:  # noqa: BLE001 - the template's own error (jinja2's raise_exception)
        raise TemplateError(f"the chat template cannot render the conversation: {e}") from e


def retokenize_call(call: dict, tokenizer: PreTrainedTokenizerBase) -> dict:
    """`call` rebuilt from its conversation, recorded data aligned where the ids agree."""
    prompt, completion = _rendered(tokenizer, conversation(call))
    old = call["completion_token_ids"]
    extra = call.get("extra_token_ids") or []
    agree = [t < len(old) and tok == old[t] for t, tok in enumerate(completion)]
    prefix = agree.index(False) if False in agree else len(agree)
    keep = [t < prefix for t in range(len(completion))]  # after a shift, nothing lines up
    vocab = call["vocab_size"]
    kept, whole = support.of_call(call), support.unrestricted(vocab)

    def pick(column: str, t: int, fallback):  # noqa: ANN001, ANN202
        return call[column][t] if keep[t] else fallback

    n_extra = len(extra[0]) if extra else 0
    return {
        **call,
        "prompt_token_ids": prompt,
        "completion_token_ids": completion,
        "completion_logprobs": [pick("completion_logprobs", t, NAN) for t in range(len(completion))],
        "topk_token_ids": [pick("topk_token_ids", t, [tok]) for t, tok in enumerate(completion)],
        "topk_logprobs": [pick("topk_logprobs", t, [NAN]) for t in range(len(completion))],
        **support.columns([kept[t] if keep[t] else whole for t in range(len(completion))]),
        "extra_token_ids": (
            [extra[t] if keep[t] else [tok] * n_extra for t, tok in enumerate(completion)] if extra else []
        ),
    }


def retokenize_calls(calls: Iterable[dict], tokenizer: PreTrainedTokenizerBase) -> tuple[list[dict], dict]:
    """Every call retokenized, and where the new ids differ from the recorded ones: counts of calls
    and completion positions, differing prompts and completions, and each differing stretch of a
    completion (a token diff, `stretch: <cause>`; the completion is the call's assistant turn). A
    call the template refuses to render (a malformed tool call whose arguments are not JSON, under
    a template that renders arguments as objects) is kept as recorded and counted `not rendered`:
    a pipeline that rebuilds conversations would have to drop it."""
    out: Counter = Counter()
    rebuilt = []
    for call in calls:
        out["calls"] += 1
        try:
            new = retokenize_call(call, tokenizer)
        except TemplateError:
            out["not rendered"] += 1
            rebuilt.append(call)
            continue
        rebuilt.append(new)
        old_c, new_c = call["completion_token_ids"], new["completion_token_ids"]
        out["positions"] += len(old_c)
        out["positions_retokenized"] += len(new_c)
        out["positions_aligned"] += sum(a == b for a, b in zip(new_c, old_c, strict=False))
        out["prompt_differs"] += new["prompt_token_ids"] != call["prompt_token_ids"]
        out["completion_differs"] += new_c != old_c
        # where they differ, by a token diff (the trainer's alignment above is positional)
        for c in stretch_causes(tokenizer, old_c, new_c, [(0, len(old_c))]):
            out[f"stretch: {c}"] += 1
    return rebuilt, dict(out)


def _share(n: int, of: int, per: int = 100) -> str:
    return f"{per * n / of:.1f}" if of else "-"


def _report(round_: int, n_calls: int, rows: list[dict], totals: dict, spelled: dict, each: bool) -> str:
    """The command's printout of `round_causes` and `round_spellings` (`each`: every differing or
    unrendered trajectory too)."""
    t, s = Counter(totals), Counter(spelled)
    multi = t["multi-turn"] - t["multi-turn not rendered"]  # shares are of the rendered ones
    rendered = t["trajectories"] - t["not rendered"]
    completions, calls = s["noncanonical completions"], s["noncanonical tool calls"]
    lines = [
        f"round {round_}: {n_calls} calls in {t['trajectories']} trajectories "
        f"({t['multi-turn']} multi-turn), {t['not rendered']} not rendered",
        f"retokenized whole, the ids differ in {t['differ']} of {rendered} rendered trajectories, "
        f"{t['multi-turn differ']} of {multi} rendered multi-turn ({_share(t['multi-turn differ'], multi)}%; "
        f"other than in whitespace {_share(t['multi-turn differ not only in whitespace'], multi)}%)",
        f"{'cause':<16} {'multi-turn':>10} {'share %':>8} {'stretches':>10}",
        *(
            f"{c:<16} {t[f'multi-turn: {c}']:>10} {_share(t[f'multi-turn: {c}'], multi):>8} "
            f"{t[f'stretches: {c}']:>10}"
            for c in CAUSES
        ),
        f"non-canonical spellings: {completions} of {s['completions']} completions "
        f"({_share(completions, s['completions'], 1000)} per 1,000), {calls} of {s['tool calls']} "
        f"tool calls ({_share(calls, s['tool calls'], 1000)} per 1,000)",
    ]
    for row in rows if each else []:
        head = f"{row['trajectory_id']}  {row['calls']} call{'s' * (row['calls'] != 1)}:"
        if "error" in row:
            lines.append(f"{head} not rendered: {row['error']}")
        elif row["causes"]:
            causes = [f"{c} {row['causes'][c]}" for c in CAUSES if c in row["causes"]]
            lines.append(f"{head} {', '.join(causes)}")
    return "\n".join(lines)


COLUMNS = "trajectory_id, call_id, call_index, prompt_token_ids, completion_token_ids, messages_json"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("tables", help="the tables' folder or s3:// URI (e.g. .prodrl/tables)")
    p.add_argument("--round", type=int, required=True)
    p.add_argument("--tokenizer", required=True, help="the served model's tokenizer folder")
    p.add_argument("--trajectories", action="store_true", help="list each differing trajectory")
    args = p.parse_args(argv)
    try:
        store = DeltaStore(args.tables, storage_options=storage_options_from_environment(os.environ))
    except ValueError as e:
        p.error(str(e))
    try:
        tokenizer = load_tokenizer(args.tokenizer)
    except (OSError, ValueError) as e:
        p.error(f"--tokenizer: {e}")
    if is_harmony(tokenizer):
        p.error("gpt-oss conversations are rendered by harmony, not a chat template: not retokenized here")
    try:
        calls = (
            store.query(f"SELECT {COLUMNS} FROM calls WHERE round = {args.round}", ["calls"]).to_pylist()
            if store.exists("calls")
            else []
        )
    except StorageError as e:
        print(e, file=sys.stderr)
        return 1
    if not calls:
        print(f"{args.tables}: no calls recorded in round {args.round}", file=sys.stderr)
        return 1
    rows, totals = round_causes(calls, tokenizer)
    print(_report(args.round, len(calls), rows, totals, round_spellings(calls, tokenizer), args.trajectories))
    return 0


if __name__ == "__main__":
    sys.exit(main())
