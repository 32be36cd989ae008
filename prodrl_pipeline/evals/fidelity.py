"""Gradient fidelity at one-decision states: each estimator's expected update against the exact
policy gradient, both by enumeration (docs/results.md, "Gradient fidelity"). No Dagster here.

A lab mate-in-1 turn is one decision: the `move` call's wrapper tokens are forced and one token
picks the move among the legal ones M, each with a known reward R(v). At that position the policy's
logits z = z_theta(h) over M decide everything an estimator sees, so every gradient is Z^T c with
Z = dz/dtheta [|M|, P] and c a coefficient vector over M:
- exact: grad J(pi) = sum_{a in S} pi_S(a) R(a) grad log pi_S(a), c_v = pi_S(v) (R(v) - E_{pi_S}[R]) on S
  (pi_S: pi renormalized over the deployment's kept support S);
- estimator: E_{a~mu}[grad J_a] with J_a the trainer's own per-token objective
  (`rl.estimators.objective`) for token a, c = sum_a mu(a) dJ_a/dz, enumerated over S (the samples
  form of score centering over the pairs (a, v) of sampled token and extra sample, M = 1).
Inner products across states come from the Gram matrix K = Z Z^T, so the cosine, the relative
bias and the minibatch variance are exact for the given states; only the interval (a bootstrap
over states) is sampled.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
from transformers import PreTrainedModel, PreTrainedTokenizerBase

from prodrl_pipeline.chat.render import render_ids
from prodrl_pipeline.engine.processing import processed_logprobs
from prodrl_pipeline.envs.chess_env import ChessEpisode, tool_call_message
from prodrl_pipeline.envs.puzzles import Puzzle
from prodrl_pipeline.envs.tool_choice import tool_call_ids
from prodrl_pipeline.rl.estimators import EstimatorConfig, TokenInputs, objective


@dataclass(frozen=True)
class Decision:
    """One recorded one-decision state: the ids up to the deciding position, the tokens the
    constraint allows there (M, one per legal move) and each one's reward."""

    prompt_ids: tuple[int, ...]  # the prompt and the forced prefix of the call
    choices: torch.Tensor  # [|M|] token ids
    rewards: torch.Tensor  # [|M|] float64 R(v)


def decisions(tokenizer: PreTrainedTokenizerBase, puzzles: list[Puzzle]) -> list[Decision]:
    """The first turn of each puzzle whose legal moves are told apart by one token after a common
    forced prefix (the lab's structured-output case); the reward of each move is the
    environment's verdict on it."""
    out = []
    for puzzle in puzzles:
        episode = ChessEpisode(puzzle)
        moves = episode.allowed_moves()
        seqs = [tool_call_ids(tokenizer, "move", "move", m) for m in moves]
        depth = next(i for i in range(min(map(len, seqs))) if len({s[i] for s in seqs}) > 1)
        choices = [s[depth] for s in seqs]
        if len(set(choices)) < len(choices) or any(s[:depth] != seqs[0][:depth] for s in seqs):
            continue
        rewards = []
        for m in moves:
            trial = ChessEpisode(puzzle)
            trial.step(tool_call_message(m))
            rewards.append(trial.reward)
        prompt = tuple(render_ids(tokenizer, episode.messages)) + seqs[0][:depth]
        out.append(Decision(prompt, torch.tensor(choices), torch.tensor(rewards, dtype=torch.float64)))
    return out


def decision_logits(model: PreTrainedModel, d: Decision) -> torch.Tensor:
    """z [|M|]: the model's logits for the choices at the deciding position (fp32, graph kept when
    gradients are enabled)."""
    logits = model(torch.tensor([d.prompt_ids])).logits[0, -1]  # [V]
    return logits[d.choices].float()


def logit_jacobian(model: PreTrainedModel, d: Decision) -> torch.Tensor:
    """Z = dz/dtheta [|M|, P], every parameter flattened in `model.parameters()` order (one batched
    backward pass over the rows of the identity)."""
    params = list(model.parameters())
    z = decision_logits(model, d)
    eye = torch.eye(len(z))
    grads = torch.autograd.grad(z, params, grad_outputs=eye, is_grads_batched=True, allow_unused=True)
    return torch.cat(
        [
            (g if g is not None else p.new_zeros(len(z), *p.shape)).flatten(1)
            for g, p in zip(grads, params, strict=True)
        ],
        dim=1,
    )


def support_logprobs(z: torch.Tensor, top_k: int = 0, top_p: float = 1.0) -> torch.Tensor:
    """log mu over M [|M|] as the engine processes logits z (temperature 1; top-k, top-p; the
    structured-output mask is M itself); -inf outside the kept support S."""
    one = torch.ones(1)
    return processed_logprobs(z[None].float(), one, torch.tensor([top_k]), one * top_p)[0]


def renormalized(z: torch.Tensor, kept: torch.Tensor) -> torch.Tensor:
    """log pi_S [..., |M|] from logits z [..., |M|]: -inf outside S."""
    return z.masked_fill(~kept, float("-inf")).log_softmax(-1)


def exact_coefficients(z: torch.Tensor, kept: torch.Tensor, rewards: torch.Tensor) -> torch.Tensor:
    """c [|M|] with grad J(pi_S) = Z^T c: by enumeration, sum_a pi_S(a) R(a) d log pi_S(a)/dz_v
    = pi_S(v) (R(v) - sum_a pi_S(a) R(a)) on S, 0 elsewhere (float64)."""
    pi = renormalized(z.double(), kept).exp()
    return pi * (rewards - (pi * rewards).sum())


@dataclass(frozen=True)
class Policies:
    """The logits over M at one state: pi (current trainer), pi_k (round start), the deployment
    (engine) and the reference (the dequantized deployment weights in the trainer)."""

    current: torch.Tensor
    round_start: torch.Tensor
    deployment: torch.Tensor
    reference: torch.Tensor


def estimator_coefficients(
    cfg: EstimatorConfig,
    p: Policies,
    log_mu: torch.Tensor,  # [|M|] log mu, -inf outside S
    rewards: torch.Tensor,  # [|M|]
    baseline: float,
    head_size: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(C [N, |M|], w [N]): the gradient of estimator `cfg` when row n's token was sampled is
    Z^T C[n], drawn with probability w[n]; its expectation over mu is Z^T (w @ C). Rows enumerate
    the sampled token a in S with w = mu(a) (the samples form: the pairs (a, v) with v the one extra
    sample, w = mu(a) mu(v)). A = R(a) - baseline. The head is mu's top-`head_size` (the recorded
    top_logprobs) with full-support mass; the tail S minus H as the trainer builds it."""
    kept = torch.isfinite(log_mu)
    support = kept.nonzero()[:, 0]  # [|S|]
    samples = cfg.type == "score_centering" and cfg.centering == "samples"
    if samples:
        a_idx, v_idx = (g.flatten() for g in torch.meshgrid(support, support, indexing="ij"))
    else:
        a_idx, v_idx = support, support
    n = len(a_idx)
    z_rows = p.current.double().expand(n, -1).clone().requires_grad_(True)  # one copy of z per row
    log_pi = renormalized(z_rows, kept)  # [N, |M|]
    log_pi_k = renormalized(p.round_start.double(), kept)
    log_ref = renormalized(p.reference.double(), kept)
    k = min(head_size, len(support))
    head = log_mu.topk(k).indices  # [K]
    in_head = torch.zeros_like(kept).index_fill(0, head, True)
    tail = kept & ~in_head
    rows = torch.arange(n)
    x = TokenInputs(
        logprobs=log_pi[rows, a_idx],
        deployment_logprobs=log_mu.double()[a_idx],
        round_start_logprobs=log_pi_k[a_idx],
        advantages=(rewards[a_idx] - baseline).double(),
        trajectory=rows,
        free=torch.ones(n, dtype=torch.bool),
        head_logprobs=log_pi[:, head],
        tail_logprobs=log_pi.masked_fill(~tail, float("-inf")).logsumexp(-1),
        head_deployment_logprobs=log_mu.double()[head].expand(n, -1),
        extra_logprobs=log_pi[rows, v_idx][:, None],
        reference_logprobs=log_ref[a_idx],
    )
    j, _ = objective(x, cfg)
    (coef,) = torch.autograd.grad(j.sum(), z_rows)
    mu = log_mu.double().exp()
    weight = mu[a_idx] * (mu[v_idx] if samples else 1.0)
    return coef, weight


@dataclass(frozen=True)
class CellStats:
    """Per-state coefficient blocks of one cell, over the Gram K of the stacked logit Jacobians."""

    expected: list[torch.Tensor]  # per state [|M_s|]: E_mu[g_s] = Z_s^T expected[s]
    exact: list[torch.Tensor]  # per state [|M_s|]: grad J_s = Z_s^T exact[s]
    second_moment: np.ndarray  # [n] E_mu ||g_s||^2


def second_moment(coef: torch.Tensor, weight: torch.Tensor, gram: torch.Tensor) -> float:
    """E ||Z^T C[n]||^2 = sum_n w[n] C[n]^T K C[n], K = Z Z^T of the state."""
    return float((weight * ((coef @ gram) * coef).sum(-1)).sum())


def summarize(
    cell: CellStats, gram: torch.Tensor, batch_size: int, n_boot: int = 1000, seed: int = 0
) -> dict[str, float]:
    """Cosine(E[g], grad J), relative bias ||E[g] - grad J|| / ||grad J||, and the variance of a
    minibatch of `batch_size` iid (state, token) draws relative to ||grad J||^2, with grad J and E[g]
    the means over states; each with a 95% percentile bootstrap interval over states (n_boot
    resamples). `gram` [sum |M_s|, sum |M_s|] = Z Z^T of all states' Jacobians stacked in order."""
    n = len(cell.expected)
    sizes = [len(c) for c in cell.expected]
    offsets = np.cumsum([0, *sizes])
    blocks = torch.zeros(2 * n, offsets[-1], dtype=torch.float64)  # rows: E-blocks then exact-blocks
    for s in range(n):
        blocks[s, offsets[s] : offsets[s + 1]] = cell.expected[s]
        blocks[n + s, offsets[s] : offsets[s + 1]] = cell.exact[s]
    g = (blocks @ gram.double() @ blocks.T).numpy()  # [2n, 2n] inner products of per-state vectors
    q = cell.second_moment

    def stats(w: np.ndarray) -> np.ndarray:
        u = np.concatenate([w, -w]) / n  # E[g] - grad J
        ee, xx = w @ g[:n, :n] @ w / n**2, w @ g[n:, n:] @ w / n**2
        ex = w @ g[:n, n:] @ w / n**2
        var = (w @ q / n - ee) / batch_size
        return np.array([ex / np.sqrt(ee * xx), np.sqrt(max(u @ g @ u, 0.0) / xx), var / xx])

    point = stats(np.ones(n))
    rng = np.random.default_rng(seed)
    boot = np.array([stats(rng.multinomial(n, np.full(n, 1 / n)).astype(float)) for _ in range(n_boot)])
    lo, hi = np.nanpercentile(boot, [2.5, 97.5], axis=0)
    names = ("cosine", "relative_bias", "relative_variance")
    out = {k: float(v) for k, v in zip(names, point, strict=True)}
    out |= {f"{k}_lo": float(v) for k, v in zip(names, lo, strict=True)}
    out |= {f"{k}_hi": float(v) for k, v in zip(names, hi, strict=True)}
    return out
