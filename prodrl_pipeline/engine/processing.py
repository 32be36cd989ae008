"""Logit processing into the distribution actually sampled from (vLLM `processed_logprobs`).

Order, as vLLM: structured-output mask -> temperature -> top-k -> top-p -> log-softmax over the
survivors. Temperature 0 means greedy: a one-token support with log-prob 0. Removed tokens get
-inf. The result is mu(.|h) for every row, the distribution the engine records.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class SamplingParams:
    """Per-request sampling parameters, recorded with every call."""

    temperature: float = 1.0
    """0 means greedy."""
    top_p: float = 1.0
    """Keep the smallest head whose mass reaches top_p (1 keeps all)."""
    top_k: int = 0
    """Keep the k most likely tokens (0 keeps all)."""
    max_tokens: int = 64
    """Longest completion."""
    seed: int | None = None
    """Seed of the sampling RNG (None: nondeterministic)."""

    def __post_init__(self) -> None:
        if self.temperature < 0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k < 0:
            raise ValueError(f"top_k must be >= 0 (0 disables it), got {self.top_k}")
        if self.max_tokens < 1:
            raise ValueError(f"max_tokens must be >= 1, got {self.max_tokens}")


def processed_logprobs(
    logits: torch.Tensor,  # [N, V] fp32
    temperature: torch.Tensor,  # [N]
    top_k: torch.Tensor,  # [N] int, 0 = off
    top_p: torch.Tensor,  # [N]
    allowed: torch.Tensor | None = None,  # [N, V] bool, None = everything allowed
) -> torch.Tensor:  # [N, V], -inf outside the kept support
    logits = logits.float()
    if allowed is not None:
        logits = logits.masked_fill(~allowed, float("-inf"))
    greedy = temperature == 0
    scaled = logits / torch.where(greedy, torch.ones_like(temperature), temperature)[:, None]
    vocab = scaled.shape[-1]
    k = torch.where((top_k > 0) & (top_k < vocab), top_k, torch.full_like(top_k, vocab))
    k = torch.where(greedy, torch.ones_like(k), k)
    sorted_logits, order = scaled.sort(dim=-1, descending=True)  # [N, V]
    rank = torch.arange(vocab)[None, :]
    keep_sorted = rank < k[:, None]
    probs = sorted_logits.masked_fill(~keep_sorted, float("-inf")).softmax(-1)
    # Keep a token if the mass strictly before it is < top_p (so the first token is always kept).
    mass_before = probs.cumsum(-1) - probs
    keep_sorted &= mass_before < top_p[:, None]
    keep_sorted &= torch.isfinite(sorted_logits)
    keep = torch.zeros_like(keep_sorted).scatter(-1, order, keep_sorted)
    return scaled.masked_fill(~keep, float("-inf")).log_softmax(-1)
