import pytest
import torch

from prodrl_pipeline.rl.logprobs import build_sequences, token_logprobs


def _naive(model, seqs):
    """log_softmax over the full [tokens, V] logits of the whole batch (no chunking)."""
    logits = model(input_ids=seqs.input_ids, attention_mask=seqs.attention_mask).logits
    return (logits[seqs.token_row, seqs.token_pos] / seqs.temperature[:, None]).log_softmax(-1)  # [Ntok, V]


def _over_support(logp, seqs):
    """log pi_S [Ntok, V]: each row renormalized over its recorded support, brute force."""
    out = logp.clone()
    for i, support in enumerate(seqs.support):
        if support is not None:
            keep = torch.zeros(logp.shape[1], dtype=torch.bool)
            keep[support] = True
            out[i] = logp[i].masked_fill(~keep, float("-inf")).log_softmax(0)
    return out


def test_chunked_equals_naive_log_softmax_gather(tiny_model, recorded, tokenizer):
    seqs = build_sequences(recorded.calls, tokenizer.pad_token_id)
    logp = _naive(tiny_model, seqs)
    kept = _over_support(logp, seqs)
    full = logp.gather(1, seqs.token_ids[:, None]).squeeze(1)
    tail = torch.stack(
        [
            kept[i]
            .masked_fill(
                torch.isin(torch.arange(logp.shape[1]), seqs.head_ids[i][seqs.head_mask[i]]), float("-inf")
            )
            .logsumexp(0)
            for i in range(len(seqs.token_ids))
        ]
    )
    for chunk in (1, 7, 4096):
        got = token_logprobs(tiny_model, seqs, chunk_tokens=chunk)
        torch.testing.assert_close(got.full_logprobs, full, rtol=0, atol=1e-5)
        head = seqs.head_mask
        torch.testing.assert_close(
            got.head_logprobs[head], kept.gather(1, seqs.head_ids)[head], rtol=0, atol=1e-5
        )
        torch.testing.assert_close(got.extra_logprobs, kept.gather(1, seqs.extra_ids), rtol=0, atol=1e-5)
        torch.testing.assert_close(got.tail_logprobs, tail, rtol=0, atol=1e-4)
    assert torch.isinf(tail).any() and torch.isfinite(tail).any()  # both kinds of position occur


def test_support_renormalizes_and_forced_tokens_carry_no_gradient(tiny_model, recorded, tokenizer):
    seqs = build_sequences(recorded.calls, tokenizer.pad_token_id)
    got = token_logprobs(tiny_model, seqs, chunk_tokens=64)
    logp = _naive(tiny_model, seqs)
    forced = ~seqs.free
    assert forced.any() and seqs.free.any()
    for i, support in enumerate(seqs.support):
        if support is None:
            continue
        expected = logp[i, seqs.token_ids[i]] - torch.logsumexp(logp[i, support], 0)  # brute force
        assert got.logprobs[i].item() == pytest.approx(expected.item(), abs=1e-5)
    assert torch.all(got.logprobs[forced] == 0) and torch.all(got.entropy[forced].abs() < 1e-6)
    assert torch.all(got.logprobs[seqs.free] > got.full_logprobs[seqs.free])  # the support's mass < 1
    grad = torch.autograd.grad(got.logprobs[forced].sum(), tiny_model.lm_head.weight, allow_unused=True)[0]
    assert grad is None or torch.count_nonzero(grad) == 0


def test_the_trainer_evaluates_pi_as_served_with_the_recorded_logit_bias(
    tiny_model, tokenizer, train_puzzles, tmp_path
):
    """On-policy identity: the trainer's pi_S at the recorded temperature and bias is mu exactly."""
    from prodrl_pipeline.engine.processing import SamplingParams
    from tests.rl.conftest import record

    bias = tuple((i, 3.0) for i in range(1024, 1324)) + ((1400, -100.0),)  # move tokens pushed up
    params = SamplingParams(temperature=0.9, logit_bias=bias)
    calls = record(tiny_model, tokenizer, train_puzzles[:4], tmp_path, params=params).calls
    assert calls[0]["sampling"]["logit_bias"][0] == {"token_id": 1024, "bias": 3.0}
    with torch.no_grad():
        served = token_logprobs(tiny_model, build_sequences(calls, tokenizer.pad_token_id))
        unbiased = [{**c, "sampling": {**c["sampling"], "logit_bias": []}} for c in calls]
        ignored = token_logprobs(tiny_model, build_sequences(unbiased, tokenizer.pad_token_id))
    seqs = build_sequences(calls, tokenizer.pad_token_id)
    free = seqs.free
    torch.testing.assert_close(served.logprobs[free], seqs.deployment_logprobs[free], rtol=0, atol=2e-5)
    head = seqs.head_mask
    torch.testing.assert_close(
        served.head_logprobs[head], seqs.head_deployment_logprobs[head], rtol=0, atol=2e-5
    )
    gap = (ignored.logprobs[free] - seqs.deployment_logprobs[free]).abs().max()
    assert gap > 0.1  # dropping the bias would train against a distribution nobody served


def test_calls_with_different_numbers_of_extra_samples_are_not_batched(recorded):
    """Extra samples are one tensor column per sample: a batch must agree on how many."""
    first, second = recorded.calls[0], dict(recorded.calls[1])
    second["extra_token_ids"] = [e[:1] for e in second["extra_token_ids"]]  # one where the rest have two
    with pytest.raises(ValueError, match="^calls of one batch recorded different numbers of extra samples$"):
        build_sequences([first, second], pad_id=0)
