import pytest
import torch

from prodrl_pipeline.rl.logprobs import build_sequences, token_logprobs


def _naive(model, seqs):
    """log_softmax over the full [tokens, V] logits of the whole batch, then gather."""
    logits = model(input_ids=seqs.input_ids, attention_mask=seqs.attention_mask).logits
    logits = logits[seqs.token_row, seqs.token_pos] / seqs.temperature[:, None]
    return logits.log_softmax(-1).gather(1, seqs.token_ids[:, None]).squeeze(1)


def test_chunked_equals_naive_without_support(tiny_model, recorded, tokenizer):
    calls = [
        {**c, "support_size": [c["vocab_size"]] * len(c["completion_token_ids"])} for c in recorded.calls
    ]
    seqs = build_sequences(calls, tokenizer.pad_token_id)
    expected = _naive(tiny_model, seqs)
    for chunk in (1, 7, 4096):
        got, _ = token_logprobs(tiny_model, seqs, chunk_tokens=chunk)
        torch.testing.assert_close(got, expected, rtol=0, atol=1e-5)


def test_support_renormalizes_and_forced_tokens_carry_no_gradient(tiny_model, recorded, tokenizer):
    seqs = build_sequences(recorded.calls, tokenizer.pad_token_id)
    logprobs, entropy = token_logprobs(tiny_model, seqs, chunk_tokens=64, with_entropy=True)
    full = _naive(tiny_model, seqs)
    logits = tiny_model(input_ids=seqs.input_ids, attention_mask=seqs.attention_mask).logits
    logits = logits[seqs.token_row, seqs.token_pos]
    forced = torch.tensor([s is not None and len(s) == 1 for s in seqs.support])
    assert forced.any() and (~forced).any()
    for i, support in enumerate(seqs.support):
        if support is None:
            continue
        expected = logits[i, seqs.token_ids[i]] - torch.logsumexp(logits[i, support], 0)  # brute force
        assert logprobs[i].item() == pytest.approx(expected.item(), abs=1e-5)
    assert torch.all(logprobs[forced] == 0) and torch.all(entropy[forced].abs() < 1e-6)
    assert torch.all(logprobs[~forced] > full[~forced])  # renormalizing over the support adds mass
    grad = torch.autograd.grad(logprobs[forced].sum(), tiny_model.lm_head.weight, allow_unused=True)[0]
    assert grad is None or torch.count_nonzero(grad) == 0
