"""GPU check of the scaled-out trainer (scripts/gpu_check.sh runs it; a few minutes on one GPU).

1. Records a round of lab traffic (64 train puzzles, the lab-size model, the embedded engine on
   the CPU, full-precision export) into Delta tables, with synthetic advantages (-1, 0, 1: a
   fresh model solves nothing, and a zero advantage would leave nothing to compare).
2. Trains that round from the same parent three ways: single process on the CPU, single process
   on the GPU (`TrainerConfig.device`), and under torchrun with FSDP2 over NCCL, one process per
   GPU (`rl/train_distributed.py`). Prints each step's loss, the largest parameter difference of
   the GPU runs from the CPU run, and the engine-vs-trainer mismatch |log pi_k - log mu|.
3. Times one step on the CPU and on the GPU (the same 64 trajectories).
Prints one JSON object. Needs CUDA, torch, transformers, deltalake and chess; `--prepare DIR`
records step 1 on any machine, `--prepared DIR` trains it on the GPU machine.

    python -m bench.gpu_check
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict
from pathlib import Path

import torch

from prodrl_pipeline.records.store import DeltaStore
from prodrl_pipeline.rl.checkpoint import load_checkpoint, save_checkpoint
from prodrl_pipeline.rl.recorded import RecordedCalls
from prodrl_pipeline.rl.trainer import TrainerConfig, make_optimizer, train_round

REPO = Path(__file__).resolve().parent.parent
PUZZLES, STEPS, BATCH = 64, 2, 32


def _train(parent: Path, calls: RecordedCalls, adv: list[dict], cfg: TrainerConfig, pad: int) -> tuple:
    model, state, meta = load_checkpoint(parent)
    model.to(cfg.device)
    opt = make_optimizer(model, cfg, state)
    t0 = time.perf_counter()
    rows = train_round(model, opt, calls, adv, cfg, pad, first_step=meta["step"])
    if cfg.device != "cpu":
        torch.cuda.synchronize()
    return model.to("cpu"), rows, time.perf_counter() - t0


def _max_diff(a: torch.nn.Module, b: torch.nn.Module) -> float:
    return max((x - y).abs().max().item() for x, y in zip(a.parameters(), b.parameters(), strict=True))


def prepare(root: Path) -> None:
    """Record the round into `root`: tables/ (calls, advantages) and parent/ (the checkpoint)."""
    # the engine and the environment are imported here: the GPU side (`check`) needs neither
    from prodrl_pipeline.chat.render import load_tokenizer  # noqa: PLC0415
    from prodrl_pipeline.engine.processing import SamplingParams  # noqa: PLC0415
    from prodrl_pipeline.engine.sampler import TorchEngine  # noqa: PLC0415
    from prodrl_pipeline.envs.lab_data import iter_lab_puzzles  # noqa: PLC0415
    from prodrl_pipeline.envs.rollout import play  # noqa: PLC0415
    from prodrl_pipeline.model import TinyQwen3Config, build_model  # noqa: PLC0415

    tok = load_tokenizer(REPO / "data" / "tokenizer")
    model = build_model(TinyQwen3Config(), len(tok), tok.pad_token_id)
    engine = TorchEngine(model, tok.eos_token_id, tok.pad_token_id, top_logprobs=20)
    puzzles = list(iter_lab_puzzles(REPO / "data", "train"))[:PUZZLES]
    rollouts = play(engine, tok, puzzles, SamplingParams(), deployment_id="base", round_=1, seed=0)
    adv = [
        {
            "trajectory_id": t["trajectory_id"],
            "round": 1,
            "minibatch": i % STEPS,
            "reward": t["reward"],
            "baseline": 0.0,
            "advantage": float(i % 3 - 1),
        }
        for i, t in enumerate(rollouts.trajectories)
    ]
    save_checkpoint(root / "parent", model, None, {"step": 0})
    store = DeltaStore(root / "tables")
    store.overwrite_round("calls", rollouts.calls, 1)
    store.overwrite_round("advantages", adv, 1)


def check(root: Path) -> dict:
    """Train the recorded round on the CPU, the GPU and with FSDP2 over NCCL; compare."""
    assert torch.cuda.is_available(), "the GPU check needs CUDA"
    store = DeltaStore(root / "tables")
    calls, adv = RecordedCalls.from_arrow(store.read("calls", 1)), store.read("advantages", 1).to_pylist()
    model, _, _ = load_checkpoint(root / "parent")
    pad = model.config.pad_token_id
    cfg = TrainerConfig(steps=STEPS, batch_size=BATCH, lr=1e-3, warmup_steps=0)
    report: dict = {
        "device": torch.cuda.get_device_name(),
        "torch": torch.__version__,
        "gpus": torch.cuda.device_count(),
        "calls": len(calls),
        "completion_tokens": int(calls.completion.lengths.sum()),
    }
    cpu, cpu_rows, cpu_s = _train(root / "parent", calls, adv, cfg, pad)
    gpu_cfg = TrainerConfig(**{**asdict(cfg), "estimator": cfg.estimator, "device": "cuda"})
    _train(root / "parent", calls, adv, gpu_cfg, pad)  # warm-up: CUDA kernels
    gpu, gpu_rows, gpu_s = _train(root / "parent", calls, adv, gpu_cfg, pad)
    trainer = {k: v for k, v in asdict(cfg).items() if k not in ("estimator", "device")}
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")])),
    }
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp)
        run = subprocess.run(
            [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node",
             str(torch.cuda.device_count()), "-m", "prodrl_pipeline.rl.train_distributed",
             "--tables", str(root / "tables"), "--round", "1", "--parent", str(root / "parent"),
             "--out", str(out / "fsdp"), "--trainer", json.dumps(trainer),
             "--pad-id", str(pad), "--rows", str(out / "rows.json")],
            capture_output=True, text=True, timeout=600, env=env,
        )  # fmt: skip
        if run.returncode:
            report["fsdp2_error"] = run.stderr[-3000:]
        else:
            fsdp_rows = json.loads((out / "rows.json").read_text())
            fsdp, _, fsdp_meta = load_checkpoint(out / "fsdp")
            report["fsdp2_nccl"] = {
                "processes": fsdp_meta["data_parallel"],
                "loss": [r["loss"] for r in fsdp_rows],
                "max_param_diff_from_cpu": _max_diff(fsdp, cpu),
            }
    return report | {
        "loss_cpu": [r["loss"] for r in cpu_rows],
        "loss_gpu": [r["loss"] for r in gpu_rows],
        "max_param_diff_gpu_vs_cpu": _max_diff(gpu, cpu),
        "params_moved": _max_diff(cpu, model),
        "engine_mismatch_cpu": [r["engine_mismatch"] for r in cpu_rows],
        "engine_mismatch_gpu": [r["engine_mismatch"] for r in gpu_rows],
        "round_seconds_cpu": cpu_s,
        "round_seconds_gpu": gpu_s,
        "gpu_speedup": cpu_s / gpu_s,
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--prepared", type=Path, help="a folder `--prepare` wrote (default: record now)")
    p.add_argument("--prepare", type=Path, help="only record the round into this folder (no GPU needed)")
    args = p.parse_args()
    if args.prepare:
        prepare(args.prepare)
        return
    with tempfile.TemporaryDirectory() as tmp:
        root = args.prepared or Path(tmp)
        if not args.prepared:
            prepare(root)
        print(json.dumps(check(root), indent=1))


if __name__ == "__main__":
    main()
