"""Data-parallel training (FSDP2, 2 gloo processes under torchrun) equals the single-process
trainer on the same round: the same per-step loss and metrics, the same parameters and Adam state."""

import copy
import json
import os
import signal
import subprocess
import sys

import pytest
import torch

from prodrl_pipeline.records.store import DeltaStore
from prodrl_pipeline.rl.checkpoint import load_checkpoint, save_checkpoint
from prodrl_pipeline.rl.distributed import DataParallel
from prodrl_pipeline.rl.logprobs import build_sequences
from prodrl_pipeline.rl.trainer import TrainerConfig, make_optimizer, policy_logprobs, train_round
from tests.conftest import TINY, logprob_tolerance, rounding_tolerance
from tests.rl.test_trainer import _advantages


def _torchrun(command: list[str], timeout: float = 180) -> subprocess.CompletedProcess:
    """Run torchrun in its own process group, so that a hang kills its workers too."""
    proc = subprocess.Popen(
        command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True
    )
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.communicate()
        raise
    return subprocess.CompletedProcess(command, proc.returncode, out, err)


def test_shares_cover_each_minibatch_once_balanced_by_tokens():
    tokens = {"a": 9, "b": 5, "c": 4, "d": 1, "e": 1}
    shares = [DataParallel(r, 2).share(tokens) for r in range(2)]
    assert shares[0] | shares[1] == set(tokens) and not shares[0] & shares[1]
    assert sorted(sum(tokens[t] for t in s) for s in shares) == [10, 10]
    assert DataParallel(2, 3).share({"a": 1, "b": 2}) == set()  # a short minibatch leaves a rank idle


@pytest.mark.parametrize("batch_size", [4, 7])  # 7: the second minibatch has 1 trajectory, a rank idles
def test_two_process_fsdp2_round_equals_the_single_process_round(
    tiny_model, recorded, columns, tmp_path, batch_size
):
    adv = [{**a, "round": 1, "baseline": 0.0} for a in _advantages(recorded, batch_size)]  # 2 steps
    cfg = TrainerConfig(steps=2, batch_size=batch_size, lr=1e-2, warmup_steps=3, microbatch_calls=3)
    parent = tmp_path / "parent"  # a parent with Adam state, as every round after the first has
    model = copy.deepcopy(tiny_model)
    opt = make_optimizer(model, cfg, None)
    train_round(model, opt, columns, adv, cfg, pad_id=0)
    save_checkpoint(parent, model, opt.state_dict(), {"step": 2})

    model, state, meta = load_checkpoint(parent)
    opt = make_optimizer(model, cfg, state)
    single = train_round(model, opt, columns, adv, cfg, pad_id=0, first_step=meta["step"])

    store = DeltaStore(tmp_path / "tables")
    store.overwrite_round("calls", recorded.calls, 1)
    store.overwrite_round("advantages", adv, 1)
    trainer = {k: v for k, v in vars(cfg).items() if k != "estimator"}
    run = _torchrun(
        [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--standalone",
            "--nproc-per-node",
            "2",
            "-m",
            "prodrl_pipeline.rl.train_distributed",
            "--tables",
            str(tmp_path / "tables"),
            "--round",
            "1",
            "--parent",
            str(parent),
            "--out",
            str(tmp_path / "out"),
            "--trainer",
            json.dumps(trainer),
            "--pad-id",
            "0",
            "--rows",
            str(tmp_path / "rows.json"),
        ],
    )
    assert run.returncode == 0, run.stderr[-3000:]
    rows = json.loads((tmp_path / "rows.json").read_text())
    # Tolerances from the scale of what is computed (tests/README.md). The runs batch the tokens
    # differently, so each float32 log-prob may differ by `per_token`, the second step's too (its
    # parameters agree to rounding, checked below); each statistic is built from its tokens' log-probs.
    seqs = build_sequences(columns, 0)
    counted, mu = seqs.free, seqs.deployment_logprobs[seqs.free]
    positions = int(seqs.attention_mask.sum())  # a weight's gradient sums a term of each position

    def on_counted(policy: torch.nn.Module) -> torch.Tensor:
        per_call = policy_logprobs(policy, columns, cfg, 0, fake_quant=False)
        return torch.cat([per_call[c] for c in columns.call_id])[counted]

    start, end = on_counted(load_checkpoint(parent)[0]), on_counted(model)  # pi_k, the round's last pi
    per_token = logprob_tolerance(torch.cat([mu, start, end]))
    ratio = max(float((lp - mu).exp().max()) for lp in (start, end))  # pi / mu
    drift = float((end - start).abs().max())  # |log pi - log pi_k|
    advantage = max(abs(a["advantage"]) for a in adv)
    bound = {
        "engine_mismatch": 2 * per_token,  # means of |a - b|, a and b log-probs
        "staleness": 2 * per_token,
        "total_mismatch": 2 * per_token,
        "kl": (2 + drift) * ratio * per_token,  # mean of (pi/mu)(log pi - log pi_k)
        "loss": 2 * advantage * per_token,  # sum of w A (log pi - baseline), the weights w summing to 1
        "clip_fraction": 0.0,  # a fraction of tokens, none clipped by this estimator
    }
    for a, b in zip(single, rows, strict=True):
        assert a["step"] == b["step"] and a["n_trajectories"] == b["n_trajectories"]
        for key, tolerance in bound.items():
            assert abs(b[key] - a[key]) <= tolerance, (a["step"], key, a[key], b[key], tolerance)
        # same-sign sums, relative to the result: of p |log p| over each support, each log p from
        # hidden-size products; of the gradient's squares, each entry summed over the positions
        assert abs(b["entropy"] - a["entropy"]) <= rounding_tolerance(a["entropy"], TINY.hidden_size)
        assert abs(b["grad_norm"] - a["grad_norm"]) <= rounding_tolerance(a["grad_norm"], positions)
    out, out_state, out_meta = load_checkpoint(tmp_path / "out")
    assert out_meta["step"] == 4 and out_meta["data_parallel"] == 2
    worst = max((a - b).abs().max().item() for a, b in zip(model.parameters(), out.parameters(), strict=True))
    moved = max(
        (a - b).abs().max().item() for a, b in zip(model.parameters(), tiny_model.parameters(), strict=True)
    )
    assert worst < 1e-5 < moved, (worst, moved)  # equal to float tolerance, and training did move them
    mine = opt.state_dict()["state"]
    for i, s in out_state["state"].items():  # Adam's moments of those gradients, against their scale
        for key, power in (("exp_avg", 1), ("exp_avg_sq", 2)):
            atol = rounding_tolerance(power * mine[i][key].abs().max(), positions)
            torch.testing.assert_close(s[key], mine[i][key], rtol=0, atol=atol)
    print(f"2-process FSDP2 vs single process: max |param diff| {worst:.2e}; params moved up to {moved:.2e}")
