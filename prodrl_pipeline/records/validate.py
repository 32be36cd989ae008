"""The data contract's rules (docs/tables.md). A record that breaks one goes to `rejects` with its
reason, together with every other record of its trajectory: it is never trained on."""

from __future__ import annotations

import itertools
import json
import math
from collections import defaultdict
from datetime import UTC, datetime

import numpy as np

from prodrl_pipeline.records import support
from prodrl_pipeline.records.schema import json_value

HEAD_MASS_TOLERANCE = 1e-4  # log-space slack for float32 rounding of recorded head probabilities


def _logsumexp(xs: list[float] | np.ndarray) -> float:
    """In float64 whatever the entries' type (a float32 array's own arithmetic would round)."""
    values = [float(x) for x in xs]
    top = max(values)
    return top + math.log(sum(math.exp(x - top) for x in values))


def _ints(xs: object) -> bool:
    return isinstance(xs, list | tuple) and all(isinstance(x, int) and not isinstance(x, bool) for x in xs)


def _numbers(xs: object) -> bool:
    return isinstance(xs, list | tuple) and all(
        x is None or (isinstance(x, int | float) and not isinstance(x, bool)) for x in xs
    )


def _array_row(xs: np.ndarray, kinds: str) -> bool:
    """A position's entries as the engine records them (engine/rows.py): a 1-D array of one of the
    dtype `kinds`, in the machine's byte order (Arrow takes no other)."""
    return xs.ndim == 1 and xs.dtype.kind in kinds and xs.dtype.isnative


def _id_row(xs: object) -> bool:
    return _array_row(xs, "iu") if isinstance(xs, np.ndarray) else _ints(xs)


def _number_row(xs: object) -> bool:
    return _array_row(xs, "iuf") if isinstance(xs, np.ndarray) else _numbers(xs)


def _lists_of(check, xs: object) -> bool:
    """`xs` is a list whose entries each pass `check` (a null or a falsy 0 is not a list)."""
    return isinstance(xs, list | tuple) and all(x is not None and check(x) for x in xs)


def _byte_strings(xs: object) -> bool:
    return isinstance(xs, list | tuple) and all(isinstance(x, bytes) for x in xs)


def _bias_entries(xs: object) -> bool:
    return isinstance(xs, list | tuple) and all(
        isinstance(e, dict) and _ints([e.get("token_id")]) and _numbers([e.get("bias")]) for e in xs
    )


def _given(call: dict, name: str) -> object:
    """A column's value, [] when absent or null (not by truthiness: an array has none)."""
    value = call.get(name)
    return [] if value is None else value


def _shape_problem(call: dict) -> str | None:
    """The first column whose type is not the contract's (records from outside are hostile)."""
    for name in ("prompt_token_ids", "completion_token_ids", "support_size", "support_form"):
        if not _ints(_given(call, name)):
            return f"{name} is not a list of integers"
    if not _byte_strings(_given(call, "support_mask")):
        return "support_mask is not a list of byte strings"
    for name in ("topk_token_ids", "support_token_ids", "extra_token_ids"):
        if not _lists_of(_id_row, _given(call, name)):
            return f"{name} is not a list of lists of integers"
    if not _numbers(_given(call, "completion_logprobs")):
        return "completion_logprobs is not a list of numbers"
    if not _lists_of(_number_row, _given(call, "topk_logprobs")):
        return "topk_logprobs is not a list of lists of numbers"
    if not _ints([call.get("vocab_size") or 0]):
        return "vocab_size is not an integer"
    grammar = call.get("grammar")
    if grammar is not None and (
        not isinstance(grammar, dict)
        or not all(isinstance(grammar.get(k), str) for k in ("grammar", "tokenizer_sha256", "library"))
        or not _ints([grammar.get("eos_id")])
    ):
        return "grammar is not a record of grammar, tokenizer_sha256 and library strings and an eos_id"
    sampling = call.get("sampling")
    if sampling is not None and (
        not isinstance(sampling, dict)
        or not _numbers([sampling.get(k) for k in ("temperature", "top_p", "top_k")])
        or not _bias_entries(sampling.get("logit_bias") or [])
    ):
        return "sampling is not a record with numeric temperature, top_p, top_k and logit_bias entries"
    return None


def call_problem(call: dict) -> str | None:
    """The first contract rule `call` breaks, or None."""
    if problem := _shape_problem(call):
        return problem
    vocab = call.get("vocab_size") or 0
    prompt, completion = call.get("prompt_token_ids") or [], call.get("completion_token_ids") or []
    if not prompt or not completion:
        return "empty prompt or completion"
    columns = ("completion_logprobs", "topk_token_ids", "topk_logprobs", "support_size", "support_token_ids")
    given = [name for name in ("support_form", "support_mask") if call.get(name) is not None]  # newer
    lengths = {name: len(call.get(name) or []) for name in (*columns, *given)}
    if any(n != len(completion) for n in lengths.values()):
        return f"per-position columns disagree with {len(completion)} completion ids: {lengths}"
    if any(not 0 <= t < vocab for t in prompt + completion):
        return f"token id outside [0, {vocab})"
    sampling = call.get("sampling") or {}
    temperature, top_p, top_k = (sampling.get(k) for k in ("temperature", "top_p", "top_k"))
    if temperature is None or not math.isfinite(temperature) or temperature <= 0:
        return "no sampling temperature > 0: a greedy call has no sampling distribution to train on"
    if (top_p is not None and not 0 < top_p <= 1) or (top_k is not None and top_k < 0):
        return f"sampling top_p {top_p} outside (0, 1] or top_k {top_k} < 0"
    for entry in sampling.get("logit_bias") or []:
        token, bias = entry.get("token_id"), entry.get("bias")
        if not 0 <= token < vocab or bias is None or not -100 <= bias <= 100:
            return f"logit_bias entry {entry} is not a vocabulary id with a bias in [-100, 100]"
    extra = call.get("extra_token_ids") or []
    if extra and len(extra) != len(completion):
        return f"extra samples recorded for {len(extra)} of {len(completion)} positions"
    if extra and len({len(e) for e in extra}) != 1:
        return "positions recorded different numbers of extra samples"
    for t, (tok, kept) in enumerate(zip(completion, support.of_call(call), strict=True)):
        lp = call["completion_logprobs"][t]
        head, head_lp = call["topk_token_ids"][t], call["topk_logprobs"][t]
        size = kept.size
        if lp is None or not math.isfinite(lp) or lp > 0:
            return f"position {t}: log-prob {lp} is not finite and <= 0"
        if len(head) == 0 or len(head) != len(head_lp):
            return f"position {t}: empty head or head ids/log-probs of different lengths"
        if not len(head) <= size <= vocab:
            return f"position {t}: support size {size} outside [{len(head)}, {vocab}]"
        if problem := support.problem(kept, head, vocab):
            return f"position {t}: {problem}"
        if kept.form == support.Form.GRAMMAR and call.get("grammar") is None:
            return f"position {t}: a GRAMMAR support in a call that recorded no grammar"
        sampled = [tok, *(extra[t] if extra else [])]
        if any(not 0 <= v < vocab for v in [*head, *sampled]):
            return f"position {t}: a head or extra id is outside [0, {vocab})"
        if len(set(head)) != len(head):
            return f"position {t}: repeated ids in the head"
        if any(x is None or not math.isfinite(x) or x > HEAD_MASS_TOLERANCE for x in head_lp):
            return f"position {t}: a head log-prob is not finite and <= 0"
        if _logsumexp(head_lp) > HEAD_MASS_TOLERANCE:
            return f"position {t}: the head's probabilities sum to more than 1"
        if not support.contains(kept, sampled, head, vocab).all():
            return f"position {t}: a sampled id is outside the recorded support"
        if not support.contains(kept, head, head, vocab).all():
            return f"position {t}: a head id is outside the recorded support"
    return None


def _json_or_text(value: object) -> object:
    """A rejected record's value as JSON holds it, or its text (a hostile record's odd types)."""
    try:
        return json_value(value)
    except TypeError:
        return str(value)


def split_valid(
    calls: list[dict], trajectories: list[dict], table: str = "calls"
) -> tuple[list[dict], list[dict], list[dict]]:
    """(valid calls, valid trajectories, reject rows). A trajectory is valid when it has a reward,
    all its calls are valid, their count matches `n_calls`, their completion tokens add up to
    `n_completion_tokens` (its usage) and no two share a call index."""
    by_traj: dict[str, list[dict]] = defaultdict(list)
    for c in calls:
        by_traj[c["trajectory_id"]].append(c)
    now = datetime.now(UTC)
    good_calls, good_trajs, rejects = [], [], []

    def reject(kind: str, record_id: str, reason: str, record: dict, round_: int) -> None:
        rejects.append(
            {
                "table_name": kind,
                "round": round_,
                "record_id": record_id,
                "reason": reason,
                "record_json": json.dumps(record, default=_json_or_text),
                "rejected_at": now,
            }
        )

    known = {t["trajectory_id"] for t in trajectories}
    for tid, cs in by_traj.items():
        if tid not in known:
            for c in cs:
                reject(table, c["call_id"], "call of an unknown trajectory", c, c["round"])
    for t in trajectories:
        cs = by_traj.get(t["trajectory_id"], [])
        problems = {c["call_id"]: p for c in cs if (p := call_problem(c))}
        reason = None
        if t.get("reward") is None or not math.isfinite(t["reward"]):
            reason = "no finite reward"
        elif problems:  # before the checks below, which count on well-formed calls
            reason = "invalid call: " + next(iter(problems.values()))
        elif len(cs) != t["n_calls"]:
            reason = f"n_calls {t['n_calls']} but {len(cs)} calls recorded"
        elif t.get("n_completion_tokens") is not None and t["n_completion_tokens"] != (
            tokens := sum(len(c.get("completion_token_ids") or []) for c in cs)
        ):
            reason = f"usage says {t['n_completion_tokens']} completion tokens but the calls hold {tokens}"
        elif len({c.get("call_index") for c in cs}) != len(cs):
            reason = "two calls share a call_index"
        if reason is None:
            good_trajs.append(t)
            good_calls.extend(cs)
            continue
        reject("trajectories", t["trajectory_id"], reason, t, t["round"])
        for c in cs:
            reject(
                table, c["call_id"], problems.get(c["call_id"], "its trajectory was rejected"), c, c["round"]
            )
    return good_calls, good_trajs, rejects


def prefix_continuity(calls: list[dict]) -> tuple[int, int]:
    """(calls whose prompt ids extend the previous call's prompt + completion exactly, calls after
    a trajectory's first). A break means the client re-sent the conversation as text that
    tokenizes differently from what was served (the retokenization drift the record avoids)."""
    by_traj: dict[str, list[dict]] = defaultdict(list)
    for c in calls:
        by_traj[c["trajectory_id"]].append(c)
    extending = later = 0
    for cs in by_traj.values():
        cs.sort(key=lambda c: c["call_index"])
        for prev, c in itertools.pairwise(cs):
            served = list(prev["prompt_token_ids"]) + list(prev["completion_token_ids"])
            later += 1
            extending += list(c["prompt_token_ids"][: len(served)]) == served
    return extending, later
