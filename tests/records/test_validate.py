import json
from datetime import UTC, datetime

import numpy as np
import pytest

from prodrl_pipeline.records.support import Form
from prodrl_pipeline.records.validate import call_problem, prefix_continuity, split_valid

NOW = datetime(2026, 11, 30, tzinfo=UTC)


def _call(tid: str, **over) -> dict:
    call = {
        "call_id": f"{tid}-0",
        "trajectory_id": tid,
        "call_index": 0,
        "round": 1,
        "deployment_id": "d",
        "prompt_token_ids": [1, 2, 3],
        "completion_token_ids": [4, 5],
        "completion_logprobs": [-0.5, 0.0],
        "topk_token_ids": [[4, 6], [5]],
        "topk_logprobs": [[-0.5, -1.0], [0.0]],
        "support_size": [3, 1],
        "support_token_ids": [[4, 6, 7], []],
        "vocab_size": 10,
        "sampling": {"temperature": 1.0, "top_p": 1.0, "top_k": 0, "max_tokens": 8, "seed": 0},
        "finish_reason": "stop",
        "messages_json": "[]",
        "created_at": NOW,
    }
    return {**call, **over}


def _traj(tid: str, **over) -> dict:
    t = {
        "trajectory_id": tid,
        "round": 1,
        "deployment_id": "d",
        "task_id": "p",
        "reward": 1.0,
        "n_calls": 1,
        "n_completion_tokens": 2,
        "started_at": NOW,
        "finished_at": NOW,
        "source": "lab",
    }
    return {**t, **over}


BAD = {
    "lengths": _call("b1", completion_logprobs=[-0.5]),
    "id range": _call("b2", completion_token_ids=[4, 10]),
    "positive logprob": _call("b3", completion_logprobs=[0.5, 0.0]),
    "nan logprob": _call("b4", completion_logprobs=[float("nan"), 0.0]),
    "support missing": _call("b5", support_token_ids=[[], []]),
    "outside support": _call("b6", completion_token_ids=[8, 5]),
    "greedy": _call(
        "b7", sampling={"temperature": 0.0, "top_p": 1.0, "top_k": 0, "max_tokens": 8, "seed": 0}
    ),
    "head outside support": _call("b8", topk_token_ids=[[4, 8], [5]]),
    "head -inf": _call("b9", topk_logprobs=[[-0.5, float("-inf")], [0.0]]),
    "head mass > 1": _call("b10", topk_logprobs=[[-0.5, -0.2], [0.0]]),
    # unrestricted support (size = vocab): nothing but the vocabulary bounds the head's ids
    "head id >= vocab": _call("b11", topk_token_ids=[[4, 99], [5]], support_size=[10, 1]),
    "negative head id": _call("b12", topk_token_ids=[[4, -3], [5]], support_size=[10, 1]),
    "support id >= vocab": _call("b13", support_token_ids=[[4, 6, 99], []]),
    "repeated head id": _call("b14", topk_token_ids=[[4, 4], [5]], topk_logprobs=[[-0.9, -0.9], [0.0]]),
    "repeated support id": _call("b15", support_token_ids=[[4, 6, 6], []]),
    "prompt id >= vocab": _call("b17", prompt_token_ids=[1, 10, 3]),
    "negative prompt id": _call("b18", prompt_token_ids=[1, -1, 3]),
    "bias id >= vocab": _call(
        "b16",
        sampling={"temperature": 1.0, "top_p": 1.0, "top_k": 0, "max_tokens": 8, "seed": 0}
        | {"logit_bias": [{"token_id": 10, "bias": 1.0}]},
    ),
}


def test_good_records_pass_and_each_broken_rule_is_rejected_with_its_reason():
    calls = [_call("g")] + list(BAD.values())
    trajs = [_traj("g")] + [_traj(c["trajectory_id"]) for c in BAD.values()]
    trajs.append(_traj("unscored", reward=None))
    trajs.append(_traj("miscounted", n_calls=2))
    calls.append(_call("miscounted"))
    trajs.append(_traj("usage", n_completion_tokens=3))  # its usage disagrees with its token columns
    calls.append(_call("usage"))
    trajs.append(_traj("same index", n_calls=2, n_completion_tokens=4))
    calls += [_call("same index"), _call("same index", call_id="same index-1")]
    good_calls, good_trajs, rejects = split_valid(calls, trajs)
    assert [c["call_id"] for c in good_calls] == ["g-0"]
    assert [t["trajectory_id"] for t in good_trajs] == ["g"]
    rejected_trajs = {r["record_id"]: r["reason"] for r in rejects if r["table_name"] == "trajectories"}
    assert set(rejected_trajs) == {c["trajectory_id"] for c in BAD.values()} | {
        "unscored",
        "miscounted",
        "usage",
        "same index",
    }
    assert "usage says 3 completion tokens but the calls hold 2" in rejected_trajs["usage"]
    assert rejected_trajs["same index"] == "two calls share a call_index"
    assert "reward" in rejected_trajs["unscored"] and "n_calls" in rejected_trajs["miscounted"]
    assert "support" in rejected_trajs["b5"] and "outside" in rejected_trajs["b6"]
    assert "greedy" in rejected_trajs["b7"]
    assert "head id is outside" in rejected_trajs["b8"] and "head log-prob" in rejected_trajs["b9"]
    assert "sum to more than 1" in rejected_trajs["b10"]
    assert all("outside [0, 10)" in rejected_trajs[b] for b in ("b11", "b12", "b13"))
    assert all("repeated ids" in rejected_trajs[b] for b in ("b14", "b15"))
    assert all("token id outside [0, 10)" in rejected_trajs[b] for b in ("b2", "b17", "b18"))
    # every call of a rejected trajectory is rejected too: nothing of it is trained on
    assert {r["record_id"] for r in rejects if r["table_name"] == "calls"} == {
        c["call_id"] for c in calls if c["trajectory_id"] != "g"
    }


def _as_engine_records(call: dict, ids=np.int64, logprobs=np.float32) -> dict:
    """`call` with its per-position lists as the engine records them: one 1-D array a position."""
    arrays = {"topk_token_ids": ids, "support_token_ids": ids, "topk_logprobs": logprobs}
    return {**call, **{name: [np.array(x, dtype=t) for x in call[name]] for name, t in arrays.items()}}


def test_the_engine_s_per_position_arrays_are_held_to_the_same_rules_as_lists():
    """A call as the lab's engine records it (arrays, engine/rows.py) passes or fails exactly as
    its lists do; ids that are not integers, and arrays of more than one dimension, are refused."""
    good = _as_engine_records(_call("g"))
    bad = [_as_engine_records(c) for c in BAD.values() if isinstance(c["topk_token_ids"][0], list)]
    floats = _as_engine_records(_call("f"), ids=np.float64)
    square = {**_call("s"), "topk_token_ids": [np.array([[4, 6]]), np.array([[5]])]}
    calls = [good, *bad, floats, square]
    trajs = [_traj(c["trajectory_id"]) for c in calls]
    good_calls, _, rejects = split_valid(calls, trajs)
    assert [c["call_id"] for c in good_calls] == ["g-0"]
    reasons = {r["record_id"]: r["reason"] for r in rejects if r["table_name"] == "trajectories"}
    lists = {r["record_id"]: r["reason"] for r in split_valid(list(BAD.values()), trajs)[2]}
    assert all(reasons[c["trajectory_id"]] == lists[c["trajectory_id"]] for c in bad)
    assert "topk_token_ids is not a list of lists of integers" in reasons["f"]
    assert "topk_token_ids is not a list of lists of integers" in reasons["s"]
    stored = next(r for r in rejects if r["record_id"] == "f-0")  # the arrays written as JSON lists
    assert json.loads(stored["record_json"])["topk_token_ids"] == [[4.0, 6.0], [5.0]]


def test_a_head_near_the_mass_bound_gets_one_verdict_as_a_list_and_as_a_float32_array():
    """The head's log-mass is summed in float64 whatever holds it: heads of float32 values whose
    mass lies within float32 rounding of the bound, as lists and as the engine's arrays."""
    rng = np.random.default_rng(0)
    verdicts = []
    for _ in range(300):
        x = rng.normal(size=5) * 2
        x = (x - np.log(np.exp(x).sum()) + 1e-4 + rng.normal() * 2e-7).astype(np.float32)
        head = {
            "topk_token_ids": [[4, 0, 1, 2, 3], [5]],
            "support_size": [10, 1],
            "support_token_ids": [[], []],
        }
        as_list = _call("l", **head, topk_logprobs=[x.tolist(), [0.0]])
        as_array = _as_engine_records(as_list)
        verdicts.append((call_problem(as_list), call_problem(as_array)))
    assert all(a == b for a, b in verdicts)
    assert {a is None for a, _ in verdicts} == {True, False}  # both sides of the bound were met


def test_per_call_columns_take_lists_only():
    """Only a position's head, support and extra samples may be arrays: a per-call column that is
    one (whose `+` would add elementwise) is refused, whatever its length."""
    for prompt in (np.array([3]), np.array([12]), np.array([1, 2])):
        assert (
            call_problem(_call("a", prompt_token_ids=prompt)) == "prompt_token_ids is not a list of integers"
        )
    swapped = _as_engine_records(_call("b"), ids=np.dtype(">i8"))  # Arrow takes no byte-swapped array
    assert call_problem(swapped) == "topk_token_ids is not a list of lists of integers"


def test_prefix_continuity_counts_later_calls_that_extend_what_was_served():
    first = _call("t", prompt_token_ids=[1, 2], completion_token_ids=[3, 4])
    kept = _call("t", call_index=1, prompt_token_ids=[1, 2, 3, 4, 9], completion_token_ids=[5])
    # the client re-sent the conversation as text that tokenized differently: [3, 4] became [7]
    broken = _call("t", call_index=2, prompt_token_ids=[1, 2, 7, 9, 5, 8], completion_token_ids=[6])
    single = _call("u")
    assert prefix_continuity([broken, single, first, kept]) == (1, 2)  # order of arrival is irrelevant
    assert prefix_continuity([single]) == (0, 0)
    again = _call("v", prompt_token_ids=[1], completion_token_ids=[2])
    grown = _call("v", call_index=1, prompt_token_ids=[1, 2, 3], completion_token_ids=[4])
    assert prefix_continuity([first, kept, broken, again, grown]) == (2, 3)


SAMPLING = {"temperature": 1.0, "top_p": 1.0, "top_k": 0, "max_tokens": 8, "seed": 0}
PER_POSITION_LENGTHS = (
    "{'completion_logprobs': 1, 'topk_token_ids': 2, 'topk_logprobs': 2, "
    "'support_size': 2, 'support_token_ids': 2}"
)


SAMPLING_SHAPE = "sampling is not a record with numeric temperature, top_p, top_k and logit_bias entries"


def _bias(token, bias) -> dict:
    return {"sampling": SAMPLING | {"logit_bias": [{"token_id": token, "bias": bias}]}}


def _formed(form: Form, ids: list[int] = (), mask: bytes = b"", **over) -> dict:
    """The sound call with its first position's support ({4, 6, 7} of V = 10) recorded in `form`."""
    return {
        "support_form": [form, Form.HEAD],
        "support_token_ids": [list(ids), []],
        "support_mask": [mask, b""],
        **over,
    }


KEPT_MASK = b"\xd0\x00"  # bits 4, 6 and 7 of V = 10
GRAMMAR = {
    "grammar": "start: /[a-z]+/",
    "tokenizer_sha256": "0" * 64,
    "eos_id": 2,
    "library": "llguidance 1.9.1",
}
"""A grammar record's shape (whether it replays is the trainer's reader's check: records/grammar_masks.py)."""
KEPT_COMPLEMENT = [0, 1, 2, 3, 5, 8, 9]
# (what breaks, the edit to the sound call, the exact reason its rejection must give)
RULES = [
    # the support's forms (records/support.py)
    (
        "unknown form",
        _formed(6),
        "position 0: support form 6 is not one this reader knows "
        "(VOCABULARY, HEAD, IDS, COMPLEMENT, BITMASK, GRAMMAR)",
    ),
    (
        "GRAMMAR form in a call that recorded no grammar",
        _formed(Form.GRAMMAR),
        "position 0: a GRAMMAR support in a call that recorded no grammar",
    ),
    (
        "GRAMMAR form carrying ids",
        _formed(Form.GRAMMAR, [4, 6, 7], grammar=GRAMMAR),
        "position 0: a GRAMMAR support carries a payload of another form",
    ),
    (
        "GRAMMAR form no larger than the head",
        _formed(Form.GRAMMAR, support_size=[2, 1], grammar=GRAMMAR),
        "position 0: a GRAMMAR support of size 2 beside a head of 2 in a vocabulary of 10",
    ),
    (
        "grammar record without its library",
        {"grammar": {k: v for k, v in GRAMMAR.items() if k != "library"}},
        "grammar is not a record of grammar, tokenizer_sha256 and library strings and an eos_id",
    ),
    (
        "VOCABULARY form of a restricted support",
        _formed(Form.VOCABULARY),
        "position 0: a VOCABULARY support of size 3 in a vocabulary of 10",
    ),
    (
        "HEAD form of a support larger than the head",
        _formed(Form.HEAD),
        "position 0: a HEAD support of size 3 beside a head of 2",
    ),
    (
        "HEAD form carrying ids",
        _formed(Form.IDS, [4, 6, 7], support_token_ids=[[4, 6, 7], [5]]),
        "position 1: a HEAD support carries a payload of another form",
    ),
    (
        "IDS form carrying a mask too",
        _formed(Form.IDS, [4, 6, 7], KEPT_MASK),
        "position 0: a IDS support carries a payload of another form",
    ),
    (
        "unsorted ids",
        _formed(Form.IDS, [4, 7, 6]),
        "position 0: support ids are not in ascending order",
    ),
    ("repeated ids", _formed(Form.IDS, [4, 6, 6]), "position 0: repeated ids in the support"),
    ("id = V", _formed(Form.IDS, [4, 6, 10]), "position 0: a support id is outside [0, 10)"),
    ("negative id", _formed(Form.IDS, [-1, 4, 6]), "position 0: a support id is outside [0, 10)"),
    (
        "ids short",
        _formed(Form.IDS, [4, 6]),
        "position 0: restricted support of 3 tokens is not recorded (IDS: 2 ids)",
    ),
    (
        "complement short",
        _formed(Form.COMPLEMENT, KEPT_COMPLEMENT[1:]),
        "position 0: restricted support of 3 tokens is not recorded (COMPLEMENT: 6 ids)",
    ),
    (
        "unsorted complement",
        _formed(Form.COMPLEMENT, [0, 1, 2, 3, 5, 9, 8]),
        "position 0: support ids are not in ascending order",
    ),
    (
        "repeated complement id",
        _formed(Form.COMPLEMENT, [0, 1, 2, 3, 5, 8, 8]),
        "position 0: repeated ids in the support",
    ),
    (
        "complement id = V",
        _formed(Form.COMPLEMENT, [0, 1, 2, 3, 5, 8, 10]),
        "position 0: a support id is outside [0, 10)",
    ),
    (
        "negative complement id",
        _formed(Form.COMPLEMENT, [-1, 0, 1, 2, 3, 5, 8]),
        "position 0: a support id is outside [0, 10)",
    ),
    (
        "sampled id in the complement",
        _formed(Form.COMPLEMENT, KEPT_COMPLEMENT, completion_token_ids=[8, 5]),
        "position 0: a sampled id is outside the recorded support",
    ),
    (
        "head id in the complement",
        _formed(Form.COMPLEMENT, [0, 1, 2, 3, 5, 6, 8], completion_token_ids=[4, 5]),
        "position 0: a head id is outside the recorded support",
    ),
    (
        "bitmask a byte short",
        _formed(Form.BITMASK, mask=b"\xd0"),
        "position 0: support bitmask of 1 bytes, not 2 (V = 10)",
    ),
    (
        "bitmask a byte long",
        _formed(Form.BITMASK, mask=KEPT_MASK + b"\x00"),
        "position 0: support bitmask of 3 bytes, not 2 (V = 10)",
    ),
    (
        "bitmask popcount above the size",
        _formed(Form.BITMASK, mask=b"\xd1\x00"),
        "position 0: support bitmask keeps 4 ids, not support_size 3",
    ),
    (
        "bitmask popcount below the size",
        _formed(Form.BITMASK, mask=b"\x50\x00"),
        "position 0: support bitmask keeps 2 ids, not support_size 3",
    ),
    (
        "bitmask bit past V",
        _formed(Form.BITMASK, mask=b"\x50\x04"),  # bits 4, 6 and 10
        "position 0: support bitmask sets bits past the vocabulary",
    ),
    (
        "sampled id outside the bitmask",
        _formed(Form.BITMASK, mask=KEPT_MASK, completion_token_ids=[8, 5]),
        "position 0: a sampled id is outside the recorded support",
    ),
    (
        "extra sample outside the bitmask",
        _formed(Form.BITMASK, mask=KEPT_MASK, extra_token_ids=[[9], [5]]),
        "position 0: a sampled id is outside the recorded support",
    ),
    (
        "head id outside the bitmask",
        _formed(Form.BITMASK, mask=b"\xc1\x00", completion_token_ids=[6, 5]),  # 0, 6, 7: not the head's 4
        "position 0: a head id is outside the recorded support",
    ),
    (
        "form list short",
        _formed(Form.IDS, [4, 6, 7], support_form=[Form.IDS]),
        "per-position columns disagree with 2 completion ids: {'completion_logprobs': 2, "
        "'topk_token_ids': 2, 'topk_logprobs': 2, 'support_size': 2, 'support_token_ids': 2, "
        "'support_form': 1, 'support_mask': 2}",
    ),
    (
        "mask not bytes",
        _formed(Form.BITMASK, support_mask=["0xd0", b""]),
        "support_mask is not a list of byte strings",
    ),
    ("prompt not ints", {"prompt_token_ids": "1 2 3"}, "prompt_token_ids is not a list of integers"),
    ("bool id", {"completion_token_ids": [4, True]}, "completion_token_ids is not a list of integers"),
    ("float size", {"support_size": [3, 1.0]}, "support_size is not a list of integers"),
    ("scalar head", {"topk_token_ids": [[4, 6], 5]}, "topk_token_ids is not a list of lists of integers"),
    (
        "float support",
        {"support_token_ids": [[4, 6, 7.0], []]},
        "support_token_ids is not a list of lists of integers",
    ),
    ("text extra", {"extra_token_ids": [[4], "5"]}, "extra_token_ids is not a list of lists of integers"),
    ("text logprob", {"completion_logprobs": [-0.5, "0"]}, "completion_logprobs is not a list of numbers"),
    ("bool logprob", {"completion_logprobs": [-0.5, False]}, "completion_logprobs is not a list of numbers"),
    (
        "scalar head lp",
        {"topk_logprobs": [[-0.5, -1.0], 0]},
        "topk_logprobs is not a list of lists of numbers",
    ),
    ("text vocab", {"vocab_size": "10"}, "vocab_size is not an integer"),
    (
        "text temperature",
        {"sampling": {"temperature": "1"}},
        SAMPLING_SHAPE,
    ),
    ("sampling not a record", {"sampling": [1.0]}, SAMPLING_SHAPE),
    ("empty prompt", {"prompt_token_ids": []}, "empty prompt or completion"),
    ("empty completion", {"completion_token_ids": []}, "empty prompt or completion"),
    (
        "short column",
        {"completion_logprobs": [-0.5]},
        f"per-position columns disagree with 2 completion ids: {PER_POSITION_LENGTHS}",
    ),
    ("prompt id = V", {"prompt_token_ids": [1, 10]}, "token id outside [0, 10)"),
    ("negative completion id", {"completion_token_ids": [-1, 5]}, "token id outside [0, 10)"),
    (
        "greedy",
        {"sampling": SAMPLING | {"temperature": 0.0}},
        "no sampling temperature > 0: a greedy call has no sampling distribution to train on",
    ),
    (
        "no sampling",
        {"sampling": None},
        "no sampling temperature > 0: a greedy call has no sampling distribution to train on",
    ),
    *[
        (
            f"bias {t}:{b}",
            _bias(t, b),
            f"logit_bias entry {{'token_id': {t}, 'bias': {b}}} "
            "is not a vocabulary id with a bias in [-100, 100]",
        )
        for t, b in [(10, 1.0), (-1, 1.0), (3, None), (3, 100.5), (3, -100.5)]
    ],
    ("bias without an id", _bias(None, 1.0), SAMPLING_SHAPE),
    ("bias id as text", _bias("3", 1.0), SAMPLING_SHAPE),
    ("bias entry not a record", {"sampling": SAMPLING | {"logit_bias": [None]}}, SAMPLING_SHAPE),
    ("bias entry a number", {"sampling": SAMPLING | {"logit_bias": [3]}}, SAMPLING_SHAPE),
    ("text top_p", {"sampling": SAMPLING | {"top_p": "0.9"}}, SAMPLING_SHAPE),
    ("text top_k", {"sampling": SAMPLING | {"top_k": "5"}}, SAMPLING_SHAPE),
    ("text bias", _bias(3, "1"), SAMPLING_SHAPE),
    ("no vocabulary size", {"vocab_size": None}, "token id outside [0, 0)"),
    *[
        (
            f"temperature {t}",
            {"sampling": SAMPLING | {"temperature": t}},
            "no sampling temperature > 0: a greedy call has no sampling distribution to train on",
        )
        for t in (float("nan"), float("inf"), -1.0)
    ],
    ("top_p 0", {"sampling": SAMPLING | {"top_p": 0.0}}, "sampling top_p 0.0 outside (0, 1] or top_k 0 < 0"),
    (
        "top_p > 1",
        {"sampling": SAMPLING | {"top_p": 1.5}},
        "sampling top_p 1.5 outside (0, 1] or top_k 0 < 0",
    ),
    (
        "top_k < 0",
        {"sampling": SAMPLING | {"top_k": -1}},
        "sampling top_p 1.0 outside (0, 1] or top_k -1 < 0",
    ),
    (
        "null head log-probs",
        {"topk_logprobs": [None, [0.0]]},
        "topk_logprobs is not a list of lists of numbers",
    ),
    (
        "null support",
        {"support_token_ids": [[4, 6, 7], None]},
        "support_token_ids is not a list of lists of integers",
    ),
    ("null extra", {"extra_token_ids": [None, [5]]}, "extra_token_ids is not a list of lists of integers"),
    # the head holds the whole support (size <= K): the trainer trains over the head, whatever
    # support list came with it, so a sampled id outside the head is outside the support
    (
        "sampled outside a head that holds the support",
        {"completion_token_ids": [7, 5], "support_size": [2, 1], "completion_logprobs": [-2.0, 0.0]},
        "position 0: a sampled id is outside the recorded support",
    ),
    ("extra at one position", {"extra_token_ids": [[4]]}, "extra samples recorded for 1 of 2 positions"),
    (
        "ragged extra",
        {"extra_token_ids": [[4], [5, 5]]},
        "positions recorded different numbers of extra samples",
    ),
    (
        "positive logprob",
        {"completion_logprobs": [0.5, 0.0]},
        "position 0: log-prob 0.5 is not finite and <= 0",
    ),
    (
        "null logprob",
        {"completion_logprobs": [-0.5, None]},
        "position 1: log-prob None is not finite and <= 0",
    ),
    (
        "inf logprob",
        {"completion_logprobs": [float("-inf"), 0.0]},
        "position 0: log-prob -inf is not finite and <= 0",
    ),
    (
        "empty head",
        {"topk_token_ids": [[4, 6], []], "topk_logprobs": [[-0.5, -1.0], []]},
        "position 1: empty head or head ids/log-probs of different lengths",
    ),
    (
        "head lengths",
        {"topk_logprobs": [[-0.5], [0.0]]},
        "position 0: empty head or head ids/log-probs of different lengths",
    ),
    ("size < head", {"support_size": [1, 1]}, "position 0: support size 1 outside [2, 10]"),
    ("size > V", {"support_size": [11, 1]}, "position 0: support size 11 outside [2, 10]"),
    (
        "support missing",
        {"support_token_ids": [[], []]},
        "position 0: restricted support of 3 tokens is not recorded (IDS: 0 ids)",
    ),
    (
        "support short",
        {"support_token_ids": [[4, 6], []]},
        "position 0: restricted support of 3 tokens is not recorded (IDS: 2 ids)",
    ),
    (
        "head id = V",
        {"topk_token_ids": [[4, 10], [5]], "support_size": [10, 1]},
        "position 0: a head or extra id is outside [0, 10)",
    ),
    (
        "extra id = V",
        {"extra_token_ids": [[10], [5]]},
        "position 0: a head or extra id is outside [0, 10)",
    ),
    (
        "negative support id",
        {"support_token_ids": [[4, 6, -1], []]},
        "position 0: a support id is outside [0, 10)",
    ),
    (
        "repeated support",
        {"support_token_ids": [[4, 6, 6], []]},
        "position 0: repeated ids in the support",
    ),
    (
        "repeated head",
        {"topk_token_ids": [[4, 4], [5]], "topk_logprobs": [[-0.9, -0.9], [0.0]]},
        "position 0: repeated ids in the head",
    ),
    (
        "head -inf",
        {"topk_logprobs": [[-0.5, float("-inf")], [0.0]]},
        "position 0: a head log-prob is not finite and <= 0",
    ),
    (
        "head null",
        {"topk_logprobs": [[-0.5, None], [0.0]]},
        "position 0: a head log-prob is not finite and <= 0",
    ),
    (
        "head lp > 0",
        {"topk_logprobs": [[-0.5, -1.0], [0.01]]},
        "position 1: a head log-prob is not finite and <= 0",
    ),
    (
        "head mass",
        {"topk_logprobs": [[-0.5, -0.2], [0.0]]},
        "position 0: the head's probabilities sum to more than 1",
    ),
    (
        "sampled outside support",
        {"completion_token_ids": [8, 5]},
        "position 0: a sampled id is outside the recorded support",
    ),
    (
        "sampled outside a whole head",
        {"completion_token_ids": [4, 6]},
        "position 1: a sampled id is outside the recorded support",
    ),
    (
        "extra outside support",
        {"extra_token_ids": [[8], [5]]},
        "position 0: a sampled id is outside the recorded support",
    ),
    (
        "extra outside a whole head",
        {"extra_token_ids": [[4], [6]]},
        "position 1: a sampled id is outside the recorded support",
    ),
    (
        "head outside support",
        {"topk_token_ids": [[4, 8], [5]]},
        "position 0: a head id is outside the recorded support",
    ),
]


@pytest.mark.parametrize(("edit", "reason"), [r[1:] for r in RULES], ids=[r[0] for r in RULES])
def test_each_contract_rule_rejects_with_its_exact_reason(edit, reason):
    bad = _call("bad") | edit
    kept_calls, kept_trajs, rejects = split_valid([bad], [_traj("bad")], table="landing_calls")
    assert kept_calls == [] and kept_trajs == []
    by_table = {r["table_name"]: r for r in rejects}
    assert by_table["landing_calls"]["reason"] == reason
    assert by_table["trajectories"]["reason"] == "invalid call: " + reason


SOUND_EDGES = [
    ("ids form", _formed(Form.IDS, [4, 6, 7])),
    ("complement form", _formed(Form.COMPLEMENT, KEPT_COMPLEMENT)),
    ("bitmask form", _formed(Form.BITMASK, mask=KEPT_MASK)),
    ("grammar form", _formed(Form.GRAMMAR, grammar=GRAMMAR)),
    ("bitmask of ids 0 and V-1", _formed(Form.BITMASK, mask=b"\x51\x02", support_size=[4, 1])),  # 0, 4, 6, 9
    ("legacy ids in any order", {"support_token_ids": [[7, 4, 6], []]}),
    (
        "ids 0 and V-1 everywhere",
        {
            "prompt_token_ids": [0, 9],
            "topk_token_ids": [[0, 9], [5]],
            "support_token_ids": [[0, 9, 4], []],
            "completion_token_ids": [0, 5],
        },
    ),
    ("unrestricted support needs no list", {"support_size": [10, 1], "support_token_ids": [[], []]}),
    (
        "a head as large as its support is the support",
        {"support_size": [2, 1], "support_token_ids": [[], []]},
    ),
    ("head log-prob at the float tolerance", {"topk_logprobs": [[-0.5, -1.0], [1e-4]]}),
    ("bias at -100 on id 0", _bias(0, -100)),
    ("bias at 100 on id V-1", _bias(9, 100)),
    ("extra samples inside the support", {"extra_token_ids": [[7], [5]]}),
]


@pytest.mark.parametrize("edit", [e for _, e in SOUND_EDGES], ids=[n for n, _ in SOUND_EDGES])
def test_sound_calls_at_the_edges_of_each_rule_are_kept(edit):
    call = _call("ok") | edit
    kept_calls, kept_trajs, rejects = split_valid([call], [_traj("ok")])
    assert rejects == [] and kept_calls == [call] and kept_trajs == [_traj("ok")]


def test_rejects_name_their_table_round_record_and_time():
    orphan = _call("orphan", round=4)
    bad = _call("bad", round=3, completion_logprobs=[0.5, 0.0])
    sibling = _call("bad", round=3, call_id="bad-1", call_index=1)
    trajs = [_traj("bad", round=3, n_calls=2, n_completion_tokens=4), _traj("nan", reward=float("nan"))]
    _, _, rejects = split_valid([orphan, bad, sibling, _call("nan")], trajs, table="landing_calls")
    rows = {(r["table_name"], r["record_id"]): r for r in rejects}
    assert set(rows) == {
        ("landing_calls", "orphan-0"),
        ("landing_calls", "bad-0"),
        ("landing_calls", "bad-1"),
        ("trajectories", "bad"),
        ("trajectories", "nan"),
        ("landing_calls", "nan-0"),
    }
    assert rows["landing_calls", "orphan-0"]["reason"] == "call of an unknown trajectory"
    assert rows["landing_calls", "orphan-0"]["round"] == 4 and rows["trajectories", "bad"]["round"] == 3
    assert rows["landing_calls", "bad-1"]["reason"] == "its trajectory was rejected"
    assert rows["trajectories", "nan"]["reason"] == "no finite reward"
    assert json.loads(rows["landing_calls", "bad-0"]["record_json"])["completion_logprobs"] == [0.5, 0.0]
    assert json.loads(rows["landing_calls", "orphan-0"]["record_json"])["call_id"] == "orphan-0"
    assert json.loads(rows["trajectories", "bad"]["record_json"])["n_calls"] == 2
    assert rows["landing_calls", "bad-1"]["round"] == 3
    stamps = {r["rejected_at"] for r in rejects}
    assert len(stamps) == 1 and next(iter(stamps)).tzinfo is not None


def test_usage_is_checked_only_when_reported():
    kept_calls, _, rejects = split_valid([_call("u")], [_traj("u", n_completion_tokens=None)])
    assert rejects == [] and len(kept_calls) == 1
