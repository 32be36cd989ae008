"""One round of training: S Adam steps on minibatches of B recorded trajectories.

The step reads top to bottom: load the minibatch's calls, log-probs in chunks, estimator,
aggregate, backward (per microbatch), clip, step, log. pi_k is computed once per round with
theta_k before the first step. Optimizer state comes in and goes out: the run is one long run.
"""

from __future__ import annotations

import logging
import math
import time
from collections import defaultdict
from collections.abc import Callable
from dataclasses import dataclass
from typing import Literal

import torch
from transformers import PreTrainedModel

from prodrl_pipeline.rl.estimators import ESTIMATORS, TokenInputs, aggregate
from prodrl_pipeline.rl.logprobs import build_sequences, token_logprobs

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class TrainerConfig:
    """How a round trains."""

    steps: int = 16
    """S: optimizer steps per round (one minibatch each)."""
    batch_size: int = 64
    """B: trajectories per minibatch."""
    lr: float = 5e-4
    """Adam learning rate."""
    beta1: float = 0.9
    """Adam beta1."""
    beta2: float = 0.99
    """Adam beta2."""
    grad_clip: float = 1.0
    """Max global grad norm (0 disables clipping)."""
    estimator: Literal["reinforce"] = "reinforce"
    """Per-token estimator, a key of rl.estimators.ESTIMATORS."""
    microbatch_calls: int = 64
    """Calls per forward/backward pass (memory only: the gradient does not depend on it)."""
    logprob_chunk_tokens: int = 1024
    """Completion tokens projected to the vocabulary at once."""
    seed: int = 0
    """Seed of the minibatch shuffle."""

    def __post_init__(self) -> None:
        for name in ("steps", "batch_size", "microbatch_calls", "logprob_chunk_tokens"):
            if getattr(self, name) < 1:
                raise ValueError(f"trainer.{name} must be >= 1, got {getattr(self, name)}")
        if self.lr <= 0:
            raise ValueError(f"trainer.lr must be > 0, got {self.lr}")
        if self.estimator not in ESTIMATORS:
            raise ValueError(
                f"trainer.estimator {self.estimator!r} unknown; choose one of {sorted(ESTIMATORS)}"
            )


def make_optimizer(model: PreTrainedModel, cfg: TrainerConfig, state: dict | None) -> torch.optim.Adam:
    opt = torch.optim.Adam(model.parameters(), lr=cfg.lr, betas=(cfg.beta1, cfg.beta2))
    if state is not None:
        opt.load_state_dict(state)
        for group in opt.param_groups:  # the config of this round wins over the stored one
            group["lr"], group["betas"] = cfg.lr, (cfg.beta1, cfg.beta2)
    return opt


def _microbatches(calls: list[dict], size: int) -> list[list[dict]]:
    ordered = sorted(calls, key=lambda c: len(c["prompt_token_ids"]) + len(c["completion_token_ids"]))
    return [ordered[i : i + size] for i in range(0, len(ordered), size)]


@torch.no_grad()
def round_start_logprobs(
    model: PreTrainedModel, calls: list[dict], cfg: TrainerConfig, pad_id: int
) -> dict[str, torch.Tensor]:
    """log pi_k of every completion token of the round, per call_id ([T] each)."""
    out = {}
    for mb in _microbatches(calls, cfg.microbatch_calls):
        lp, _ = token_logprobs(model, build_sequences(mb, pad_id), cfg.logprob_chunk_tokens)
        for c, part in zip(mb, lp.split([len(c["completion_token_ids"]) for c in mb]), strict=True):
            out[c["call_id"]] = part
    return out


def _mean_abs(x: torch.Tensor) -> float:
    return float(x.abs().mean()) if x.numel() else math.nan


def train_round(
    model: PreTrainedModel,
    optimizer: torch.optim.Optimizer,
    calls: list[dict],
    advantages: list[dict],
    cfg: TrainerConfig,
    pad_id: int,
    first_step: int = 0,
    progress: Callable[[dict], None] | None = None,
) -> list[dict]:
    """Run the round's steps in minibatch order; returns one metrics row per optimizer step."""
    estimator = ESTIMATORS[cfg.estimator]
    by_traj: dict[str, list[dict]] = defaultdict(list)
    for c in calls:
        by_traj[c["trajectory_id"]].append(c)
    minibatches: dict[int, list[dict]] = defaultdict(list)
    for a in advantages:
        if a["trajectory_id"] not in by_traj:
            raise ValueError(f"trajectory {a['trajectory_id']} has an advantage but no calls")
        minibatches[a["minibatch"]].append(a)

    model.eval()  # Qwen3 has no dropout; eval keeps pi_k and pi numerically identical at step 0
    pi_k = round_start_logprobs(
        model, [c for a in advantages for c in by_traj[a["trajectory_id"]]], cfg, pad_id
    )
    rows = []
    for step, mb in enumerate(minibatches[k] for k in sorted(minibatches)):
        t0 = time.perf_counter()
        n_traj = len(mb)
        adv = {a["trajectory_id"]: a["advantage"] for a in mb}
        length = {t: sum(len(c["completion_token_ids"]) for c in by_traj[t]) for t in adv}
        mb_calls = [c for t in adv for c in by_traj[t]]
        optimizer.zero_grad(set_to_none=True)
        stats = defaultdict(list)
        loss_total = 0.0
        for micro in _microbatches(mb_calls, cfg.microbatch_calls):
            seqs = build_sequences(micro, pad_id)
            logprobs, entropy = token_logprobs(model, seqs, cfg.logprob_chunk_tokens, with_entropy=True)
            owner = [c["trajectory_id"] for c in micro for _ in c["completion_token_ids"]]
            x = TokenInputs(
                logprobs=logprobs,
                deployment_logprobs=torch.tensor([lp for c in micro for lp in c["completion_logprobs"]]),
                round_start_logprobs=torch.cat([pi_k[c["call_id"]] for c in micro]),
                advantages=torch.tensor([adv[t] for t in owner], dtype=torch.float32),
            )
            weight = torch.tensor([1.0 / (n_traj * length[t]) for t in owner])
            objective, _ = estimator(x)
            loss = aggregate(objective, weight)
            loss.backward()
            loss_total += loss.item()
            free = torch.tensor([len(s) != 1 if s is not None else True for s in seqs.support])
            lp = logprobs.detach()
            stats["engine"].append((x.round_start_logprobs - x.deployment_logprobs)[free])
            stats["stale"].append((lp - x.round_start_logprobs)[free])
            stats["total"].append((lp - x.deployment_logprobs)[free])
            stats["entropy"].append(entropy.detach()[free])
        clip = cfg.grad_clip if cfg.grad_clip > 0 else float("inf")
        grad_norm = float(torch.nn.utils.clip_grad_norm_(model.parameters(), clip))
        optimizer.step()
        cat = {k: torch.cat(v) for k, v in stats.items()}
        row = {
            "step": first_step + step + 1,
            "estimator": cfg.estimator,
            "n_trajectories": n_traj,
            "n_tokens": sum(length.values()),
            "reward_mean": sum(a["reward"] for a in mb) / n_traj,
            "loss": loss_total,
            "grad_norm": grad_norm,
            "entropy": float(cat["entropy"].mean()) if cat["entropy"].numel() else math.nan,
            "engine_mismatch": _mean_abs(cat["engine"]),
            "staleness": _mean_abs(cat["stale"]),
            "total_mismatch": _mean_abs(cat["total"]),
            "seconds": time.perf_counter() - t0,
        }
        rows.append(row)
        if progress:
            progress(row)
    return rows
