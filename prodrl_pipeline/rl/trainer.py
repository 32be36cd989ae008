"""One round of training: S Adam steps on minibatches of B recorded trajectories.

The step reads top to bottom: load the minibatch's calls, log-probs in chunks, estimator,
aggregate, backward (per microbatch of whole trajectories), clip, step, log. pi_k (and, for
`ref_is`, the reference) is computed once per round before the first step. Optimizer state comes
in and goes out: the run is one long run.
"""

from __future__ import annotations

import math
import time
from collections import defaultdict
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Literal

import numpy as np
import torch
from transformers import PreTrainedModel

from prodrl_pipeline.quant.qat import served_weights
from prodrl_pipeline.rl.estimators import EstimatorConfig, TokenInputs, aggregate, objective
from prodrl_pipeline.rl.logprobs import Sequences, TokenLogprobs, build_sequences, token_logprobs
from prodrl_pipeline.rl.recorded import RecordedCalls

if TYPE_CHECKING:
    from prodrl_pipeline.rl.distributed import DataParallel


@dataclass(frozen=True)
class TrainerConfig:
    """How a round trains."""

    steps: int = 16
    """S: optimizer steps per round (one minibatch each)."""
    batch_size: int = 64
    """B: trajectories per minibatch."""
    lr: float = 5e-4
    """Adam learning rate."""
    warmup_steps: int = 16
    """Linear learning-rate warm-up over the run's first optimizer steps (global steps: it spans
    the first rounds until `warmup_steps` steps have been taken). A fresh Adam's first updates are
    ~lr * sign(g) on every weight whatever the gradient's size; on a warm-started policy that noise
    alone moved pi by ~1 nat per token in the first round. 0 disables it."""
    tokens: Literal["recorded", "retokenized"] = "recorded"
    """recorded: train on the token ids the deployment served. retokenized: the naive pipeline,
    rebuilding each call from its conversation through the chat template (rl/retokenize.py);
    kept to measure what it costs."""
    beta1: float = 0.9
    """Adam beta1."""
    beta2: float = 0.99
    """Adam beta2."""
    grad_clip: float = 1.0
    """Max global grad norm (0 disables clipping)."""
    estimator: EstimatorConfig = field(default_factory=EstimatorConfig)
    """The per-token estimator and its parameters."""
    microbatch_calls: int = 16
    """About this many calls per forward/backward pass, whole trajectories only, of similar
    length (memory and padding only: the gradient does not depend on it)."""
    logprob_chunk_tokens: int = 1024
    """Completion tokens projected to the vocabulary at once."""
    seed: int = 0
    """Seed of the minibatch shuffle."""
    qat: bool = False
    """NVFP4 quantization-aware training: forward through the weights the deployment will serve
    (the export's quantizer, straight-through gradient), for pi_k and every step."""
    resume_every: int = 4
    """Save a resumable state every this many optimizer steps inside a round (rl/resume.py; the
    in-process trainer); 0 never."""
    device: str = "cpu"
    """Where the single-process trainer runs (e.g. "cuda"); checkpoints are saved from the CPU.
    Under torchrun each rank uses its own GPU when CUDA is available (rl/distributed.py)."""

    def __post_init__(self) -> None:
        for name in ("steps", "batch_size", "microbatch_calls", "logprob_chunk_tokens"):
            if getattr(self, name) < 1:
                raise ValueError(f"trainer.{name} must be >= 1, got {getattr(self, name)}")
        if self.lr <= 0:
            raise ValueError(f"trainer.lr must be > 0, got {self.lr}")
        if self.resume_every < 0:
            raise ValueError(f"trainer.resume_every must be >= 0, got {self.resume_every}")
        if self.warmup_steps < 0:
            raise ValueError(f"trainer.warmup_steps must be >= 0, got {self.warmup_steps}")
        if self.tokens not in ("recorded", "retokenized"):
            raise ValueError(f"trainer.tokens must be 'recorded' or 'retokenized', got {self.tokens!r}")

    def lr_at(self, step: int) -> float:
        """The learning rate of global optimizer step `step` (1-based)."""
        return self.lr * min(1.0, step / self.warmup_steps) if self.warmup_steps else self.lr


def make_optimizer(model: PreTrainedModel, cfg: TrainerConfig, state: dict | None) -> torch.optim.Adam:
    opt = torch.optim.Adam(model.parameters(), lr=cfg.lr, betas=(cfg.beta1, cfg.beta2))
    if state is not None:
        opt.load_state_dict(state)
        for group in opt.param_groups:  # the config of this round wins over the stored one
            group["lr"], group["betas"] = cfg.lr, (cfg.beta1, cfg.beta2)
    return opt


def _microbatches(calls: RecordedCalls, size: int, chosen: Iterable[int] | None = None) -> list[np.ndarray]:
    """The `chosen` calls (default: all) as microbatches of call indices, whole trajectories per
    microbatch (the trust region needs all of a trajectory's tokens), trajectories ordered by their
    longest call so a microbatch pads little (the gradient is a sum over microbatches: the order
    does not change it), calls in call order."""
    by_traj: dict[str, list[int]] = defaultdict(list)
    for i in range(len(calls)) if chosen is None else chosen:
        by_traj[calls.trajectory_id[i]].append(i)
    lengths = calls.lengths
    longest = {t: max(lengths[i] for i in idx) for t, idx in by_traj.items()}
    out, current = [], []
    for _, idx in sorted(by_traj.items(), key=lambda item: longest[item[0]]):
        if current and len(current) + len(idx) > size:
            out.append(np.array(current))
            current = []
        current.extend(sorted(idx, key=lambda i: calls.call_index[i]))
    return out + [np.array(current)] if current else out


def _token_logprobs(
    model: PreTrainedModel,
    seqs: Sequences,
    cfg: TrainerConfig,
    w_hat: dict | None,
    dp: DataParallel | None,
    outputs: frozenset[str],
) -> TokenLogprobs:
    """log pi over the recorded supports (and the optional `outputs`), through the sharded policy
    under data parallelism."""
    if dp is not None:
        return dp.token_logprobs(seqs, cfg.logprob_chunk_tokens, w_hat, outputs)
    return token_logprobs(model, seqs, cfg.logprob_chunk_tokens, w_hat, outputs)


def _passes(
    calls: RecordedCalls, micros: list[np.ndarray], dp: DataParallel | None, spare: np.ndarray
) -> Iterator[tuple[RecordedCalls, bool]]:
    """(microbatch, real): the microbatches' calls, padded under data parallelism so that every rank
    runs as many forward/backward passes as the busiest one (a padding pass is not real; `spare`:
    the calls a rank with nothing of its own runs)."""
    passes = dp.lockstep(micros, spare) if dp else ((m, True) for m in micros)
    return ((calls.take(m), real) for m, real in passes)


@torch.no_grad()
def policy_logprobs(
    model: PreTrainedModel,
    calls: RecordedCalls,
    cfg: TrainerConfig,
    pad_id: int,
    *,
    fake_quant: bool,
    dp: DataParallel | None = None,
    chosen: Iterable[int] | None = None,
    spare: np.ndarray | None = None,
) -> dict[str, torch.Tensor]:
    """log pi of every completion token over its recorded support, per call_id ([T] each): pi_k
    with theta_k before the first step (`fake_quant` = cfg.qat), or the reference from the already
    dequantized deployment (`fake_quant` = False: the reference is W_hat as served, not a second
    round trip of it). `chosen`: the indices of the calls to evaluate (default: all). With `dp`,
    they are this rank's and the passes run in lockstep (`spare`: the calls a rank with none of its
    own runs, results unused)."""
    out = {}
    w_hat = served_weights(model) if fake_quant else None
    device = _device(model)
    micros = _microbatches(calls, cfg.microbatch_calls, chosen)
    for mb, real in _passes(calls, micros, dp, spare):
        lp = _token_logprobs(
            model, build_sequences(mb, pad_id).to(device), cfg, w_hat, dp, frozenset()
        ).logprobs
        if real:
            out.update(zip(mb.call_id, lp.split(mb.completion.lengths.tolist()), strict=True))
    return out


def _per_token(per_call: list, dtype: torch.dtype, seqs: Sequences) -> torch.Tensor:
    """[Ntok] each completion token's value, from one value per call of the batch."""
    return torch.tensor(per_call, dtype=dtype, device=seqs.token_row.device)[seqs.token_row]


def _device(model: torch.nn.Module) -> torch.device:
    return next(model.parameters()).device


def _means(stats: dict[str, list[torch.Tensor]], dp: DataParallel | None) -> dict[str, float]:
    """The mean of each statistic over all its tokens (over every rank's under `dp`)."""
    keys = sorted(stats)
    local = torch.tensor(
        [[float(torch.cat(stats[k]).double().sum()), float(sum(x.numel() for x in stats[k]))] for k in keys],
        dtype=torch.float64,
    ).reshape(len(keys), 2)
    total = dp.sum(local) if dp else local
    return {k: float(s / n) if n else math.nan for k, (s, n) in zip(keys, total.tolist(), strict=True)}


def train_round(
    model: PreTrainedModel,
    optimizer: torch.optim.Optimizer,
    calls: RecordedCalls,
    advantages: list[dict],
    cfg: TrainerConfig,
    pad_id: int,
    first_step: int = 0,
    round_start: dict[str, torch.Tensor] | None = None,
    reference: dict[str, torch.Tensor] | None = None,
    behaviour_step: int | None = None,
    progress: Callable[[dict], None] | None = None,
    dp: DataParallel | None = None,
    start_minibatch: int = 0,
    after_step: Callable[[int, list[dict]], None] | None = None,
) -> list[dict]:
    """Run the round's steps in minibatch order; returns one metrics row per optimizer step.
    `round_start` (pi_k per call) is computed here if not given; `reference` is required by ref_is.
    `behaviour_step`: the global step of the checkpoint whose deployment sampled the calls (default:
    the round's start, as in the synchronous schedule); each row records the policy lag in steps.
    `dp`: data parallelism (rl/distributed.py): `model` is sharded, this rank trains its share of
    every minibatch, and the rows are the same on every rank. `start_minibatch`: minibatches
    already trained (a resumed round: the model and optimizer hold their result); `after_step`
    is called with the count of minibatches trained and this call's rows after each step."""
    est = cfg.estimator
    if est.type == "ref_is" and reference is None:
        raise ValueError("estimator ref_is needs reference log-probs from the dequantized deployment")
    if dp and cfg.qat:
        raise ValueError("quantization-aware training is not supported with data parallelism yet")
    by_traj: dict[str, list[int]] = defaultdict(list)  # the indices of each trajectory's calls
    for i, t in enumerate(calls.trajectory_id):
        by_traj[t].append(i)
    tokens = calls.completion.lengths
    minibatches: dict[int, list[dict]] = defaultdict(list)
    for a in advantages:
        if a["trajectory_id"] not in by_traj:
            raise ValueError(f"trajectory {a['trajectory_id']} has an advantage but no calls")
        minibatches[a["minibatch"]].append(a)

    ordered = [minibatches[k] for k in sorted(minibatches)]
    lengths = [  # completion tokens T_i of each minibatch's trajectories
        {a["trajectory_id"]: int(tokens[by_traj[a["trajectory_id"]]].sum()) for a in mb} for mb in ordered
    ]
    shares = [dp.share(length) if dp else set(length) for length in lengths]
    outputs = est.reads | {"entropy"}  # the entropy is reported
    device = _device(model)
    model.eval()  # Qwen3 has no dropout; eval keeps pi_k and pi numerically identical at step 0
    if round_start is None:
        mine = set().union(*shares)
        trained = [i for a in advantages if a["trajectory_id"] in mine for i in by_traj[a["trajectory_id"]]]
        spare = np.array(by_traj[advantages[0]["trajectory_id"]])
        round_start = policy_logprobs(
            model, calls, cfg, pad_id, fake_quant=cfg.qat, dp=dp, chosen=trained, spare=spare
        )
    rows = []
    for step, (mb, length, share) in enumerate(zip(ordered, lengths, shares, strict=True)):
        if step < start_minibatch:
            continue
        t0 = time.perf_counter()
        n_traj = len(mb)
        adv = {a["trajectory_id"]: a["advantage"] for a in mb}
        optimizer.zero_grad(set_to_none=True)
        w_hat = served_weights(model) if cfg.qat else None
        stats: dict[str, list[torch.Tensor]] = defaultdict(list)
        loss_total, dropped = 0.0, set()
        ours = [i for t in adv if t in share for i in by_traj[t]]
        micros = _microbatches(calls, cfg.microbatch_calls, ours)
        for micro, real in _passes(calls, micros, dp, np.array(by_traj[mb[0]["trajectory_id"]])):
            seqs = build_sequences(micro, pad_id).to(device)
            lp = _token_logprobs(model, seqs, cfg, w_hat, dp, outputs)
            index = {t: i for i, t in enumerate(dict.fromkeys(micro.trajectory_id))}
            free = seqs.free
            pi_k = (
                torch.cat([round_start[c] for c in micro.call_id]).to(device)
                if real
                else lp.logprobs.detach()
            )
            mu, head_mu = seqs.deployment_logprobs, seqs.head_deployment_logprobs
            if cfg.tokens == "retokenized":  # NaN: no recorded log-prob; taken as on-policy, mu = pi_k
                mu = torch.where(mu.isnan(), pi_k, mu)
                head_mu = torch.where(head_mu.isnan(), pi_k[:, None], head_mu)
            x = TokenInputs(
                logprobs=lp.logprobs,
                deployment_logprobs=mu,
                round_start_logprobs=pi_k,
                advantages=_per_token([adv[t] for t in micro.trajectory_id], torch.float32, seqs),
                trajectory=_per_token([index[t] for t in micro.trajectory_id], torch.long, seqs),
                free=free,
                head_logprobs=lp.head_logprobs,
                tail_logprobs=lp.tail_logprobs,
                head_deployment_logprobs=head_mu,
                extra_logprobs=lp.extra_logprobs,
                complement_logprobs=lp.complement_logprobs,
                reference_logprobs=torch.cat([reference[c] for c in micro.call_id]).to(device)
                if reference
                else None,
            )
            weight = _per_token(
                [1.0 / (n_traj * length[t]) if real else 0.0 for t in micro.trajectory_id],
                torch.float32,
                seqs,
            )
            j, diag = objective(x, est)
            loss = aggregate(j, weight)
            (loss * dp.world if dp else loss).backward()  # FSDP2 averages over ranks: this sums
            counted = free if real else torch.zeros_like(free)  # a lockstep pass counts no token,
            cur = lp.logprobs.detach()  # but lists the same statistics (ranks reduce them together)
            stats["engine"].append((x.round_start_logprobs - x.deployment_logprobs)[counted].abs())
            stats["stale"].append((cur - x.round_start_logprobs)[counted].abs())
            stats["total"].append((cur - x.deployment_logprobs)[counted].abs())
            stats["entropy"].append(lp.entropy[counted])
            for key in ("clipped", "rho_truncated", "kl"):
                if key in diag:
                    stats[key].append(diag[key][counted])
            if not real:
                continue
            loss_total += loss.item()
            if "dropped" in diag:
                names = list(index)
                dropped |= {names[i] for i in x.trajectory[diag["dropped"]].unique().tolist()}
        clip = cfg.grad_clip if cfg.grad_clip > 0 else float("inf")
        norm = torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
        grad_norm = float(norm.full_tensor() if hasattr(norm, "full_tensor") else norm)  # DTensor under dp
        lr = cfg.lr_at(first_step + step + 1)
        for group in optimizer.param_groups:
            group["lr"] = lr
        optimizer.step()
        mean = _means(stats, dp)
        counts = torch.tensor([loss_total, float(len(dropped))], dtype=torch.float64)
        loss_total, n_dropped = (dp.sum(counts) if dp else counts).tolist()
        row = {
            "step": first_step + step + 1,
            "estimator": est.type,
            "n_trajectories": n_traj,
            "n_tokens": sum(length.values()),
            "reward_mean": sum(a["reward"] for a in mb) / n_traj,
            "loss": loss_total,
            "lr": lr,
            "grad_norm": grad_norm,
            "entropy": mean["entropy"],
            "engine_mismatch": mean["engine"],
            "staleness": mean["stale"],
            "total_mismatch": mean["total"],
            "clip_fraction": mean.get("clipped", 0.0),
            "rho_truncated_fraction": mean.get("rho_truncated", 0.0),
            "kl": mean["kl"],
            "dropped_trajectories": int(n_dropped),
            "policy_lag_steps": first_step
            + step
            - (first_step if behaviour_step is None else behaviour_step),
            "seconds": time.perf_counter() - t0,
        }
        rows.append(row)
        if progress:
            progress(row)
        if after_step:
            after_step(step + 1, rows)
    return rows
