"""Engine mismatch per sampled token: a W4A4 deployment against a W4A16 one of the same checkpoint.

The lab's base model (`LabResource` defaults for `--mode`, warm-started as `base_model` does) is
exported to NVFP4 as the `deployment` asset does (activation scales calibrated on the first 16
calls of recorded traffic), served W4A16 (`nvfp4`) and W4A4 (`nvfp4_w4a4`), and plays the same
train puzzles with the lab's sampling. Per recorded position, the engine mismatch
|log pi_k(a) - log mu(a)| against the trainer's fp32 forward of the checkpoint (pi over the
recorded support, as the trainer computes it), over the sampled positions (kept support > 1 token;
the trainer's `engine_mismatch` counts exactly these) and over every completion position (forced
tokens add 0). The base export's own calibration (a fixed random batch: `base_model` passes no
traffic) is reported too; `--base` measures a saved model instead of warm-starting one.
Run: `.venv/bin/python -m bench.w4a4_mismatch` (~3 min on 2 idle cores; `--mode free_text` for the
free-text lab's traffic, whose turns sample ~50 tokens each).
"""

from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

from prodrl_pipeline.engine.sampler import TorchEngine
from prodrl_pipeline.envs.rollout import play
from prodrl_pipeline.model import build_model, load_model, pad_id
from prodrl_pipeline.quant.nvfp4 import export_deployment, load_deployment
from prodrl_pipeline.rl.recorded import RecordedCalls
from prodrl_pipeline.rl.trainer import policy_logprobs
from prodrl_pipeline.rl.warmstart import solved_turns, warm_start
from resources.lab import LabResource

CALIBRATION_CALLS = 16  # as assets/deployment.py


def arguments() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--puzzles", type=int, default=256, help="train puzzles played per deployment")
    parser.add_argument("--mode", choices=["structured", "free_text"], default="structured")
    parser.add_argument("--warm-start-steps", type=int, help="default: the mode's (LabResource)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--base", default="", help="a saved model (bench.free_text_base --save) instead of a warm start"
    )
    return parser


def mismatch(model: torch.nn.Module, rows: list[dict], lab: LabResource) -> dict[str, float]:
    """Mean |log pi_k - log mu| over sampled and over all completion positions of `rows`."""
    calls = RecordedCalls.from_rows(rows)
    pi_k = policy_logprobs(model, calls, lab.trainer(), lab.pad_id(), fake_quant=False)
    diff = torch.cat([pi_k[c] for c in calls.call_id]).double() - torch.from_numpy(calls.completion_logprobs)
    sampled = torch.from_numpy(calls.support.size > 1)
    return {
        "calls": len(calls),
        "positions": len(diff),
        "sampled": int(sampled.sum()),
        "per sampled token": float(diff[sampled].abs().mean()),
        "p90 sampled": float(diff[sampled].abs().quantile(0.9)),
        "per position": float(diff.abs().mean()),
    }


def measure(args: argparse.Namespace) -> dict[str, dict[str, float]]:
    steps = {} if args.warm_start_steps is None else {"warm_start_steps": args.warm_start_steps}
    lab = LabResource(mode=args.mode, seed=args.seed, **steps)
    tok = lab.tokenizer()
    if args.base:
        if args.warm_start_steps is not None:
            raise SystemExit("--base measures a saved model: --warm-start-steps does not apply")
        model = load_model(args.base)
        if model.config.vocab_size != len(tok):
            raise SystemExit(
                f"{args.base} has a vocabulary of {model.config.vocab_size}, --mode {args.mode}'s {len(tok)}"
            )
    else:
        model = build_model(lab.tiny_model(), len(tok), tok.pad_token_id)
        turns = solved_turns(tok, lab.warm_start().demonstrations(lab.puzzles("warmup")), lab.mode)
        t0 = time.perf_counter()
        warm_start(model, turns, lab.warm_start(), tok.pad_token_id)
        print(f"warm start: {time.perf_counter() - t0:.0f} s", flush=True)
    puzzles = list(np.random.default_rng(args.seed).choice(lab.puzzles("train"), args.puzzles, replace=False))

    def serve(path: Path, quant_format: str) -> list[dict]:
        engine = TorchEngine(
            load_deployment(path, quant_format), tok.eos_token_id, pad_id(tok), lab.top_logprobs
        )
        t0 = time.perf_counter()
        calls = play(
            engine,
            tok,
            puzzles,
            lab.sampling(),
            deployment_id=quant_format,
            round_=1,
            seed=args.seed,
            mode=lab.mode,
            constrain=lab.constrain_moves,
        ).calls
        print(
            f"{path.name} {quant_format}: {len(calls)} calls in {time.perf_counter() - t0:.1f} s", flush=True
        )
        return calls

    out = {}
    with tempfile.TemporaryDirectory() as tmp:
        stand_in, traffic = Path(tmp) / "stand-in", Path(tmp) / "traffic"
        export_deployment(model, stand_in, "nvfp4")  # calibrated on the fixed random batch
        calls = serve(stand_in, "nvfp4")
        calibration = [c["prompt_token_ids"] + c["completion_token_ids"] for c in calls[:CALIBRATION_CALLS]]
        export_deployment(model, traffic, "nvfp4", calibration)
        out["W4A16"] = mismatch(model, serve(traffic, "nvfp4"), lab)
        out["W4A4"] = mismatch(model, serve(traffic, "nvfp4_w4a4"), lab)
        out["W4A4, base's stand-in calibration"] = mismatch(model, serve(stand_in, "nvfp4_w4a4"), lab)
    return out


def main() -> None:
    results = measure(arguments().parse_args())
    keys = list(next(iter(results.values())))
    print("| deployment | " + " | ".join(keys) + " |")
    print("|---" * (len(keys) + 1) + "|")
    for name, row in results.items():
        cells = [f"{v:.4f}" if isinstance(v, float) else str(v) for v in row.values()]
        print(f"| {name} | " + " | ".join(cells) + " |")


if __name__ == "__main__":
    main()
