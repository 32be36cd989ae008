"""How the engine's and the trainer's costs grow with B, S, sequence length and K (lab model).

Each point is the median of `--repeats` timings at one size, the others held at the middle value;
the sizes of one variable are timed in turn within each repeat:
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
from collections.abc import Callable
from pathlib import Path

import torch

from bench.ratios import alternate
from prodrl_pipeline.chat.render import load_tokenizer, render_ids
from prodrl_pipeline.engine.processing import SamplingParams
from prodrl_pipeline.engine.rows import Request
from prodrl_pipeline.engine.sampler import TorchEngine
from prodrl_pipeline.envs.chess_env import ChessEpisode
from prodrl_pipeline.envs.lab_data import iter_lab_puzzles
from prodrl_pipeline.model import TinyQwen3Config, build_model
from prodrl_pipeline.records import support
from prodrl_pipeline.rl.recorded import RecordedCalls
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
            **support.columns([support.unrestricted(vocab)] * length),
            "extra_token_ids": [[] for _ in range(length)],
            "vocab_size": vocab,
            "sampling": {"temperature": 1.0, "logit_bias": []},
        }
        for i in range(n)
    ]


def _round(at: dict[str, int], vocab: int, pad_id: int, seed: int) -> Callable[[], object]:
    """A round of S steps of B synthetic calls each, on its own weights and optimizer (each call
    continues from the last: the cost does not depend on the weights)."""
    rows = _synthetic_calls(at["B"] * at["S"], at["L"], at["K"], vocab, seed)
    advantages = [
        {"trajectory_id": c["trajectory_id"], "minibatch": i // at["B"], "reward": 0.0, "advantage": 1.0}
        for i, c in enumerate(rows)
    ]
    calls = RecordedCalls.from_rows(rows)
    cfg = TrainerConfig(steps=at["S"], batch_size=at["B"], warmup_steps=0)
    model = build_model(TinyQwen3Config(), vocab, pad_id)
    optimizer = make_optimizer(model, cfg, None)
    return lambda: train_round(model, optimizer, calls, advantages, cfg, pad_id)


def measure(sizes: dict, repeats: int) -> dict[str, dict[str, list[list[float]]]]:
    """{variable: {"engine" | "trainer": [[size, seconds], ...]}}: per variable and stage, every
    size's run once per repeat, in turn (drift on a noisy machine spreads over all sizes alike)."""
    torch.manual_seed(0)
    tok = load_tokenizer("data/tokenizer")
    model = build_model(TinyQwen3Config(), len(tok), tok.pad_token_id)
    prompts = [render_ids(tok, ChessEpisode(p).messages) for p in iter_lab_puzzles("data", "heldout")]
    default = {v: (_middle(e) if e else None, _middle(t)) for v, (e, t) in sizes.items()}
    out: dict[str, dict[str, list[list[float]]]] = {v: {"engine": [], "trainer": []} for v in sizes}
    for variable, (engine_sizes, trainer_sizes) in sizes.items():
        runs: dict[str, dict[int, Callable[[], object]]] = {"engine": {}, "trainer": {}}
        for size in engine_sizes:
            at = {v: d[0] for v, d in default.items()} | {variable: size}
            engine = TorchEngine(model, tok.eos_token_id, tok.pad_token_id, top_logprobs=at["K"])
            requests = [Request(p, SamplingParams(max_tokens=at["L"])) for p in prompts[: at["B"]]]
            runs["engine"][size] = lambda e=engine, r=requests: e.generate(r, seed=0)
        for size in trainer_sizes:
            at = {v: d[1] for v, d in default.items()} | {variable: size}
            runs["trainer"][size] = _round(at, len(tok), tok.pad_token_id, seed=size)
        for stage, by_size in runs.items():
            if not by_size:
                continue
            with torch.inference_mode(stage == "engine"):
                times = alternate({str(size): fn for size, fn in by_size.items()}, repeats)
            for size in by_size:
                seconds = statistics.median(times[str(size)])
                out[variable][stage].append([size, seconds])
                print(f"{stage} {variable}={size}: {seconds:.3f} s", flush=True)
    return out


def plot(figures: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import matplotlib.ticker

    fig, axes = plt.subplots(1, len(figures), figsize=(4 * len(figures), 3.4))
    names = {
        "B": "B (trajectories / prompts)",
        "S": "S (steps per round)",
        "L": "L (completion tokens)",
        "K": "K (head)",
    }
    plain = matplotlib.ticker.FuncFormatter(lambda x, _: f"{x:g}")
    for ax, (variable, series) in zip(axes, figures.items(), strict=True):
        for (label, points), color in zip(series.items(), ("C0", "C1"), strict=True):
            if points:
                xs, ys = zip(*points, strict=True)
                ax.plot(xs, ys, marker="o", label=label, color=color)
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xticks(sorted({size for points in series.values() for size, _ in points}))
        for axis in (ax.xaxis, ax.yaxis):
            axis.set_major_formatter(plain)
            axis.set_minor_formatter(plain)
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
