"""The embedded engine's decode speed against Hugging Face `generate`, and the cost of recording.

The same lab model (random weights from a fixed seed: speed does not depend on them), the same
left-padded lab prompts, the same sampling (T = 1, no top-k / top-p, no constraint), the same
token budget; the engine records what it always records (the K = 20 head). Each repeat times one
run of each contender, the engine and its stubbed twin back to back in alternating order. Ratios
(median and range over the repeats):
- engine tokens/s ÷ `generate` tokens/s: a figure;
- recording's share of the engine's time, goal <= 0.05: each repeat times `Rows.record_sampled`
  (the log-prob, head, support and extra samples of every position) inside the engine's run, ÷ the
  run's seconds. It counts what recording costs inside that call, not what it causes elsewhere
  (freeing its arrays, collections triggered outside it). Beside it, the same call with recording
  stubbed out (only the sampled ids kept), and the two whole runs side by side (they differ by 20%
  and more from one run to the next on these machines, more than recording costs).
Also shown: the share of the engine's time spent in the model's forward passes (with everything
else free, the first ratio could grow by 1 ÷ that share at most), and the share that the K = 20
head alone would take (what recording the head cannot avoid), as the engine computes it
(`engine/head.py`: the compiled kernel) and as `torch.topk` does: timed on their own, every row at
every step, on random log-probs that change at every step as a decode step's do (the same matrix
over and over would train the branch predictor), with full supports and with supports cut to a
top-p 0.9 nucleus (-inf elsewhere: a mask's rows); inside a run each reads higher. `--hidden` sets
the model's width (the lab's: 128).
Run: `make bench` (or `.venv/bin/python -m bench.engine`).
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections import defaultdict
from collections.abc import Iterator
from contextlib import contextmanager

import torch

from bench.ratios import Ratio, alternate, report, seconds_in
from prodrl_pipeline.chat.render import load_tokenizer, render_ids
from prodrl_pipeline.engine.head import recorded_head
from prodrl_pipeline.engine.processing import SamplingParams, processed_logprobs
from prodrl_pipeline.engine.rows import NO_IDS, Request, Rows
from prodrl_pipeline.engine.sampler import TorchEngine
from prodrl_pipeline.envs.chess_env import ChessEpisode
from prodrl_pipeline.envs.lab_data import iter_lab_puzzles
from prodrl_pipeline.model import TinyQwen3Config, build_model
from prodrl_pipeline.records.support import Form, Support


def _engine_tokens(engine: TorchEngine, prompts: list[list[int]], new_tokens: int) -> int:
    params = SamplingParams(max_tokens=new_tokens)
    done = engine.generate([Request(p, params) for p in prompts], seed=0)
    return sum(len(c.token_ids) for c in done)


NOTHING_KEPT = Support(0, Form.VOCABULARY)  # the stub records no support (a size no reader sees)


def _ids_only(batch: Rows, logp, sampled, extra) -> list[int]:  # noqa: ANN001
    """`Rows.record_sampled` with the recording stubbed out: each live row keeps its id alone (the
    other fields one shared empty array: nothing allocated)."""
    toks = sampled.tolist()
    for i, tok in enumerate(toks):
        if not batch.done[i]:
            batch.append(i, tok, 0.0, NO_IDS, NO_IDS, NOTHING_KEPT, NO_IDS)
    return toks


@contextmanager
def unrecorded() -> Iterator[None]:
    """The engine's runs inside the block record nothing but the sampled ids (`_ids_only`)."""
    recorded = Rows.record_sampled
    Rows.record_sampled = _ids_only
    try:
        yield
    finally:
        Rows.record_sampled = recorded


def _hf_tokens(model, prompts: list[list[int]], new_tokens: int, pad_id: int, eos_id: int) -> int:
    width = max(map(len, prompts))
    ids = torch.tensor([[pad_id] * (width - len(p)) + p for p in prompts])
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
    out = model.generate(
        input_ids=ids,
        attention_mask=mask,
        do_sample=True,
        temperature=1.0,
        top_k=0,
        top_p=1.0,
        max_new_tokens=new_tokens,
        pad_token_id=pad_id,
        eos_token_id=eos_id,
    )[:, width:]
    # tokens up to and including each row's first end-of-sequence (later ones are padding)
    ended = (out == eos_id).cumsum(-1)
    return int(((ended == 0) | ((ended == 1) & (out == eos_id))).sum())


@contextmanager
def _forward_seconds(model) -> Iterator[list[float]]:  # noqa: ANN001
    """Seconds spent inside `model`'s forward passes while the block runs (hooks, no change)."""
    spent, start = [0.0], [0.0]
    pre = model.register_forward_pre_hook(lambda *_: start.__setitem__(0, time.perf_counter()))
    post = model.register_forward_hook(
        lambda *_: spent.__setitem__(0, spent[0] + time.perf_counter() - start[0])
    )
    try:
        yield spent
    finally:
        pre.remove()
        post.remove()


def _head_seconds(rows: int, vocab: int, steps: int, k: int = 20) -> dict[str, float]:
    """Seconds of a K head of [rows, vocab] log-probs once per decode step, on 8 matrices in turn:
    as the engine computes it (`recorded_head`) and by `torch.topk`; on full supports and on
    supports cut to a top-p 0.9 nucleus (-inf elsewhere, as `processed_logprobs` leaves them)."""
    logits = [torch.randn(rows, vocab).mul(3) for _ in range(8)]
    full = [x.log_softmax(-1) for x in logits]
    ones, nucleus = torch.ones(rows), torch.full((rows,), 0.9)
    cut = [processed_logprobs(x, ones, torch.zeros(rows, dtype=torch.long), nucleus) for x in logits]
    sampled = torch.zeros(rows, dtype=torch.long)
    spent = {}
    for rows_of, logp in (("", full), (" top-p", cut)):
        for name, head in (("head", lambda x: recorded_head(x, k, sampled)), ("topk", lambda x: x.topk(k))):
            start = time.perf_counter()
            for step in range(steps):
                head(logp[step % len(logp)])
            spent[name + rows_of] = time.perf_counter() - start
    return spent


def arguments() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--prompts", type=int, default=64)
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=9)
    parser.add_argument(
        "--hidden", type=int, default=128, help="the model's width (the lab's: 128; SwiGLU 3x it)"
    )
    return parser


SMOKE = ["--prompts", "4", "--new-tokens", "4", "--repeats", "1"]


def measure(args: argparse.Namespace) -> list[Ratio]:
    torch.manual_seed(0)
    tok = load_tokenizer("data/tokenizer")
    config = TinyQwen3Config(hidden_size=args.hidden, intermediate_size=3 * args.hidden)
    model = build_model(config, len(tok), tok.pad_token_id).eval()
    puzzles = list(iter_lab_puzzles("data", "heldout"))[: args.prompts]
    prompts = [render_ids(tok, ChessEpisode(p).messages) for p in puzzles]
    engine = TorchEngine(model, tok.eos_token_id, tok.pad_token_id)
    tokens: dict[str, int] = {}
    inside: dict[str, list[float]] = {"forward": [], "recording": [], "stub": []}  # seconds per run

    def run(name: str) -> None:
        if name == "generate":
            tokens[name] = _hf_tokens(model, prompts, args.new_tokens, tok.pad_token_id, tok.eos_token_id)
        elif name == "unrecorded":
            with unrecorded(), seconds_in(Rows, "record_sampled") as stub:
                tokens[name] = _engine_tokens(engine, prompts, args.new_tokens)
            inside["stub"].append(stub["record_sampled"])
        else:
            with _forward_seconds(model) as spent, seconds_in(Rows, "record_sampled") as recording:
                tokens[name] = _engine_tokens(engine, prompts, args.new_tokens)
            inside["forward"].append(spent[0])
            inside["recording"].append(recording["record_sampled"])

    with torch.inference_mode():
        _engine_tokens(engine, prompts[:4], 4)  # warm-up
        _hf_tokens(model, prompts[:4], 4, tok.pad_token_id, tok.eos_token_id)
        per_run: dict[str, list[float]] = {"engine": [], "unrecorded": [], "generate": []}
        head_share: dict[str, list[float]] = defaultdict(list)
        seconds: dict[str, list[float]] = {"engine": [], "unrecorded": []}
        for repeat in range(args.repeats):  # tokens/s of each run (a contender's token count may vary)
            pair = ["engine", "unrecorded"][:: 1 if repeat % 2 == 0 else -1]  # back to back, alternating
            times = alternate({name: lambda n=name: run(n) for name in [*pair, "generate"]}, 1)
            for name in per_run:
                per_run[name].append(tokens[name] / times[name][0])
            steps = -(-tokens["engine"] // len(prompts))  # decode steps at least
            for name, spent in _head_seconds(len(prompts), len(tok), steps).items():
                head_share[name].append(spent / times["engine"][0])
            seconds["engine"].append(times["engine"][0])
            seconds["unrecorded"].append(times["unrecorded"][0])
    share = {  # of the run it was timed in
        name: statistics.median(t / r for t, r in zip(inside[name], seconds[timed_in], strict=True))
        for name, timed_in in (("forward", "engine"), ("recording", "engine"), ("stub", "unrecorded"))
    }
    whole_runs = [e / u for e, u in zip(per_run["engine"], per_run["unrecorded"], strict=True)]
    detail = (
        f"lab model (hidden size {args.hidden}), {args.prompts} prompts x up to {args.new_tokens} new "
        f"tokens, T=1, K=20 recorded, {args.repeats} repeats; tokens/s engine "
        f"{statistics.median(per_run['engine']):.0f}, generate {statistics.median(per_run['generate']):.0f}; "
        f"the model's forward passes are {share['forward']:.0%} of the engine's time"
    )
    return [
        Ratio(
            "engine decode tokens/s / transformers generate",
            tuple(e / g for e, g in zip(per_run["engine"], per_run["generate"], strict=True)),
            None,
            detail=detail,
        ),
        Ratio(
            "recording K=20 / engine time",
            tuple(r / t for r, t in zip(inside["recording"], seconds["engine"], strict=True)),
            0.05,
            at_least=False,
            detail=(
                f"hidden size {args.hidden}; recording stubbed out takes {share['stub']:.1%} of its run's "
                f"time; the K=20 head alone: "
                f"{statistics.median(head_share['head']):.1%} (torch.topk "
                f"{statistics.median(head_share['topk']):.1%}), on supports cut to top-p 0.9 "
                f"{statistics.median(head_share['head top-p']):.1%} ("
                f"{statistics.median(head_share['topk top-p']):.1%}); whole runs side by side: "
                f"{statistics.median(whole_runs):.2f} ({min(whole_runs):.2f}-{max(whole_runs):.2f})"
            ),
        ),
    ]


def main() -> None:
    report(measure(arguments().parse_args()))


if __name__ == "__main__":
    main()
