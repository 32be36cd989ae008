"""The embedded engine's decode speed against Hugging Face `generate`, measured side by side.

The same lab model (random weights from a fixed seed: speed does not depend on them), the same
left-padded lab prompts, the same sampling (T = 1, no top-k / top-p, no constraint), the same
token budget; the engine records what it always records (the K = 20 head). Each repeat times one
run of each, alternating; the ratio is generated tokens per second, engine ÷ `generate`, median
and range over the repeats. Issue 15's goal is >= 1.5. Run: `make bench`.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from prodrl_pipeline.engine.processing import SamplingParams
from prodrl_pipeline.engine.sampler import Request, TorchEngine
from prodrl_pipeline.envs.chat import load_tokenizer, render_ids
from prodrl_pipeline.envs.chess_env import ChessEpisode
from prodrl_pipeline.envs.lab_data import iter_lab_puzzles
from prodrl_pipeline.model import TinyQwen3Config, build_model


def _engine_tokens(engine: TorchEngine, prompts: list[list[int]], new_tokens: int) -> int:
    params = SamplingParams(max_tokens=new_tokens)
    done = engine.generate([Request(p, params) for p in prompts], seed=0)
    return sum(len(c.token_ids) for c in done)


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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--prompts", type=int, default=64)
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    torch.manual_seed(0)
    tok = load_tokenizer("data/tokenizer")
    model = build_model(TinyQwen3Config(), len(tok), tok.pad_token_id).eval()
    puzzles = list(iter_lab_puzzles("data", "heldout"))[: args.prompts]
    prompts = [render_ids(tok, ChessEpisode(p).messages) for p in puzzles]
    engine = TorchEngine(model, tok.eos_token_id, tok.pad_token_id)
    rates: dict[str, list[float]] = {"engine": [], "generate": []}
    with torch.inference_mode():
        _engine_tokens(engine, prompts[:4], 4)  # warm-up
        _hf_tokens(model, prompts[:4], 4, tok.pad_token_id, tok.eos_token_id)
        for _ in range(args.repeats):
            t0 = time.perf_counter()
            n = _engine_tokens(engine, prompts, args.new_tokens)
            rates["engine"].append(n / (time.perf_counter() - t0))
            t0 = time.perf_counter()
            n = _hf_tokens(model, prompts, args.new_tokens, tok.pad_token_id, tok.eos_token_id)
            rates["generate"].append(n / (time.perf_counter() - t0))
    ratios = [e / g for e, g in zip(rates["engine"], rates["generate"], strict=True)]
    print(
        f"decode, lab model, {args.prompts} prompts x up to {args.new_tokens} new tokens, T=1, "
        f"{args.repeats} alternating pairs"
    )
    for name, rs in rates.items():
        print(f"  {name:9s} {statistics.median(rs):8.0f} tokens/s (median)")
    print(
        f"  engine / generate = {statistics.median(ratios):.2f} (range {min(ratios):.2f}-{max(ratios):.2f}); "
        "goal >= 1.5"
    )


if __name__ == "__main__":
    main()
