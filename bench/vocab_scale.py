"""Serving, recording and a trainer step at V = 5,025 (the lab's vocabulary) and V = 151,669
(Qwen3's), measured side by side in one run: figures.

A randomly initialised model of the lab's shape at each vocabulary serves `--prompts` random
32-token prompts of `--tokens` completion tokens in one batch through the torch engine, plain
(T = 1, unrestricted) and top-p 0.9, as the gateway serves them: recording on, the engine records
each position (the K = 20 head and the kept support) and each call's landing row is built and
appended to a `LandingLog` spool (its Delta commits come after the runs: a caller never waits for
them); recording off, the engine keeps the sampled ids alone (bench.engine's stub) and no row is
made. Then one optimizer step of the trainer (`train_round`, the default estimator, the round's
pi_k computed beforehand) on the plain calls a warm-up run recorded, every completion position
sampled. Each repeat runs every contender once, in turn, recording on and off in alternating
order. The ratios divide this process's CPU seconds (with one torch thread, OMP_NUM_THREADS=1, the
wall time of a server whose cores are its own; on these shared cores a run's wall time moves with
the other sessions' load by more than recording costs), per repeat, median and range:
- serving tokens/s with recording ÷ without, per sampling and vocabulary: the speed a caller
  keeps; the detail gives the tokens/s and recording's share of the recorded run's wall time, timed
  inside it (`Rows.record_sampled`, the rows built and appended);
- serving tokens/s (plain, recording on) at V = 151,669 ÷ at V = 5,025;
- trainer step time at V = 151,669 ÷ at V = 5,025.
Run: `.venv/bin/python -m bench.vocab_scale` (about 2 CPU minutes; or `make bench`).
"""

from __future__ import annotations

import argparse
import copy
import dataclasses
import statistics
import tempfile
import time
from collections import defaultdict
from collections.abc import Callable
from pathlib import Path

import torch

from bench.engine import unrecorded
from bench.ratios import Ratio, alternate, report, seconds_in
from bench.record_bytes import SAMPLING, VOCABULARIES, landing_row
from prodrl_pipeline.engine.rows import Request, Rows
from prodrl_pipeline.engine.sampler import TorchEngine
from prodrl_pipeline.gateway.landing import LandingLog
from prodrl_pipeline.model import TinyQwen3Config, build_model
from prodrl_pipeline.records.store import DeltaStore
from prodrl_pipeline.rl.recorded import RecordedCalls
from prodrl_pipeline.rl.trainer import TrainerConfig, make_optimizer, policy_logprobs, train_round

QUIET = {"flush_records": 10**6, "flush_seconds": 3600.0, "max_pending": 10**6}  # commits after the runs


class _Served:
    """One vocabulary's model and engine: serves its prompts, recording on or off, and keeps per
    run its tokens and the seconds spent recording inside it."""

    def __init__(self, vocab: int, args: argparse.Namespace, landing: LandingLog):
        torch.manual_seed(0)
        config = TinyQwen3Config(hidden_size=args.hidden, intermediate_size=3 * args.hidden)
        self.model = build_model(config, vocab, 0)
        self.engine = TorchEngine(self.model, eos_id=vocab - 1, pad_id=0)
        g = torch.Generator().manual_seed(1)
        self.prompts = [torch.randint(1, vocab - 1, (32,), generator=g).tolist() for _ in range(args.prompts)]
        self.vocab, self.tokens, self.landing, self.calls = vocab, args.tokens, landing, 0
        self.served: dict[str, int] = {}  # tokens of the last run, by contender
        self.inside: dict[str, list[float]] = {name: [] for name in SAMPLING}  # recording seconds a run

    def serve(self, sampling: str, recorded: bool) -> list[dict]:
        """One batch; the landing rows appended (recording on) or none."""
        params = dataclasses.replace(SAMPLING[sampling], max_tokens=self.tokens)
        requests = [Request(p, params) for p in self.prompts]
        if not recorded:
            with unrecorded():
                outs = self.engine.generate(requests, seed=0)
            self.served[f"{sampling} off"] = sum(len(c.token_ids) for c in outs)
            return []
        with seconds_in(Rows, "record_sampled") as spent:
            outs = self.engine.generate(requests, seed=0)
        t0 = time.perf_counter()
        rows = []
        for req, out in zip(requests, outs, strict=True):
            rows.append(landing_row(req, out, params, self.vocab, self.calls))
            self.landing.append("call", rows[-1])
            self.calls += 1
        self.inside[sampling].append(spent["record_sampled"] + time.perf_counter() - t0)
        self.served[f"{sampling} on"] = sum(len(c.token_ids) for c in outs)
        return rows

    def trainer_step(self, rows: list[dict]) -> Callable[[], object]:
        """One optimizer step of the trainer on `rows`, on its own copy of the model."""
        model = copy.deepcopy(self.model).train()
        calls = RecordedCalls.from_rows(rows)
        advantages = [
            {"trajectory_id": row["trajectory_id"], "minibatch": 0, "reward": 0.0, "advantage": i % 3 - 1.0}
            for i, row in enumerate(rows)
        ]
        cfg = TrainerConfig(steps=1, batch_size=len(rows), warmup_steps=0)
        optimizer = make_optimizer(model, cfg, None)
        start = policy_logprobs(model, calls, cfg, 0, fake_quant=False)
        return lambda: train_round(model, optimizer, calls, advantages, cfg, 0, round_start=start)


def arguments() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--prompts", type=int, default=8, help="calls in a batch (and the trainer's)")
    parser.add_argument("--tokens", type=int, default=64, help="completion tokens per call")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--hidden", type=int, default=128, help="the model's width (the lab's: 128)")
    return parser


SMOKE = ["--prompts", "2", "--tokens", "4", "--repeats", "1"]


def _cpu_timed(fn: Callable[[], object], spent: list[float]) -> Callable[[], object]:
    """`fn`, appending this process's CPU seconds of each call to `spent`."""

    def run() -> None:
        t0 = time.process_time()
        fn()
        spent.append(time.process_time() - t0)

    return run


def _timed(served: dict[int, _Served], steps: dict[int, Callable], repeats: int) -> tuple[dict, ...]:
    """Wall and CPU seconds of every run and the tokens it served, by "<vocab> <sampling> on|off"
    and "<vocab> step"; each repeat runs every contender once, recording on and off alternating."""
    wall, cpu, tokens = defaultdict(list), defaultdict(list), defaultdict(list)
    for repeat in range(repeats):
        switches = ("on", "off")[:: 1 if repeat % 2 == 0 else -1]
        runs: dict[str, Callable[[], object]] = {
            f"{vocab} {sampling} {on}": lambda s=s, n=sampling, on=on: s.serve(n, on == "on")
            for vocab, s in served.items()
            for sampling in SAMPLING
            for on in switches
        }
        runs |= {f"{vocab} step": step for vocab, step in steps.items()}
        for name, (t,) in alternate({n: _cpu_timed(fn, cpu[n]) for n, fn in runs.items()}, 1).items():
            wall[name].append(t)
            if not name.endswith("step"):
                vocab, contender = name.split(" ", 1)
                tokens[name].append(served[int(vocab)].served[contender])
    return wall, cpu, tokens


def _measure(args: argparse.Namespace, landing: LandingLog) -> list[Ratio]:
    served = {vocab: _Served(vocab, args, landing) for vocab in VOCABULARIES}
    steps = {vocab: s.trainer_step(s.serve("plain", True)) for vocab, s in served.items()}  # and a warm-up
    for s in served.values():
        s.inside["plain"].clear()
    wall, cpu, tokens = _timed(served, steps, args.repeats)
    med = statistics.median

    def speed(name: str, seconds: dict = cpu) -> list[float]:
        return [n / t for n, t in zip(tokens[name], seconds[name], strict=True)]

    def over(a: list[float], b: list[float]) -> tuple[float, ...]:
        return tuple(x / y for x, y in zip(a, b, strict=True))

    setup = f"{args.prompts} calls x {args.tokens} tokens, hidden size {args.hidden}, {args.repeats} repeats"
    ratios = []
    for vocab, s in served.items():
        for sampling in SAMPLING:
            on, off = f"{vocab} {sampling} on", f"{vocab} {sampling} off"
            share = med(i / t for i, t in zip(s.inside[sampling], wall[on], strict=True))
            ratios.append(
                Ratio(
                    f"serving tokens/s, recording on / off, {sampling}, V = {vocab:,}",
                    over(speed(on), speed(off)),
                    None,
                    detail=(
                        f"{setup}; tokens per CPU second on {med(speed(on)):.0f}, off {med(speed(off)):.0f} "
                        f"(wall-clock {med(speed(on, wall)):.0f} and {med(speed(off, wall)):.0f}); recording "
                        f"(head, support, landing rows) {share:.1%} of the recorded run's wall time"
                    ),
                )
            )
    small, large = (f"{vocab} plain on" for vocab in VOCABULARIES)
    step_small, step_large = (f"{vocab} step" for vocab in VOCABULARIES)
    scale = f"V = {VOCABULARIES[1]:,} / V = {VOCABULARIES[0]:,}"
    return [
        *ratios,
        Ratio(
            f"serving tokens/s, {scale}",
            over(speed(large), speed(small)),
            None,
            detail=(
                f"plain, recording on; {setup}; tokens per CPU second {med(speed(large)):.0f} against "
                f"{med(speed(small)):.0f}"
            ),
        ),
        Ratio(
            f"trainer step time, {scale}",
            over(cpu[step_large], cpu[step_small]),
            None,
            detail=(
                f"one step of train_round on the {args.prompts} plain calls (up to "
                f"{args.prompts * args.tokens} completion tokens, all sampled), hidden size {args.hidden}, "
                f"{args.repeats} repeats; {med(cpu[step_large]):.2f} against {med(cpu[step_small]):.2f} CPU "
                f"seconds ({med(wall[step_large]):.2f} and {med(wall[step_small]):.2f} s wall)"
            ),
        ),
    ]


def measure(args: argparse.Namespace) -> list[Ratio]:
    with tempfile.TemporaryDirectory() as tmp:
        landing = LandingLog(DeltaStore(Path(tmp) / "tables"), Path(tmp) / "spool", **QUIET)
        landing.start()
        try:
            return _measure(args, landing)
        finally:
            landing.stop()


def main() -> None:
    report(measure(arguments().parse_args()))


if __name__ == "__main__":
    main()
