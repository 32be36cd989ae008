"""Training resumed inside a round from its saved state equals the uninterrupted round, bit for bit."""

import copy

import pytest
import torch

from prodrl_pipeline.rl.recorded import RecordedCalls
from prodrl_pipeline.rl.resume import clear_state, load_state, save_state
from prodrl_pipeline.rl.trainer import TrainerConfig, make_optimizer, policy_logprobs, train_round
from tests.rl.test_trainer import _advantages


class Killed(Exception):
    pass


def test_a_round_resumed_from_its_saved_state_is_bit_identical(tiny_model, recorded, columns, tmp_path):
    adv = _advantages(recorded, batch_size=2)[:6]  # 3 minibatches
    cfg = TrainerConfig(steps=3, batch_size=2, lr=1e-2, warmup_steps=0)
    fingerprint = {"parent_id": "base", "trainer": "cfg"}
    straight = copy.deepcopy(tiny_model)
    opt = make_optimizer(straight, cfg, None)
    pi_k = policy_logprobs(straight, columns, cfg, 0, fake_quant=False)
    expected = train_round(straight, opt, columns, adv, cfg, pad_id=0, round_start=pi_k)

    def save_then_die(done: int, rows: list[dict]) -> None:
        save_state(tmp_path / "partial", model, opt, done, rows, fingerprint)
        if done == 2:
            raise Killed

    model = copy.deepcopy(tiny_model)
    opt = make_optimizer(model, cfg, None)
    with pytest.raises(Killed):
        train_round(model, opt, columns, adv, cfg, pad_id=0, round_start=pi_k, after_step=save_then_die)
    assert load_state(tmp_path / "partial", {**fingerprint, "trainer": "other"}) is None  # another round's
    state = load_state(tmp_path / "partial", fingerprint)
    assert state.cursor == 2 and [r["step"] for r in state.rows] == [1, 2]
    model = copy.deepcopy(tiny_model)  # a fresh process: the parent, then the saved state
    opt = make_optimizer(model, cfg, None)
    model.load_state_dict(state.model)
    opt.load_state_dict(state.optimizer)
    rest = train_round(model, opt, columns, adv, cfg, pad_id=0, round_start=pi_k, start_minibatch=2)
    assert [r["step"] for r in state.rows + rest] == [1, 2, 3]
    assert [r["loss"] for r in state.rows + rest] == [r["loss"] for r in expected]
    for a, b in zip(model.parameters(), straight.parameters(), strict=True):
        assert torch.equal(a, b)
    clear_state(tmp_path / "partial")
    assert load_state(tmp_path / "partial", fingerprint) is None


def test_the_data_digest_sees_every_trained_field_and_nothing_else():
    from prodrl_pipeline.rl.resume import data_digest
    from tests.records.test_validate import _call

    def digest(calls, adv):
        return data_digest(RecordedCalls.from_rows(calls), adv)

    calls = [_call("a"), _call("b")]
    adv = [
        {"trajectory_id": "a", "minibatch": 0, "advantage": 0.5},
        {"trajectory_id": "b", "minibatch": 0, "advantage": -0.5},
    ]
    base = digest(calls, adv)
    assert len(base) == 64 and digest(calls[::-1], adv[::-1]) == base  # the order of rows is irrelevant
    untrained = {"created_at": None, "finish_reason": "length", "messages_json": "[1]", "round": 2}
    for field, value in untrained.items():  # neither wall clock nor what the trainer does not read
        assert digest([{**calls[0], field: value}, calls[1]], adv) == base, field
    changed_calls = {
        "call_id": "a-9",
        "trajectory_id": "z",
        "call_index": 1,
        "prompt_token_ids": [1, 2, 4],
        "completion_token_ids": [4, 6],
        "completion_logprobs": [-0.5, -1e-9],
        "topk_token_ids": [[6, 4], [5]],
        "topk_logprobs": [[-0.5, -1.5], [0.0]],
        "support_size": [3, 2],
        "support_token_ids": [[4, 6, 8], []],
        "extra_token_ids": [[4], [5]],
        "vocab_size": 11,
        "sampling": {"temperature": 0.5},
    }
    for field, value in changed_calls.items():
        assert digest([{**calls[0], field: value}, calls[1]], adv) != base, field
    biased = {"temperature": 1.0, "logit_bias": [{"token_id": 4, "bias": 1.0}]}
    assert digest([{**calls[0], "sampling": biased}, calls[1]], adv) != base
    for field, value in {"trajectory_id": "c", "minibatch": 1, "advantage": 0.25}.items():
        assert digest(calls, [{**adv[0], field: value}, adv[1]]) != base, field
    assert digest(calls[:1], adv) != base and digest(calls, adv[:1]) != base
    # the same values moved between calls: each list keeps its own length in the digest
    moved = [{**calls[0], "prompt_token_ids": [1, 2]}, {**calls[1], "prompt_token_ids": [3, 1, 2, 3]}]
    assert digest(moved, adv) != base


def test_an_unreadable_or_partial_state_is_ignored(tiny_model, tmp_path):
    cfg = TrainerConfig(steps=1, batch_size=2)
    opt = make_optimizer(tiny_model, cfg, None)
    rows = [{"step": 1, "loss": 0.25}]
    save_state(tmp_path / "s", tiny_model, opt, 1, rows, {"parent": "base"})
    state = load_state(tmp_path / "s", {"parent": "base"})
    assert state.cursor == 1 and state.rows == rows
    assert all(torch.equal(state.model[k], v) for k, v in tiny_model.state_dict().items())
    assert state.optimizer["param_groups"][0]["lr"] == opt.param_groups[0]["lr"]

    data = (tmp_path / "s" / "state.pt").read_bytes()
    (tmp_path / "s" / "state.pt").write_bytes(data[: len(data) // 2])  # truncated by a crash
    assert load_state(tmp_path / "s", {"parent": "base"}) is None
    (tmp_path / "s" / "resume.json").write_text('{"cursor": 1')  # a torn meta file
    assert load_state(tmp_path / "s", {"parent": "base"}) is None
    (tmp_path / "s" / "resume.json").write_text('{"cursor": 1, "rows": []}')  # no fingerprint
    assert load_state(tmp_path / "s", {"parent": "base"}) is None
    assert load_state(tmp_path / "missing", {"parent": "base"}) is None


def test_a_state_holding_anything_but_tensors_is_refused_unread_and_clearing_is_idempotent(
    tiny_model, tmp_path
):
    import datetime
    from pathlib import Path

    cfg = TrainerConfig(steps=1, batch_size=2)
    opt = make_optimizer(tiny_model, cfg, None)
    rows = [{"step": 1, "at": datetime.datetime(2026, 12, 1, tzinfo=datetime.UTC)}]
    fingerprint = {"parent": Path("/ckpt/base"), "trainer": {"lr": 1e-3}}  # not JSON types: kept as text
    save_state(tmp_path / "s", tiny_model, opt, 1, rows, fingerprint)
    state = load_state(tmp_path / "s", {"parent": Path("/ckpt/base"), "trainer": {"lr": 1e-3}})
    assert state.rows == [{"step": 1, "at": "2026-12-01 00:00:00+00:00"}]
    assert load_state(tmp_path / "s", {"parent": Path("/ckpt/other"), "trainer": {"lr": 1e-3}}) is None
    torch.save(
        {"model": {"w": torch.zeros(1)}, "optimizer": Killed()}, tmp_path / "s" / "state.pt"
    )  # a pickle
    assert load_state(tmp_path / "s", fingerprint) is None
    clear_state(tmp_path / "s")
    assert not (tmp_path / "s").exists()
    clear_state(tmp_path / "s")  # nothing left to clear is not an error
