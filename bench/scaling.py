"""How the engine's and the trainer's costs grow with B, S, sequence length and K (lab model).

Each point is the median of `--repeats` timings at one size, the others held at the middle value:
- engine: one batched `generate` of B lab prompts with up to L new tokens recording a K head
  (T = 1, no constraint): seconds per call over B, L and K;
- trainer: a round of S optimizer steps, each on B synthetic calls (a 144-token prompt, as the lab's,
  and L completion tokens, unrestricted support, a K head), the round's pi_k pass included.
Writes the figures as JSON and draws them (one panel per variable, seconds against size, both axes
logarithmic: a slope of 1 is linear growth). Run: `.venv/bin/python -m bench.scaling`.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import time
from pathlib import Path

import torch

from prodrl_pipeline.engine.processing import SamplingParams
from prodrl_pipeline.engine.sampler import Request, TorchEngine
from prodrl_pipeline.envs.chat import load_tokenizer, render_ids
from prodrl_pipeline.envs.chess_env import ChessEpisode
from prodrl_pipeline.envs.lab_data import iter_lab_puzzles
from prodrl_pipeline.model import TinyQwen3Config, build_model
from prodrl_pipeline.rl.trainer import TrainerConfig, make_optimizer, train_round

SIZES = {  # variable: (engine sizes, trainer sizes); the middle one is the default of the others
    "B": ((16, 32, 64, 128), (8, 16, 32)),
    "S": ((), (1, 2, 4)),
    "L": ((16, 32, 64, 128), (16, 64, 256)),
    "K": ((1, 5, 20, 50), (1, 5, 20)),
}
SMOKE_SIZES = {"B": ((2, 4), (2, 4)), "S": ((), (1, 2)), "L": ((2, 4), (2, 4)), "K": ((1, 2), (1, 2))}


def _middle(sizes: tuple[int, ...]) -> int:
    return sizes[(len(sizes) - 1) // 2]


def _median_seconds(fn, repeats: int) -> float:  # noqa: ANN001
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def _synthetic_calls(n: int, length: int, k: int, vocab: int, seed: int) -> list[dict]:
    rng = random.Random(seed)
    return [
        {
            "call_id": f"c{i}",
            "trajectory_id": f"t{i}",
            "call_index": 0,
            "prompt_token_ids": [rng.randrange(1, vocab) for _ in range(144)],
            "completion_token_ids": [rng.randrange(1, vocab) for _ in range(length)],
            "completion_logprobs": [-8.0] * length,
            "topk_token_ids": [rng.sample(range(1, vocab), k) for _ in range(length)],
            "topk_logprobs": [[-8.0] * k for _ in range(length)],
            "support_size": [vocab] * length,
            "support_token_ids": [[] for _ in range(length)],
            "extra_token_ids": [[] for _ in range(length)],
            "vocab_size": vocab,
            "sampling": {"temperature": 1.0, "logit_bias": []},
        }
        for i in range(n)
    ]


def _round_seconds(at: dict[str, int], vocab: int, pad_id: int, seed: int, repeats: int) -> float:
    """A round of S steps of B synthetic calls each, from fresh weights and a fresh optimizer."""
    calls = _synthetic_calls(at["B"] * at["S"], at["L"], at["K"], vocab, seed)
    advantages = [
        {"trajectory_id": c["trajectory_id"], "minibatch": i // at["B"], "reward": 0.0, "advantage": 1.0}
        for i, c in enumerate(calls)
    ]
    cfg = TrainerConfig(steps=at["S"], batch_size=at["B"], warmup_steps=0)
    model = build_model(TinyQwen3Config(), vocab, pad_id)
    optimizer = make_optimizer(model, cfg, None)
    return _median_seconds(lambda: train_round(model, optimizer, calls, advantages, cfg, pad_id), repeats)


def measure(sizes: dict, repeats: int) -> dict[str, dict[str, list[list[float]]]]:
    """{variable: {"engine" | "trainer": [[size, seconds], ...]}}."""
    torch.manual_seed(0)
    tok = load_tokenizer("data/tokenizer")
    model = build_model(TinyQwen3Config(), len(tok), tok.pad_token_id)
    prompts = [render_ids(tok, ChessEpisode(p).messages) for p in iter_lab_puzzles("data", "heldout")]
    default = {v: (_middle(e) if e else None, _middle(t)) for v, (e, t) in sizes.items()}
    out: dict[str, dict[str, list[list[float]]]] = {v: {"engine": [], "trainer": []} for v in sizes}
    for variable, (engine_sizes, trainer_sizes) in sizes.items():
        for size in engine_sizes:
            at = {v: d[0] for v, d in default.items()} | {variable: size}
            engine = TorchEngine(model, tok.eos_token_id, tok.pad_token_id, top_logprobs=at["K"])
            requests = [Request(p, SamplingParams(max_tokens=at["L"])) for p in prompts[: at["B"]]]
            with torch.inference_mode():
                seconds = _median_seconds(lambda e=engine, r=requests: e.generate(r, seed=0), repeats)
            out[variable]["engine"].append([size, seconds])
            print(f"engine {variable}={size}: {seconds:.3f} s", flush=True)
        for size in trainer_sizes:
            at = {v: d[1] for v, d in default.items()} | {variable: size}
            seconds = _round_seconds(at, len(tok), tok.pad_token_id, seed=size, repeats=repeats)
            out[variable]["trainer"].append([size, seconds])
            print(f"trainer {variable}={size}: {seconds:.3f} s", flush=True)
    return out


def plot(figures: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(figures), figsize=(4 * len(figures), 3.4))
    names = {
        "B": "B (trajectories / prompts)",
        "S": "S (steps per round)",
        "L": "L (completion tokens)",
        "K": "K (head)",
    }
    for ax, (variable, series) in zip(axes, figures.items(), strict=True):
        for label, points in series.items():
            if points:
                xs, ys = zip(*points, strict=True)
                ax.plot(xs, ys, marker="o", label=label)
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xlabel(names[variable])
        ax.grid(True, which="both", alpha=0.3)
    axes[0].set_ylabel("seconds")
    axes[0].legend()
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=90)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--out", default="docs/performance", help="folder for scaling.json and scaling.png")
    parser.add_argument("--smoke", action="store_true", help="tiny sizes: check that it runs")
    args = parser.parse_args()
    figures = measure(SMOKE_SIZES if args.smoke else SIZES, args.repeats)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "scaling.json").write_text(json.dumps(figures, indent=2) + "\n")
    plot(figures, out / "scaling.png")
    print(f"written to {out / 'scaling.json'} and {out / 'scaling.png'}")


if __name__ == "__main__":
    main()
