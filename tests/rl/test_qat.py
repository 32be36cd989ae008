"""NVFP4 quantization-aware training: the trainer's pi is the policy the deployment serves."""

import copy

import torch

from prodrl_pipeline.quant.nvfp4 import QUANTIZED, load_deployment
from prodrl_pipeline.quant.qat import served_weights
from prodrl_pipeline.rl.estimators import EstimatorConfig
from prodrl_pipeline.rl.logprobs import build_sequences, token_logprobs
from prodrl_pipeline.rl.recorded import RecordedCalls
from prodrl_pipeline.rl.trainer import TrainerConfig, policy_logprobs
from tests.conftest import logprob_tolerance, rounding_tolerance
from tests.rl.conftest import record
from tests.rl.test_trainer import _advantages, _grads_after_one_step, positions


def test_qat_forward_uses_exactly_the_served_weights(tiny_model, tmp_path):
    from prodrl_pipeline.quant.nvfp4 import export_deployment

    export_deployment(tiny_model, tmp_path / "d", "nvfp4")
    served = load_deployment(tmp_path / "d").state_dict()
    w_hat = served_weights(tiny_model)
    assert w_hat and w_hat.keys() == {n for n, _ in tiny_model.named_parameters() if QUANTIZED.match(n)}
    for name, w in w_hat.items():
        assert torch.equal(w, served[name]), name


def test_qat_removes_the_quantization_mismatch(tiny_model, tokenizer, train_puzzles, tmp_path):
    """NVFP4 deployment: the full-precision pi_k differs from mu by the quantization error; the
    fake-quantized pi_k matches mu up to kernel differences."""
    rollouts = record(tiny_model, tokenizer, train_puzzles[:8], tmp_path, "nvfp4")
    mu = torch.cat([torch.tensor(c["completion_logprobs"]) for c in rollouts.calls])
    free = build_sequences(RecordedCalls.from_rows(rollouts.calls), tokenizer.pad_token_id).free
    gaps = {}
    for qat in (False, True):
        cfg = TrainerConfig(qat=qat)
        pik = policy_logprobs(
            tiny_model, RecordedCalls.from_rows(rollouts.calls), cfg, tokenizer.pad_token_id, fake_quant=qat
        )
        gaps[qat] = (torch.cat([pik[c["call_id"]] for c in rollouts.calls]) - mu)[free].abs()
    rounding = logprob_tolerance(mu[free])  # fp32, KV cache + left padding vs one right-padded pass
    assert gaps[True].max() <= rounding
    assert gaps[False].mean() > 10 * rounding


def test_qat_gradient_is_straight_through(tiny_model, columns, tokenizer):
    """d loss / d W under QAT equals d loss / d W_hat of a model holding W_hat."""
    seqs = build_sequences(columns, tokenizer.pad_token_id)
    w_hat = served_weights(tiny_model)
    token_logprobs(tiny_model, seqs, w_hat=w_hat).logprobs.sum().backward()
    holder = copy.deepcopy(tiny_model)
    holder.zero_grad(set_to_none=True)
    with torch.no_grad():
        for name, p in holder.named_parameters():
            if name in w_hat:
                p.copy_(w_hat[name])
    token_logprobs(holder, seqs).logprobs.sum().backward()
    params = dict(holder.named_parameters())
    n_terms = int(seqs.attention_mask.sum())
    for name, p in tiny_model.named_parameters():
        atol = rounding_tolerance(p.grad.abs().max(), n_terms)
        torch.testing.assert_close(p.grad, params[name].grad, rtol=0, atol=atol, msg=name)
    # and the master weights are not W_hat: the gradient is taken at W_hat, applied to W
    assert not torch.equal(
        tiny_model.model.layers[0].mlp.down_proj.weight, w_hat["model.layers.0.mlp.down_proj.weight"]
    )


def test_qat_training_step_is_microbatch_invariant(tiny_model, recorded):
    adv = _advantages(recorded, batch_size=len(recorded.trajectories))
    est = EstimatorConfig(type="score_centering")
    one, _ = _grads_after_one_step(tiny_model, recorded.calls, adv, len(recorded.calls), est, qat=True)
    many, _ = _grads_after_one_step(tiny_model, recorded.calls, adv, 1, est, qat=True)
    plain, _ = _grads_after_one_step(tiny_model, recorded.calls, adv, len(recorded.calls), est)
    for name in one:
        atol = rounding_tolerance(one[name].abs().max(), positions(recorded.calls))
        torch.testing.assert_close(one[name], many[name], rtol=0, atol=atol)
    assert any(not torch.allclose(one[n], plain[n]) for n in one)  # QAT changes the gradient
