"""Training resumed inside a round from its saved state equals the uninterrupted round, bit for bit."""

import copy

import pytest
import torch

from prodrl_pipeline.rl.resume import clear_state, load_state, save_state
from prodrl_pipeline.rl.trainer import TrainerConfig, make_optimizer, policy_logprobs, train_round
from tests.rl.test_trainer import _advantages


class Killed(Exception):
    pass


def test_a_round_resumed_from_its_saved_state_is_bit_identical(tiny_model, recorded, tmp_path):
    adv = _advantages(recorded, batch_size=2)[:6]  # 3 minibatches
    cfg = TrainerConfig(steps=3, batch_size=2, lr=1e-2, warmup_steps=0)
    fingerprint = {"parent_id": "base", "trainer": "cfg"}
    straight = copy.deepcopy(tiny_model)
    opt = make_optimizer(straight, cfg, None)
    pi_k = policy_logprobs(straight, recorded.calls, cfg, 0, fake_quant=False)
    expected = train_round(straight, opt, recorded.calls, adv, cfg, pad_id=0, round_start=pi_k)

    def save_then_die(done: int, rows: list[dict]) -> None:
        save_state(tmp_path / "partial", model, opt, done, rows, fingerprint)
        if done == 2:
            raise Killed

    model = copy.deepcopy(tiny_model)
    opt = make_optimizer(model, cfg, None)
    with pytest.raises(Killed):
        train_round(
            model, opt, recorded.calls, adv, cfg, pad_id=0, round_start=pi_k, after_step=save_then_die
        )
    assert load_state(tmp_path / "partial", {**fingerprint, "trainer": "other"}) is None  # another round's
    state = load_state(tmp_path / "partial", fingerprint)
    assert state.cursor == 2 and [r["step"] for r in state.rows] == [1, 2]
    model = copy.deepcopy(tiny_model)  # a fresh process: the parent, then the saved state
    opt = make_optimizer(model, cfg, None)
    model.load_state_dict(state.model)
    opt.load_state_dict(state.optimizer)
    rest = train_round(model, opt, recorded.calls, adv, cfg, pad_id=0, round_start=pi_k, start_minibatch=2)
    assert [r["step"] for r in state.rows + rest] == [1, 2, 3]
    assert [r["loss"] for r in state.rows + rest] == [r["loss"] for r in expected]
    for a, b in zip(model.parameters(), straight.parameters(), strict=True):
        assert torch.equal(a, b)
    clear_state(tmp_path / "partial")
    assert load_state(tmp_path / "partial", fingerprint) is None
