import math

import pytest
import torch

from prodrl_pipeline.engine.constraints import ChoiceConstraint, ChoiceState
from prodrl_pipeline.engine.processing import SamplingParams


def advanced(choice: ChoiceConstraint, consumed: tuple) -> ChoiceState:
    """A fresh state of `choice` that has consumed `consumed`."""
    state = choice.start()
    for token in consumed:
        state.advance(token)
    return state


def completions(choice: ChoiceConstraint, consumed: tuple = ()) -> list[tuple]:
    """Every completion `choice` allows after `consumed`, found by stepping its states."""
    state = advanced(choice, consumed)
    if state.finished:
        return [consumed]
    return [w for t in state.allowed() for w in completions(choice, (*consumed, t))]


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
