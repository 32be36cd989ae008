"""GPU check of the vLLM backend (< 10 minutes on one GPU; needs the `serve` extra).

Builds the lab model, saves it as an HF checkpoint with the tokenizer, starts `vllm serve` on it
with the recording flags, puts the capture gateway (`--engine vllm`) in front, sends chat traffic
(plain and top-k 20) with the openai client, then compares every recorded log-prob with the
trainer's fp32 log-prob of the same token on the same weights. Prints mean/max |dlogp| (the
engine mismatch of a BF16 vLLM deployment) and checks the recorded heads and supports.

    .venv/bin/pip install -e '.[serve]' && .venv/bin/python -m bench.vllm_check
"""

from __future__ import annotations

import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx
import openai
import torch

from prodrl_pipeline.envs.chat import load_tokenizer
from prodrl_pipeline.envs.chess_env import ChessEpisode
from prodrl_pipeline.envs.lab_data import iter_lab_puzzles
from prodrl_pipeline.gateway.process import GatewayProcess, free_port, live_root
from prodrl_pipeline.model import TinyQwen3Config, build_model
from prodrl_pipeline.records.store import DeltaStore
from prodrl_pipeline.rl.logprobs import build_sequences, token_logprobs


def main() -> None:
    tok = load_tokenizer("data/tokenizer")
    model = build_model(TinyQwen3Config(), len(tok), tok.pad_token_id)
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        live_root(root, model, "none")  # full-precision export (tied lm_head), registered live
        export = root / "deployments" / "base"
        tok.save_pretrained(export)  # vLLM reads the tokenizer from the model folder
        store = DeltaStore(root / "tables")
        port = free_port()
        vllm = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "vllm.entrypoints.openai.api_server",
                "--model",
                str(export),
                "--port",
                str(port),
                "--logprobs-mode",
                "processed_logprobs",
                "--max-logprobs",
                "21",
                "--generation-config",
                "vllm",
                "--dtype",
                "bfloat16",
                "--gpu-memory-utilization",
                "0.3",
                "--max-model-len",
                "1024",
            ]
        )
        try:
            deadline = time.monotonic() + 420
            while True:
                try:
                    if httpx.get(f"http://127.0.0.1:{port}/health", timeout=2).status_code == 200:
                        break
                except httpx.TransportError:
                    pass
                if vllm.poll() is not None or time.monotonic() > deadline:
                    raise SystemExit("vllm server did not start")
                time.sleep(1)
            gw = GatewayProcess(
                root,
                "--engine",
                "vllm",
                "--vllm-url",
                f"http://127.0.0.1:{port}",
                "--vllm-model",
                str(export),
                "--max-tokens",
                "24",
            ).start(timeout=120)
            client = openai.OpenAI(base_url=f"{gw.url}/v1", api_key="none", max_retries=0)
            for i, p in enumerate(list(iter_lab_puzzles("data", "heldout"))[:64]):
                extra = {"top_k": 20} if i % 2 else {}
                client.chat.completions.create(
                    model="base", messages=ChessEpisode(p).messages, max_tokens=24, extra_body=extra
                )
            gw.stop()
        finally:
            vllm.terminate()
            vllm.wait(timeout=60)
        calls = store.read("landing_calls").to_pylist()
        seqs = build_sequences(calls, tok.pad_token_id)
        with torch.no_grad():
            trainer = token_logprobs(model.float(), seqs).logprobs
        gap = (trainer - seqs.deployment_logprobs)[seqs.free].abs()
        topk = [c for c in calls if c["sampling"]["top_k"] == 20]
        ok = all(s <= 20 for c in topk for s in c["support_size"])
        print(
            f"{len(calls)} calls recorded through vLLM; trainer (fp32) vs vLLM (bf16) |dlogp| on sampled "
            f"tokens: mean {gap.mean():.4f} max {gap.max():.4f}; top-k supports within the head: {ok}"
        )


if __name__ == "__main__":
    main()
