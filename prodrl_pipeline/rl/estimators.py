"""Per-token policy-gradient estimators (docs/estimators.md) and the one aggregation they share.

Every estimator has one signature: `(x: TokenInputs, cfg: EstimatorConfig) -> (J, diagnostics)`.
J is the per-token objective (maximized); only the trainer's current log-probs (`logprobs`,
`head_logprobs`, `tail_logprobs`, `extra_logprobs` = log pi) carry gradient, every other factor is
stop-gradient (sg). Diagnostics are per-token tensors the trainer averages. Symbols: mu the
deployment's sampling distribution (recorded), pi_k the round-start policy, pi the current policy,
A the trajectory's advantage. mu is 0 outside the kept support S (structured-output mask, top-k,
top-p), so every estimator reads pi and pi_k as renormalized over S (pi_S = pi / pi(S); S = V when
sampling was unrestricted) and mu as recorded (already over S, full-support mass).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Literal

import torch

MAX_LOG_RATIO = 20.0  # keeps exp() of a log-ratio finite; ratios beyond e^20 are truncated or clipped anyway


@dataclass(frozen=True)
class EstimatorConfig:
    """Which estimator, and its parameters. Validated at construction."""

    type: Literal["reinforce", "token_is", "tis_ppo", "ref_is", "score_centering"] = "score_centering"
    """The per-token estimator (see docs/estimators.md); the default is the recipe's."""
    is_cap: float = 2.0
    """C: truncation of importance weights (tis_ppo, ref_is, score_centering with truncated_is)."""
    eps_low: float = 0.2
    """PPO clip below: r >= 1 - eps_low (tis_ppo, ref_is)."""
    eps_high: float = 0.28
    """PPO clip above: r <= 1 + eps_high (tis_ppo, ref_is)."""
    trust_region: bool = False
    """token_is: drop a trajectory whose mean Bernoulli-KL(mu(a), pi(a)) exceeds trust_region_delta."""
    trust_region_delta: float = 3e-3
    """delta of the sequence trust region (FlashREINFORCE)."""
    centering: Literal["head", "samples"] = "head"
    """score_centering: E_mu[s] from the recorded top-K head (+ modelled tail) or from M extra samples."""
    truncated_is: bool = False
    """score_centering (head): compose with the truncated IS weight w(x) = min(x, C)."""
    kl_beta: float = 0.0
    """beta of the KL penalty toward pi_k, added to any estimator (0 = off)."""

    def __post_init__(self) -> None:
        if self.type not in ESTIMATORS:
            raise ValueError(f"estimator type {self.type!r} unknown; choose one of {sorted(ESTIMATORS)}")
        if self.is_cap <= 0:
            raise ValueError(f"is_cap must be > 0, got {self.is_cap}")
        if not (0 <= self.eps_low < 1 and self.eps_high >= 0):
            raise ValueError(f"need 0 <= eps_low < 1 and eps_high >= 0, got {self.eps_low}, {self.eps_high}")
        if self.trust_region_delta <= 0:
            raise ValueError(f"trust_region_delta must be > 0, got {self.trust_region_delta}")
        if self.kl_beta < 0:
            raise ValueError(f"kl_beta must be >= 0, got {self.kl_beta}")
        if self.trust_region and self.type != "token_is":
            raise ValueError("trust_region applies to type='token_is' only")
        if self.truncated_is and not (self.type == "score_centering" and self.centering == "head"):
            raise ValueError("truncated_is composes with type='score_centering', centering='head' only")
        if self.centering != "head" and self.type != "score_centering":
            raise ValueError("centering applies to type='score_centering' only")

    @property
    def reads(self) -> frozenset[str]:
        """The optional trainer log-probs (fields of rl.logprobs.TokenLogprobs) this estimator reads;
        the trainer computes no others but the entropy it reports."""
        if self.type == "score_centering":
            return frozenset(
                {"extra_logprobs"} if self.centering == "samples" else {"head_logprobs", "tail_logprobs"}
            )
        return frozenset({"complement_logprobs"} if self.trust_region else ())


@dataclass
class TokenInputs:
    """Per completion token of a microbatch; shapes [N] unless noted."""

    logprobs: torch.Tensor  # log pi_S(a|h), with gradient
    deployment_logprobs: torch.Tensor  # log mu(a|h), recorded (already over S)
    round_start_logprobs: torch.Tensor  # log pi_k(a|h) over S, computed once per round
    advantages: torch.Tensor  # A_i of the token's trajectory
    trajectory: torch.Tensor  # [N] int: index of the token's trajectory in the microbatch
    free: torch.Tensor  # [N] bool: sampled (support > 1 token), not forced
    head_logprobs: torch.Tensor | None = None  # [N, K] log pi_S of mu's recorded head H, with gradient
    tail_logprobs: torch.Tensor | None = None  # [N] log pi_S(S minus H), with gradient; -inf if S is in H
    head_deployment_logprobs: torch.Tensor | None = None  # [N, K] recorded log mu of the head (-inf = pad)
    extra_logprobs: torch.Tensor | None = None  # [N, M] log pi_S of the deployment's extra samples
    complement_logprobs: torch.Tensor | None = None  # [N] log(1 - pi_S(a)), exact near pi_S(a) = 1
    reference_logprobs: torch.Tensor | None = None  # log ref(a|h) over S from the dequantized deployment


Diagnostics = dict[str, torch.Tensor]


def _ratio(log_num: torch.Tensor, log_den: torch.Tensor) -> torch.Tensor:
    """exp(log_num - log_den) with the log-ratio clamped to +-MAX_LOG_RATIO: beyond it the ratio
    and its gradient are constant (the IS weights that use it are truncated or clipped far below)."""
    return torch.exp((log_num - log_den).clamp(-MAX_LOG_RATIO, MAX_LOG_RATIO))


def log1mexp(x: torch.Tensor) -> torch.Tensor:
    """log(1 - e^x) for x <= 0 without cancellation (Maechler 2012); -inf at x = 0. Inputs above 0
    (a recorded mass rounded past 1) count as 0."""
    x = x.clamp(max=0.0)
    return torch.where(x > -math.log(2.0), torch.log(-torch.expm1(x)), torch.log1p(-torch.exp(x)))


def bernoulli_kl(
    log_p: torch.Tensor, log_q: torch.Tensor, log1m_q: torch.Tensor | None = None
) -> torch.Tensor:
    """KL(Bernoulli(p) || Bernoulli(q)) in log space, no clamping. `log1m_q` = log(1 - q) when known
    exactly (a float32 log q rounds to 0 once 1 - q < 6e-8); then log q is taken from it where
    q > 1/2. Without it log(1 - q) = log1mexp(log q). +inf where q = 1 > p; 0 terms where p is 0 or 1."""
    if log1m_q is None:
        log1m_q = log1mexp(log_q)
    else:
        log_q = torch.where(log1m_q < -math.log(2.0), log1mexp(log1m_q), log_q)
    p = log_p.exp()
    first = torch.where(p > 0, p * (log_p - log_q), torch.zeros_like(p))
    second = torch.where(p < 1, (1 - p) * (log1mexp(log_p) - log1m_q), torch.zeros_like(p))
    return first + second


def reinforce(x: TokenInputs, cfg: EstimatorConfig) -> tuple[torch.Tensor, Diagnostics]:
    """J = A log pi(a|h), w = 1. With S = 1 a synchronous on-policy step on recorded tokens;
    corrects neither the engine mismatch (mu != pi_k) nor staleness (pi != pi_k)."""
    return x.advantages * x.logprobs, {}


def token_is(x: TokenInputs, cfg: EstimatorConfig) -> tuple[torch.Tensor, Diagnostics]:
    """FlashREINFORCE (Hu et al. 2026): J = sg(pi(a)/mu(a)) A log pi(a), unclipped token IS against
    the recorded mu, so it corrects both the engine mismatch and staleness, at the cost of variance.
    Optional sequence trust region: drop trajectory i (J = 0 on its tokens) if the mean over its
    sampled tokens of Bernoulli-KL(mu(a), pi(a)) exceeds delta."""
    w = _ratio(x.logprobs, x.deployment_logprobs).detach()
    objective = w * x.advantages * x.logprobs
    diag: Diagnostics = {}
    if cfg.trust_region:
        if x.complement_logprobs is None:
            raise ValueError("the trust region needs complement_logprobs, log(1 - pi_S(a)), from the trainer")
        kl = bernoulli_kl(x.deployment_logprobs, x.logprobs.detach(), x.complement_logprobs)
        kl = torch.where(x.free, kl, torch.zeros_like(kl))
        n = int(x.trajectory.max()) + 1
        total = kl.new_zeros(n).index_add(0, x.trajectory, kl)
        count = kl.new_zeros(n).index_add(0, x.trajectory, x.free.to(kl.dtype)).clamp_min(1.0)
        dropped = (total / count > cfg.trust_region_delta)[x.trajectory]
        objective = torch.where(dropped, torch.zeros_like(objective), objective)
        diag["dropped"] = dropped
    return objective, diag


def tis_ppo(x: TokenInputs, cfg: EstimatorConfig) -> tuple[torch.Tensor, Diagnostics]:
    """TIS + PPO-clip (Yao et al. 2025): rho = min(pi_k(a)/mu(a), C) corrects the engine mismatch
    (truncated: biased where pi_k/mu > C); r = pi(a)/pi_k(a) with the PPO clip bounds staleness;
    J = rho min(r A, clip(r, 1 - eps_low, 1 + eps_high) A)."""
    return _truncated_ppo(x, x.deployment_logprobs, cfg)


def ref_is(x: TokenInputs, cfg: EstimatorConfig) -> tuple[torch.Tensor, Diagnostics]:
    """As `tis_ppo` with mu replaced by a reference computed in the trainer from the upcast
    (dequantized NVFP4) deployment weights. Needs no deployment log-probs; corrects staleness and
    the weight-quantization part of the mismatch, none of the engine's kernels or sampling."""
    if x.reference_logprobs is None:
        raise ValueError("ref_is needs reference_logprobs (the trainer computes them from the deployment)")
    return _truncated_ppo(x, x.reference_logprobs, cfg)


def _truncated_ppo(
    x: TokenInputs, behaviour: torch.Tensor, cfg: EstimatorConfig
) -> tuple[torch.Tensor, Diagnostics]:
    raw_rho = _ratio(x.round_start_logprobs, behaviour)
    rho = raw_rho.clamp(max=cfg.is_cap).detach()
    r = _ratio(x.logprobs, x.round_start_logprobs)
    unclipped = r * x.advantages
    clipped = r.clamp(1 - cfg.eps_low, 1 + cfg.eps_high) * x.advantages
    objective = rho * torch.minimum(unclipped, clipped)
    diag = {"clipped": (clipped < unclipped).detach(), "rho_truncated": raw_rho > cfg.is_cap}
    return objective, diag


def score_centering(x: TokenInputs, cfg: EstimatorConfig) -> tuple[torch.Tensor, Diagnostics]:
    """Score centering (Marek & Ryabinin 2026): replace s_a = grad log pi_S(a|h) by s_a - E_mu[s].
    Head form: H = the recorded top-K of mu with full-support probabilities mu_v; on S minus H, mu
    is modelled as pi_S rescaled to the leftover mass, alpha = (1 - sum_H mu) / (1 - sum_H pi_S).
    The published J = A (log pi_S(a) - sum_H sg(mu_v - alpha pi_S,v) log pi_S(v)) has the same gradient
    as the form computed here, which takes the tail directly instead of through sum_S pi_S s = 0:
        J = A (log pi_S(a) - sum_H sg(mu_v) log pi_S(v) - sg(1 - sum_H mu) log pi_S(S minus H)),
    since alpha sum_{S minus H} pi_S,v s_v = (1 - sum_H mu) grad log pi_S(S minus H). Both masses
    come from log space (no 1e-6 floor, no cancellation of alpha against the head); exact when the
    support fits in H; a forced token contributes nothing. With `truncated_is`, w(x) = min(x, C),
    E_mu[w s] = sum_S min(pi_S,v, C mu_v) s_v, the tail modelled as above:
        J = A (sg(w(pi_S(a) / mu(a))) log pi_S(a) - sum_H sg(min(pi_S,v, C mu_v)) log pi_S(v)
               - sg(min(pi_S(S minus H), C (1 - sum_H mu))) log pi_S(S minus H)).
    Samples form: E_mu[s] ~ (1/M) sum_m s(v_m), v_m the deployment's M extra samples (exact in
    expectation whatever S is)."""
    A = x.advantages
    if cfg.centering == "samples":
        if x.extra_logprobs is None or x.extra_logprobs.shape[1] == 0:
            raise ValueError(
                "centering='samples' needs calls recorded with extra samples (engine extra_samples >= 1)"
            )
        return A * (x.logprobs - x.extra_logprobs.mean(-1)), {}
    in_head = torch.isfinite(x.head_deployment_logprobs)  # [N, K]: False on padding (heads differ in length)
    head_lp = x.head_logprobs.masked_fill(~in_head, 0.0)  # [N, K] log pi_S(v)
    mu_head = x.head_deployment_logprobs.exp()  # [N, K], 0 where padded
    has_tail = torch.isfinite(x.tail_logprobs)  # [N]: S is larger than H
    tail_lp = x.tail_logprobs.masked_fill(~has_tail, 0.0)  # [N] log pi_S(S minus H)
    # log(1 - sum_H mu) in float64 from the recorded head (float32 rounding sets its floor, ~1e-7)
    log_mu_tail = log1mexp(x.head_deployment_logprobs.double().logsumexp(-1)).to(tail_lp.dtype)  # [N]
    log_mu_tail = log_mu_tail.masked_fill(~has_tail, float("-inf"))
    if not cfg.truncated_is:
        baseline = (mu_head * head_lp).sum(-1) + log_mu_tail.exp() * tail_lp
        return A * (x.logprobs - baseline), {}
    C = cfg.is_cap
    raw_w = _ratio(x.logprobs, x.deployment_logprobs)
    w = raw_w.clamp(max=C).detach()
    head_coef = torch.minimum(head_lp.detach().exp().masked_fill(~in_head, 0.0), C * mu_head)  # [N, K]
    tail_coef = torch.minimum(tail_lp.detach(), math.log(C) + log_mu_tail).exp()  # [N], 0 without a tail
    baseline = (head_coef * head_lp).sum(-1) + tail_coef * tail_lp
    return A * (w * x.logprobs - baseline), {"rho_truncated": raw_w > C}


def kl_penalty(x: TokenInputs) -> torch.Tensor:
    """Per-token KL toward pi_k from mu-sampled tokens: (pi(a)/mu(a)) (log pi(a) - log pi_k(a)),
    gradient through pi in both factors; its expected gradient under mu is exactly
    grad KL(pi || pi_k) when mu covers pi's support (here: KL of the distributions renormalized over
    the sampled support S). Not the k3 estimator, which is biased as a loss (Tang & Munos 2025)."""
    return _ratio(x.logprobs, x.deployment_logprobs) * (x.logprobs - x.round_start_logprobs)


Estimator = Callable[[TokenInputs, EstimatorConfig], tuple[torch.Tensor, Diagnostics]]
ESTIMATORS: dict[str, Estimator] = {
    "reinforce": reinforce,
    "token_is": token_is,
    "tis_ppo": tis_ppo,
    "ref_is": ref_is,
    "score_centering": score_centering,
}


def objective(x: TokenInputs, cfg: EstimatorConfig) -> tuple[torch.Tensor, Diagnostics]:
    """The configured estimator's J, minus beta times the KL penalty when beta > 0. The KL
    estimate is always reported (diagnostic `kl`: its mean estimates KL(pi || pi_k))."""
    j, diag = ESTIMATORS[cfg.type](x, cfg)
    kl = kl_penalty(x)
    if cfg.kl_beta > 0:
        j = j - cfg.kl_beta * kl
    diag["kl"] = kl.detach()
    return j, diag


def aggregate(objective: torch.Tensor, token_weight: torch.Tensor) -> torch.Tensor:
    """Loss = -g with g = (1/B) sum_i (1/T_i) sum_t J_{i,t}: `token_weight` = 1/(B T_i) is fixed
    per token by the whole minibatch, so summing microbatch losses gives the same gradient however
    the minibatch is split."""
    return -(objective * token_weight).sum()
