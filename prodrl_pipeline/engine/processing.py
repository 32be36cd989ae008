"""Logit processing into the distribution actually sampled from (vLLM `processed_logprobs`).

Order, as vLLM: logit bias -> structured-output mask -> temperature -> top-k -> top-p ->
log-softmax over the survivors. Temperature 0 means greedy: a one-token support with log-prob 0.
top_p = 1 keeps every token (as vLLM skips it; a cumulative sum that rounds to 1 cuts nothing).
Removed tokens get -inf. The result is mu(.|h) for every row, the distribution the engine records.
"""

from __future__ import annotations

from collections.abc import Sequence
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
    logit_bias: tuple[tuple[int, float], ...] = ()
    """(token id, bias) pairs added to the logits before everything else (OpenAI's `logit_bias`).
    Recorded: the trainer evaluates pi with the same bias, as it does at the recorded temperature."""

    def __post_init__(self) -> None:
        if self.temperature < 0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k < 0:
            raise ValueError(f"top_k must be >= 0 (0 disables it), got {self.top_k}")
        if self.max_tokens < 1:
            raise ValueError(f"max_tokens must be >= 1, got {self.max_tokens}")
        for token, bias in self.logit_bias:
            if token < 0 or not -100 <= bias <= 100:
                raise ValueError(
                    f"logit_bias takes token ids >= 0 and biases in [-100, 100], got {token}: {bias}"
                )

    def recorded(self, seed: int) -> dict:
        """The `sampling` column of a recorded call (docs/tables.md); `seed` is the one drawn from."""
        return {
            "temperature": self.temperature,
            "top_p": self.top_p,
            "top_k": self.top_k,
            "max_tokens": self.max_tokens,
            "seed": seed,
            "logit_bias": [{"token_id": t, "bias": b} for t, b in self.logit_bias],
        }


def bias_matrix(
    rows: Sequence[tuple[Sequence[int], Sequence[float]] | None], vocab: int
) -> torch.Tensor | None:  # [N, V]
    """Per-row logit biases, given as (token ids, biases) or None, as the dense [N, V] matrix
    `processed_logprobs` adds (None when no row has one). The engine and the trainer both build it."""
    if all(b is None for b in rows):
        return None
    dense = torch.zeros((len(rows), vocab))
    for i, b in enumerate(rows):
        if b is not None:
            dense[i, list(b[0])] = torch.tensor(b[1], dtype=torch.float32)
    return dense


def processed_logprobs(
    logits: torch.Tensor,  # [N, V] fp32
    temperature: torch.Tensor,  # [N]
    top_k: torch.Tensor,  # [N] int, 0 = off
    top_p: torch.Tensor,  # [N]
    allowed: torch.Tensor | None = None,  # [N, V] bool, None = everything allowed
    bias: torch.Tensor | None = None,  # [N, V] added to the logits, None = no bias
) -> torch.Tensor:  # [N, V], -inf outside the kept support
    logits = logits.float()
    if bias is not None:
        logits = logits + bias
    if allowed is not None:
        logits = logits.masked_fill(~allowed, float("-inf"))
    greedy = temperature == 0
    if bool(((temperature == 1) | greedy).all()):  # dividing by 1 changes no bit: skip the pass
        scaled = logits
    else:
        scaled = logits / torch.where(greedy, torch.ones_like(temperature), temperature)[:, None]
    vocab = scaled.shape[-1]
    k = torch.where((top_k > 0) & (top_k < vocab), top_k, torch.full_like(top_k, vocab))
    k = torch.where(greedy, torch.ones_like(k), k)
    nucleus = top_p < 1  # top_p = 1 keeps everything, as vLLM skips it (no float-rounding cut)
    if not bool(((k < vocab) | nucleus).any()):  # nothing to truncate: no sort
        return scaled.log_softmax(-1)
    sorted_logits, order = scaled.sort(dim=-1, descending=True)  # [N, V]
    rank = torch.arange(vocab)[None, :]
    keep_sorted = rank < k[:, None]
    probs = sorted_logits.masked_fill(~keep_sorted, float("-inf")).softmax(-1)
    # Keep a token if the mass strictly before it is < top_p (so the first token is always kept).
    mass_before = probs.cumsum(-1) - probs
    keep_sorted &= (mass_before < top_p[:, None]) | ~nucleus[:, None]
    keep_sorted &= torch.isfinite(sorted_logits)
    keep = torch.zeros_like(keep_sorted).scatter(-1, order, keep_sorted)
    return scaled.masked_fill(~keep, float("-inf")).log_softmax(-1)
