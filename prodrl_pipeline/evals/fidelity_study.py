"""The gradient-fidelity table (issue 43 item 1): every estimator x staleness x engine x support
cell on lab mate-in-1 decisions, as JSON rows and markdown (docs/results.md, "Gradient fidelity").

    python -m prodrl_pipeline.evals.fidelity_study [--states 24] [--checkpoint DIR] \
        [--out docs/results/fidelity]

The deployment is the lab's base model (built and warm-started as the `base_model` asset does,
or `--checkpoint`); the engine axis is `ENGINES`, each serving its export. Schedules: sync, the
trainer's round start pi_k is the deployment's theta; async1, pi_k is S Adam steps further (the
round trains from the checkpoint of a round whose deployment is not live yet). Staleness: theta
after 0, S/2, S, 2S Adam steps (the trainer's lr, betas and clip) from pi_k on the exact
objective of the same states.
"""

from __future__ import annotations

import argparse
import copy
import json
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import torch
from transformers import AutoTokenizer, PreTrainedModel

from prodrl_pipeline.envs.lab_data import iter_lab_puzzles
from prodrl_pipeline.evals.fidelity import (
    CellStats,
    Decision,
    Policies,
    decision_logits,
    decisions,
    estimator_coefficients,
    exact_coefficients,
    logit_jacobian,
    second_moment,
    summarize,
    support_logprobs,
)
from prodrl_pipeline.evals.fidelity_report import KL_BETA, SCHEDULES, figures, section
from prodrl_pipeline.model import TinyQwen3Config, build_model, load_model
from prodrl_pipeline.quant.nvfp4 import export_deployment, load_deployment
from prodrl_pipeline.rl.estimators import EstimatorConfig
from prodrl_pipeline.rl.trainer import TrainerConfig
from prodrl_pipeline.rl.warmstart import WarmStartConfig, solved_turns, warm_start

ESTIMATORS: dict[str, EstimatorConfig] = {
    name: EstimatorConfig(**fields, kl_beta=beta)
    for base, fields in {
        "score_centering_head": {"type": "score_centering"},
        "score_centering_samples": {"type": "score_centering", "centering": "samples"},
        "tis_ppo": {"type": "tis_ppo"},
        "token_is": {"type": "token_is"},
        "ref_is": {"type": "ref_is"},
        "reinforce": {"type": "reinforce"},
    }.items()
    for name, beta in ((base, 0.0), (f"{base}+kl", KL_BETA))
}
SUPPORTS: dict[str, tuple[int, float]] = {"full": (0, 1.0), "top_p_0.95": (0, 0.95), "top_k_20": (20, 1.0)}
"""(top_k, top_p) of the deployment's sampling."""
STALENESS = (0.0, 0.5, 1.0, 2.0)  # x S optimizer steps
HEAD_SIZE = 20  # the lab engine's recorded top_logprobs
Served = Callable[[PreTrainedModel, Path], PreTrainedModel]
ENGINES: dict[str, Served] = {
    "fp32": lambda model, folder: model,
    "nvfp4_w4a16": lambda model, folder: load_deployment(folder, "nvfp4"),
    "nvfp4_w4a4": lambda model, folder: load_deployment(folder, "nvfp4_w4a4"),
}
"""How theta_k's deployment serves, from its NVFP4 export in `folder` (one export for both NVFP4
formats; W4A4 quantizes each quantized linear's input with the export's calibrated input_scale)."""


def _logits(model: PreTrainedModel, states: list[Decision]) -> list[torch.Tensor]:
    with torch.no_grad():
        return [decision_logits(model, d) for d in states]


def _drift(model: PreTrainedModel, states: list[Decision], steps: int, opt: torch.optim.Adam) -> None:
    """`steps` Adam steps on -(1/n) sum_s J_s(pi_S) with S = M (the exact on-policy objective)."""
    for _ in range(steps):
        opt.zero_grad(set_to_none=True)
        for d in states:
            pi = decision_logits(model, d).softmax(-1)
            (-(pi * d.rewards.float()).sum() / len(states)).backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), TrainerConfig().grad_clip)
        opt.step()


def _mean_abs_drift(a: list[torch.Tensor], b: list[torch.Tensor]) -> float:
    """Mean over states and legal moves of |log softmax(a) - log softmax(b)|."""
    return sum(
        float(((x - x.logsumexp(0)) - (y - y.logsumexp(0))).abs().mean()) for x, y in zip(a, b, strict=True)
    ) / len(a)


def base_policy(tokenizer, data_dir: str, checkpoint: str | None) -> PreTrainedModel:  # noqa: ANN001
    """theta_k: a checkpoint, or the lab's base model (its default architecture, seed and warm start)."""
    if checkpoint:
        return load_model(checkpoint)
    model = build_model(TinyQwen3Config(), len(tokenizer), tokenizer.pad_token_id)
    cfg = WarmStartConfig()
    warm_start(
        model,
        solved_turns(tokenizer, cfg.demonstrations(list(iter_lab_puzzles(data_dir, "warmup")))),
        cfg,
        tokenizer.pad_token_id,
    )
    return model.eval()


def run(
    model: PreTrainedModel,
    states: list[Decision],
    batch_size: int,
    steps: int,
    n_boot: int,
    engines: tuple[str, ...] = tuple(ENGINES),
    schedule: str = "sync",
) -> list[dict]:
    """One row per estimator x staleness x engine x support cell of `schedule`."""
    served: dict[str, list[torch.Tensor]] = {}
    with tempfile.TemporaryDirectory() as folder:
        export_deployment(model, folder, "nvfp4", calibration=[d.prompt_ids for d in states])
        for name in engines:
            served[name] = _logits(ENGINES[name](model, Path(folder)), states)
        dequantized = _logits(load_deployment(folder), states)
    deployed = _logits(model, states)  # the deployment's theta in the trainer's precision
    reference = {name: deployed if name == "fp32" else dequantized for name in engines}  # ref_is's
    trainer = TrainerConfig()
    policy = copy.deepcopy(model)
    opt = torch.optim.Adam(policy.parameters(), lr=trainer.lr, betas=(trainer.beta1, trainer.beta2))
    ahead = SCHEDULES[schedule] * steps
    _drift(policy, states, ahead, opt)
    round_start = _logits(policy, states)
    behind = _mean_abs_drift(round_start, deployed)
    rows, taken, t0 = [], 0, time.perf_counter()
    for factor in STALENESS:
        _drift(policy, states, round(factor * steps) - taken, opt)
        taken = round(factor * steps)
        print(f"theta after {taken} steps: Jacobians, {time.perf_counter() - t0:.0f} s", flush=True)
        jac = [logit_jacobian(policy, d) for d in states]
        current = _logits(policy, states)
        stacked = torch.cat(jac)
        gram = (stacked @ stacked.T).double()  # [sum |M|, sum |M|]
        del stacked, jac
        offsets = [0]
        for z in current:
            offsets.append(offsets[-1] + len(z))
        blocks = [gram[a:b, a:b] for a, b in zip(offsets, offsets[1:], strict=False)]
        for engine in engines:
            for support, (top_k, top_p) in SUPPORTS.items():
                log_mu = [support_logprobs(z, top_k, top_p) for z in served[engine]]
                baseline = sum(
                    float((m.double().exp() * d.rewards).sum()) for m, d in zip(log_mu, states, strict=True)
                ) / len(states)
                exact = [
                    exact_coefficients(z, torch.isfinite(m), d.rewards)
                    for z, m, d in zip(current, log_mu, states, strict=True)
                ]
                staleness = _mean_abs_drift(current, round_start)
                for name, cfg in ESTIMATORS.items():
                    expected, moments = [], []
                    for s, d in enumerate(states):
                        p = Policies(current[s], round_start[s], served[engine][s], reference[engine][s])
                        coef, w = estimator_coefficients(cfg, p, log_mu[s], d.rewards, baseline, HEAD_SIZE)
                        expected.append(w @ coef)
                        moments.append(second_moment(coef, w, blocks[s]))
                    cell = CellStats(expected, exact, torch.tensor(moments).numpy())
                    rows.append(
                        {
                            "estimator": name,
                            "schedule": schedule,
                            "staleness_steps": taken,
                            "engine": engine,
                            "support": support,
                            "n_states": len(states),
                            "batch_size": batch_size,
                            "mean_abs_logprob_drift": staleness,
                            "round_start_drift": behind,
                            **summarize(cell, gram, batch_size, n_boot),
                        }
                    )
    return rows


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--states", type=int, default=20)
    parser.add_argument("--checkpoint")
    parser.add_argument("--data-dir", default="data")
    parser.add_argument("--out", default="docs/results/fidelity")
    parser.add_argument("--bootstrap", type=int, default=1000)
    parser.add_argument("--engines", default=",".join(ENGINES), help=f"a subset of {','.join(ENGINES)}")
    parser.add_argument("--schedules", default=",".join(SCHEDULES), help=f"a subset of {','.join(SCHEDULES)}")
    parser.add_argument(
        "--steps", type=int, default=TrainerConfig().steps, help="S, optimizer steps per round"
    )
    args = parser.parse_args()
    t0 = time.perf_counter()
    torch.manual_seed(0)
    tokenizer = AutoTokenizer.from_pretrained(str(Path(args.data_dir) / "tokenizer"))
    mate_in_1 = [p for p in iter_lab_puzzles(args.data_dir, "train") if p.n_player_moves == 1]
    states = decisions(tokenizer, mate_in_1[: 2 * args.states])[: args.states]
    model = base_policy(tokenizer, args.data_dir, args.checkpoint)
    print(f"theta_k ready, {len(states)} states: {time.perf_counter() - t0:.0f} s", flush=True)
    engines, schedules = tuple(args.engines.split(",")), args.schedules.split(",")
    if unknown := set(engines) - set(ENGINES):
        parser.error(f"unknown engines {sorted(unknown)}; choose from {sorted(ENGINES)}")
    if unknown := set(schedules) - set(SCHEDULES):
        parser.error(f"unknown schedules {sorted(unknown)}; choose from {sorted(SCHEDULES)}")
    rows = [
        row
        for schedule in schedules
        for row in run(
            model, states, TrainerConfig().batch_size, args.steps, args.bootstrap, engines, schedule
        )
    ]
    seconds = time.perf_counter() - t0
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    command = "python -m prodrl_pipeline.evals.fidelity_study " + " ".join(sys.argv[1:])
    result = {"command": command.strip(), "seconds": seconds, "steps": args.steps, "rows": rows}
    out.with_suffix(".json").write_text(json.dumps(result, indent=1))
    out.with_suffix(".md").write_text(section([result], figures_in="."))
    for name, png in figures(result).items():
        (out.parent / name).write_bytes(png)
    print(f"{len(rows)} cells over {len(states)} states in {seconds:.0f} s: {out}.json, {out}.md")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
