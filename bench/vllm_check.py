"""GPU check of the vLLM backend (< 10 minutes on one GPU; needs the `serve` extra).

Builds the lab model, saves it as an HF checkpoint with the tokenizer, starts `vllm serve` on it
with the recording flags, puts the capture gateway (`--engine vllm`) in front, sends chat traffic
(plain and top-k 20) with the openai client, then compares every recorded log-prob with the
trainer's fp32 log-prob of the same token on the same weights. Prints mean/max |dlogp| (the
engine mismatch of a BF16 vLLM deployment), checks the recorded heads and supports, and times
the same requests with and without the recording fields (the recording overhead).

    .venv/bin/pip install -e '.[serve]' && .venv/bin/python -m bench.vllm_check
"""

from __future__ import annotations

import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import openai
import torch

from prodrl_pipeline.chat.render import load_tokenizer
from prodrl_pipeline.engine.vllm_server import VLLMServer, serve_command
from prodrl_pipeline.envs.chess_env import ChessEpisode
from prodrl_pipeline.envs.lab_data import iter_lab_puzzles
from prodrl_pipeline.gateway.process import GatewayProcess, free_port, live_root
from prodrl_pipeline.model import TinyQwen3Config, build_model
from prodrl_pipeline.records.store import DeltaStore
from prodrl_pipeline.rl.logprobs import build_sequences, token_logprobs
from prodrl_pipeline.rl.recorded import RecordedCalls


def main() -> None:
    tok = load_tokenizer("data/tokenizer")
    model = build_model(TinyQwen3Config(), len(tok), tok.pad_token_id)
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        live_root(root, model, "none")  # full-precision export (tied lm_head), registered live
        export = root / "deployments" / "base"
        store = DeltaStore(root / "tables")
        port = free_port()
        extra = ["--dtype", "bfloat16", "--gpu-memory-utilization", "0.3", "--max-model-len", "1024"]
        server = VLLMServer(
            serve_command(export, "data/tokenizer", port, extra=extra), root / "vllm.log"
        ).start(timeout=420)
        try:
            gw = GatewayProcess(
                root,
                "--engine",
                "vllm",
                "--vllm-url",
                server.url,
                "--vllm-model",
                "prodrl",
                "--max-tokens",
                "24",
            ).start(timeout=120)
            client = openai.OpenAI(base_url=f"{gw.url}/v1", api_key="none", max_retries=0)
            for i, p in enumerate(list(iter_lab_puzzles("data", "heldout"))[:64]):
                extra_body = {"top_k": 20} if i % 2 else {}
                client.chat.completions.create(
                    model="base", messages=ChessEpisode(p).messages, max_tokens=24, extra_body=extra_body
                )
            gw.stop()
            calls = store.read("landing_calls").to_pylist()
            overhead = _recording_overhead(server.url, [c["prompt_token_ids"] for c in calls[:32]])
        finally:
            server.stop()
        seqs = build_sequences(RecordedCalls.from_rows(calls), tok.pad_token_id)
        with torch.no_grad():
            trainer = token_logprobs(model.float(), seqs).logprobs
        gap = (trainer - seqs.deployment_logprobs)[seqs.free].abs()
        topk = [c for c in calls if c["sampling"]["top_k"] == 20]
        ok = all(s <= 20 for c in topk for s in c["support_size"])
        print(
            f"{len(calls)} calls recorded through vLLM; trainer (fp32) vs vLLM (bf16) |dlogp| on sampled "
            f"tokens: mean {gap.mean():.4f} max {gap.max():.4f}; top-k supports within the head: {ok}; "
            f"recording overhead (time with the K + 1 log-probs and ids / without): {overhead:.3f}"
        )


def _recording_overhead(url: str, prompts: list[list[int]], pairs: int = 5) -> float:
    """Median over alternating pairs of the time of the same batch of requests with the recording
    fields ÷ without them (64 tokens each, fixed seed)."""
    http = httpx.Client(timeout=300)

    def batch(record: bool) -> float:
        body = {"model": "prodrl", "max_tokens": 64, "temperature": 1.0, "seed": 0, "ignore_eos": True}
        if record:
            body |= {"logprobs": 21, "return_token_ids": True, "return_tokens_as_token_ids": True}
        with ThreadPoolExecutor(len(prompts)) as pool:
            t0 = time.perf_counter()
            list(
                pool.map(
                    lambda p: http.post(
                        f"{url}/v1/completions", json={**body, "prompt": p}
                    ).raise_for_status(),
                    prompts,
                )
            )
            return time.perf_counter() - t0

    batch(True)  # warm-up
    ratios = sorted(batch(True) / batch(False) for _ in range(pairs))
    return ratios[pairs // 2]


if __name__ == "__main__":
    main()
