from datetime import UTC, datetime

from prodrl_pipeline.records.validate import prefix_continuity, split_valid

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
    assert "call_index" in rejected_trajs["same index"]
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


def test_prefix_continuity_counts_later_calls_that_extend_what_was_served():
    first = _call("t", prompt_token_ids=[1, 2], completion_token_ids=[3, 4])
    kept = _call("t", call_index=1, prompt_token_ids=[1, 2, 3, 4, 9], completion_token_ids=[5])
    # the client re-sent the conversation as text that tokenized differently: [3, 4] became [7]
    broken = _call("t", call_index=2, prompt_token_ids=[1, 2, 7, 9, 5, 8], completion_token_ids=[6])
    single = _call("u")
    assert prefix_continuity([broken, single, first, kept]) == (1, 2)  # order of arrival is irrelevant
    assert prefix_continuity([single]) == (0, 0)
