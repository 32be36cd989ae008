import math

import pytest
import torch

from prodrl_pipeline.engine.processing import SamplingParams


def _reference_distribution(model, ids: list[int], params: SamplingParams, allowed: list[int] | None):
    """mu(.|h) recomputed independently: a full forward pass (no KV cache), then the processing
    written out step by step in float64."""
    with torch.no_grad():
        z = model(input_ids=torch.tensor([ids])).logits[0, -1].double()
    for token, bias in params.logit_bias:
        z[token] += bias
    if allowed is not None:
        keep = torch.zeros_like(z, dtype=torch.bool)
        keep[allowed] = True
        z = z.masked_fill(~keep, -math.inf)
    z = z / params.temperature
    order = z.argsort(descending=True)
    n = len(z) if params.top_k == 0 else params.top_k
    kept = order[:n][torch.isfinite(z[order[:n]])]
    p = torch.softmax(z[kept], 0)
    cum_before = torch.cumsum(p, 0) - p
    if params.top_p < 1:  # top_p = 1 keeps everything, however the sums round
        kept = kept[cum_before < params.top_p]
    logp = torch.full_like(z, -math.inf)
    logp[kept] = torch.log_softmax(z[kept], 0)
    return logp


@pytest.fixture
def reference_mu():
    return _reference_distribution
