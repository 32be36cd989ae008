"""Per-token policy-gradient estimators (DESIGN.md §4) and the one aggregation they share.

Every estimator has one signature: it takes `TokenInputs` and returns the per-token objective
J_t (maximized; only `logprobs` = log pi carries gradient) plus diagnostics. `aggregate` turns
J_t into the minibatch loss.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch


@dataclass
class TokenInputs:
    """Per completion token of a minibatch (shapes [Ntok])."""

    logprobs: torch.Tensor  # log pi(a|h), current trainer policy, with gradient
    deployment_logprobs: torch.Tensor  # log mu(a|h), recorded by the engine
    round_start_logprobs: torch.Tensor  # log pi_k(a|h), theta_k before the round's first step
    advantages: torch.Tensor  # A_i of the token's trajectory


def reinforce(x: TokenInputs) -> tuple[torch.Tensor, dict[str, float]]:
    """J_t = A_i * log pi(a|h), w = 1. With S = 1 this is a synchronous on-policy REINFORCE step
    on recorded tokens; it corrects neither engine mismatch (mu != pi_k) nor staleness."""
    return x.advantages * x.logprobs, {}


Estimator = Callable[[TokenInputs], tuple[torch.Tensor, dict[str, float]]]
ESTIMATORS: dict[str, Estimator] = {"reinforce": reinforce}


def aggregate(objective: torch.Tensor, token_weight: torch.Tensor) -> torch.Tensor:
    """Loss = -g with g = (1/B) sum_i (1/T_i) sum_t J_{i,t}: `token_weight` = 1/(B T_i) is fixed
    per token by the whole minibatch, so summing microbatch losses gives the same gradient however
    the minibatch is split."""
    return -(objective * token_weight).sum()
