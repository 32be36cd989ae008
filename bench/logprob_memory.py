"""Peak memory of the trainer's chunked log-probs vs the naive full-vocabulary log-softmax.

Each variant runs in a fresh process (so the peak-RSS high-water mark is its own): forward and
backward of the sampled tokens' log-probs for N completion tokens at vocabulary V (>= 8k). Reported:
peak RSS growth over the process's RSS after set-up, and chunked / naive. Goal: <= 0.30.
Run: `make bench` (or `.venv/bin/python -m bench.logprob_memory`).
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys

import torch

from bench.ratios import Ratio, report
from prodrl_pipeline.records import support
from prodrl_pipeline.rl.recorded import RecordedCalls


def _rss_kb(field: str) -> int:
    with open("/proc/self/status") as fh:
        for line in fh:
            if line.startswith(field):
                return int(line.split()[1])
    raise RuntimeError(f"{field} not in /proc/self/status")


def _run(variant: str, tokens: int, vocab: int, hidden: int, chunk: int) -> None:
    from prodrl_pipeline.model import TinyQwen3Config, build_model
    from prodrl_pipeline.rl.logprobs import build_sequences, project_logprobs

    torch.manual_seed(0)
    model = build_model(TinyQwen3Config(hidden_size=hidden), vocab, 0)
    n_calls, length = 16, tokens // 16
    g = torch.Generator().manual_seed(0)
    calls = [
        {
            "call_id": f"c{i}",
            "trajectory_id": f"t{i}",
            "call_index": 0,
            "prompt_token_ids": torch.randint(1, vocab, (32,), generator=g).tolist(),
            "completion_token_ids": torch.randint(1, vocab, (length,), generator=g).tolist(),
            "completion_logprobs": [-1.0] * length,
            "topk_token_ids": [[1] * 20] * length,
            "topk_logprobs": [[-1.0] * 20] * length,
            **support.columns([support.unrestricted(vocab)] * length),
            "vocab_size": vocab,
            "sampling": {"temperature": 1.0},
        }
        for i in range(n_calls)
    ]
    seqs = build_sequences(RecordedCalls.from_rows(calls), 0)
    with torch.no_grad():  # the trunk is the same for both variants: measure the vocabulary part only
        hidden = model.base_model(
            input_ids=seqs.input_ids, attention_mask=seqs.attention_mask
        ).last_hidden_state
    h = hidden[seqs.token_row, seqs.token_pos].requires_grad_(True)  # [tokens, H]
    weight = model.lm_head.weight
    before = _rss_kb("VmRSS")
    if variant == "naive":  # log_softmax over the full [tokens, V] logits, then gather
        logp = (h @ weight.T).log_softmax(-1).gather(1, seqs.token_ids[:, None])
    else:
        logp = project_logprobs(h, weight, seqs, chunk).logprobs
    logp.sum().backward()
    print((_rss_kb("VmHWM") - before) / 1024)


def arguments() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--tokens", type=int, default=16384)
    parser.add_argument("--vocab", type=int, default=8192)
    parser.add_argument("--hidden", type=int, default=128)
    parser.add_argument("--chunk", type=int, default=1024)
    parser.add_argument("--repeats", type=int, default=1, help="fresh process pairs")
    parser.add_argument("--variant", choices=["naive", "chunked"], help="(internal) run one variant")
    return parser


SMOKE = ["--tokens", "512", "--vocab", "2048", "--chunk", "128"]


def measure(args: argparse.Namespace) -> list[Ratio]:
    peaks: dict[str, list[float]] = {"naive": [], "chunked": []}
    for _ in range(args.repeats):
        for variant in peaks:
            cmd = [sys.executable, "-m", "bench.logprob_memory", "--variant", variant]
            for flag in ("tokens", "vocab", "hidden", "chunk"):
                cmd += [f"--{flag}", str(getattr(args, flag))]
            done = subprocess.run(cmd, check=True, capture_output=True, text=True)
            peaks[variant].append(float(done.stdout.split()[-1]))
    return [
        Ratio(
            "peak memory, chunked log-probs / naive",
            tuple(c / n for c, n in zip(peaks["chunked"], peaks["naive"], strict=True)),
            0.30,
            at_least=False,
            detail=(
                f"{args.tokens} tokens at V={args.vocab}, forward + backward, peak RSS growth: naive "
                f"{statistics.median(peaks['naive']):.0f} MiB, chunked ({args.chunk} tokens) "
                f"{statistics.median(peaks['chunked']):.0f} MiB"
            ),
        )
    ]


def main() -> None:
    args = arguments().parse_args()
    if args.variant:
        return _run(args.variant, args.tokens, args.vocab, args.hidden, args.chunk)
    return report(measure(args))


if __name__ == "__main__":
    main()
