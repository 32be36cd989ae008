import pytest
import torch

from prodrl_pipeline.rl.logprobs import build_sequences, token_logprobs


def _naive(model, seqs):
    """log_softmax over the full [tokens, V] logits of the whole batch (no chunking)."""
    logits = model(input_ids=seqs.input_ids, attention_mask=seqs.attention_mask).logits
    return (logits[seqs.token_row, seqs.token_pos] / seqs.temperature[:, None]).log_softmax(-1)  # [Ntok, V]


def test_chunked_equals_naive_log_softmax_gather(tiny_model, recorded, tokenizer):
    seqs = build_sequences(recorded.calls, tokenizer.pad_token_id)
    logp = _naive(tiny_model, seqs)
    full = logp.gather(1, seqs.token_ids[:, None]).squeeze(1)
    for chunk in (1, 7, 4096):
        got = token_logprobs(tiny_model, seqs, chunk_tokens=chunk)
        torch.testing.assert_close(got.full_logprobs, full, rtol=0, atol=1e-5)
        torch.testing.assert_close(got.head_logprobs, logp.gather(1, seqs.head_ids), rtol=0, atol=1e-5)
        torch.testing.assert_close(got.extra_logprobs, logp.gather(1, seqs.extra_ids), rtol=0, atol=1e-5)


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
