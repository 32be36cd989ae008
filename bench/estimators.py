"""Step time of every estimator relative to `reinforce`, on the lab model, measured side by side.

One minibatch of B recorded lab trajectories (recorded with M extra samples, K = 20 head); each
estimator trains one step on it from the same weights, interleaved over several repeats; the
median time of each is divided by reinforce's. Also: the engine's cost of recording M extra samples.
Run: `make bench` (or `.venv/bin/python -m bench.estimators`). Goal: score centering (K = 20) <= 1.10.
"""

from __future__ import annotations

import argparse
import copy
import statistics
import time

import torch

from bench.ratios import Ratio, alternate, report
from prodrl_pipeline.chat.render import load_tokenizer
from prodrl_pipeline.engine.processing import SamplingParams
from prodrl_pipeline.engine.sampler import TorchEngine
from prodrl_pipeline.envs.lab_data import iter_lab_puzzles
from prodrl_pipeline.envs.rollout import play
from prodrl_pipeline.model import TinyQwen3Config, build_model
from prodrl_pipeline.rl.estimators import EstimatorConfig
from prodrl_pipeline.rl.recorded import RecordedCalls
from prodrl_pipeline.rl.trainer import TrainerConfig, make_optimizer, policy_logprobs, train_round

ESTIMATORS = {
    "reinforce": EstimatorConfig(type="reinforce"),
    "token_is": EstimatorConfig(type="token_is"),
    "token_is + trust region": EstimatorConfig(type="token_is", trust_region=True),
    "tis_ppo": EstimatorConfig(type="tis_ppo"),
    "tis_ppo + KL": EstimatorConfig(type="tis_ppo", kl_beta=0.05),
    "ref_is": EstimatorConfig(type="ref_is"),
    "score_centering (head, K=20)": EstimatorConfig(type="score_centering"),
    "score_centering + truncated IS": EstimatorConfig(type="score_centering", truncated_is=True),
    "score_centering (M samples)": EstimatorConfig(type="score_centering", centering="samples"),
}


def arguments() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--extra-samples", type=int, default=4)
    parser.add_argument("--repeats", type=int, default=5)
    return parser


SMOKE = ["--batch", "4", "--extra-samples", "2", "--repeats", "1"]


def measure(args: argparse.Namespace) -> list[Ratio]:
    torch.manual_seed(0)
    tok = load_tokenizer("data/tokenizer")
    model = build_model(TinyQwen3Config(), len(tok), tok.pad_token_id)
    puzzles = list(iter_lab_puzzles("data", "train"))[: args.batch]
    engines = {
        m: TorchEngine(model, tok.eos_token_id, tok.pad_token_id, extra_samples=m)
        for m in (0, args.extra_samples)
    }
    played = {}

    def collect(m: int) -> None:
        played[m] = play(engines[m], tok, puzzles, SamplingParams(), deployment_id="d", round_=1, seed=0)

    gen_times = alternate({m: lambda m=m: collect(m) for m in engines}, args.repeats)
    rollouts = played[args.extra_samples]  # recorded with M extra samples: every estimator can run
    adv = [
        {
            "trajectory_id": t["trajectory_id"],
            "minibatch": 0,
            "reward": t["reward"],
            "advantage": float(i % 3 - 1),
        }
        for i, t in enumerate(rollouts.trajectories)
    ]
    calls = RecordedCalls.from_rows(rollouts.calls)
    times: dict[str, list[float]] = {name: [] for name in ESTIMATORS}
    for _ in range(args.repeats):
        for name, est in ESTIMATORS.items():
            cfg = TrainerConfig(steps=1, batch_size=args.batch, estimator=est)
            m = copy.deepcopy(model)
            opt = make_optimizer(m, cfg, None)
            round_start = policy_logprobs(m, calls, cfg, tok.pad_token_id, fake_quant=False)
            reference = round_start if est.type == "ref_is" else None  # computed once per round, not per step
            t0 = time.perf_counter()
            train_round(
                m, opt, calls, adv, cfg, tok.pad_token_id, round_start=round_start, reference=reference
            )
            times[name].append(time.perf_counter() - t0)
    base = statistics.median(times["reinforce"])
    relative = ", ".join(f"{name} {statistics.median(ts) / base:.2f}" for name, ts in times.items())
    n_tokens = int(calls.completion.lengths.sum())
    m = args.extra_samples
    return [
        Ratio(
            "score centering (head, K=20) step / reinforce step",
            tuple(
                s / r for s, r in zip(times["score_centering (head, K=20)"], times["reinforce"], strict=True)
            ),
            1.10,
            at_least=False,
            detail=(
                f"one step on {args.batch} lab trajectories ({n_tokens} completion tokens), {args.repeats} "
                f"repeats; reinforce {base:.2f} s; every estimator's step / reinforce: {relative}; "
                f"engine with M={m} extra samples / M=0: "
                f"{statistics.median(gen_times[m]) / statistics.median(gen_times[0]):.2f}"
            ),
        )
    ]


def main() -> None:
    report(measure(arguments().parse_args()))


if __name__ == "__main__":
    main()
