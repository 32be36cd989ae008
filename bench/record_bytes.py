"""Bytes recorded per completion token at V = 5,025 (the lab's vocabulary) and V = 151,669 (Qwen3's):
figures.

A randomly initialised small model at each vocabulary size (its next-token distributions have a
high-entropy head, as a high-temperature production model's do: a top-p 0.9 support keeps most of
the vocabulary) serves `--calls` calls of `--tokens` completion tokens each through the torch
engine, plain (T = 1, unrestricted) and top-p 0.9. Each call is written as the gateway records it
(one `calls` row) to one snappy parquet file alone, as the issue measured it; its size over its
completion tokens is one sample. The table shows the median and the range (its high end: the worst
call). The support's own record is at most ceil(V / 8) bytes a position (records/support.py); the
detail line gives the worst call beside V / 8 + 200, the bound docs/tables.md states.
Run: `.venv/bin/python -m bench.record_bytes` (or `make bench`).
"""

from __future__ import annotations

import argparse
import dataclasses
import io
import json
from datetime import UTC, datetime

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import torch

from bench.ratios import Ratio, report
from prodrl_pipeline.engine.processing import SamplingParams
from prodrl_pipeline.engine.rows import Completion, Request
from prodrl_pipeline.engine.sampler import TorchEngine
from prodrl_pipeline.model import TinyQwen3Config, build_model
from prodrl_pipeline.records import support
from prodrl_pipeline.records.schema import LANDING_CALLS

VOCABULARIES = (5_025, 151_669)
SAMPLING = {"plain": SamplingParams(temperature=1.0), "top-p 0.9": SamplingParams(temperature=1.0, top_p=0.9)}
SLACK = 200  # bytes a position beside V / 8: the head, the sampled id and log-prob, the tags


def landing_row(req: Request, out: Completion, params: SamplingParams, vocab: int, i: int) -> dict:
    """The call as the gateway records it (gateway/serving.py)."""
    return {
        "call_id": f"c{i}",
        "trajectory_id": f"t{i}",
        "call_index": 0,
        "deployment_id": "d",
        "prompt_token_ids": req.prompt_ids,
        "completion_token_ids": out.token_ids,
        "completion_logprobs": out.logprobs,
        "topk_token_ids": out.topk_ids,
        "topk_logprobs": out.topk_logprobs,
        **support.columns(out.supports),
        "extra_token_ids": out.extra_ids,
        "vocab_size": vocab,
        "sampling": params.recorded(i),
        "finish_reason": out.finish_reason,
        "messages_json": json.dumps([{"role": "user", "content": "hi"}]),
        "created_at": datetime.now(UTC),
    }


def _parquet_bytes(row: dict) -> int:
    buffer = io.BytesIO()
    pq.write_table(pa.Table.from_pylist([row], schema=LANDING_CALLS), buffer, compression="snappy")
    return buffer.tell()


def _bytes_per_token(vocab: int, params: SamplingParams, calls: int, tokens: int) -> list[float]:
    torch.manual_seed(0)
    model = build_model(TinyQwen3Config(), vocab, 0)
    engine = TorchEngine(model, eos_id=vocab - 1, pad_id=0)
    g = torch.Generator().manual_seed(1)
    params = dataclasses.replace(params, max_tokens=tokens)
    requests = [
        Request(torch.randint(1, vocab - 1, (32,), generator=g).tolist(), params) for _ in range(calls)
    ]
    outs = engine.generate(requests, seed=0)
    return [
        _parquet_bytes(landing_row(req, out, params, vocab, i)) / len(out.token_ids)
        for i, (req, out) in enumerate(zip(requests, outs, strict=True))
    ]


def arguments() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--calls", type=int, default=8, help="calls per vocabulary and sampling")
    parser.add_argument("--tokens", type=int, default=64, help="completion tokens per call")
    return parser


SMOKE = ["--calls", "2", "--tokens", "4"]


def measure(args: argparse.Namespace) -> list[Ratio]:
    ratios = []
    for vocab in VOCABULARIES:
        for name, params in SAMPLING.items():
            samples = _bytes_per_token(vocab, params, args.calls, args.tokens)
            bound = vocab / 8 + SLACK
            ratios.append(
                Ratio(
                    f"bytes per completion token, {name}, V = {vocab:,}",
                    tuple(samples),
                    None,
                    detail=(
                        f"{args.calls} calls of {args.tokens} tokens, one row as snappy parquet; median "
                        f"{np.median(samples):,.0f}, worst {max(samples):,.0f} (V/8 + {SLACK} = {bound:,.0f})"
                    ),
                )
            )
    return ratios


def main() -> None:
    report(measure(arguments().parse_args()))


if __name__ == "__main__":
    main()
