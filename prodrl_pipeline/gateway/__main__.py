"""`python -m prodrl_pipeline.gateway`: serve the live deployment (or a named one) and record.

    python -m prodrl_pipeline.gateway --root .prodrl --port 8000
API keys come from the environment: PRODRL_API_KEYS and PRODRL_FEEDBACK_KEYS (comma-separated;
unset means no key is needed).
"""

from __future__ import annotations

import argparse
import logging
import os
from pathlib import Path

import uvicorn
from fastapi import FastAPI
from transformers import AutoConfig

from prodrl_pipeline.engine.sampler import TorchEngine
from prodrl_pipeline.engine.vllm import VLLMEngine
from prodrl_pipeline.envs.chat import load_tokenizer
from prodrl_pipeline.gateway.app import create_app
from prodrl_pipeline.gateway.batcher import BatchingEngine
from prodrl_pipeline.gateway.landing import LandingLog
from prodrl_pipeline.gateway.serving import GatewayConfig, Serving, expire_unscored
from prodrl_pipeline.gateway.sessions import SessionIndex
from prodrl_pipeline.quant.nvfp4 import load_deployment
from prodrl_pipeline.records.registry import lookup
from prodrl_pipeline.records.store import DeltaStore


def build_app(args: argparse.Namespace) -> FastAPI:
    store = DeltaStore(Path(args.root) / "tables")
    if args.deployment:
        deployment = lookup(store, "deployments", "deployment_id", args.deployment)
    elif (deployment := store.live_deployment()) is None:
        raise SystemExit(
            f"no live deployment under {args.root}: run `make demo` (or name one with --deployment)"
        )
    tokenizer = load_tokenizer(args.tokenizer)
    config = AutoConfig.from_pretrained(deployment["path"])
    if args.engine == "vllm":
        engine = VLLMEngine(
            args.vllm_url, args.vllm_model or deployment["path"], config.vocab_size, args.top_logprobs
        )
    else:
        engine = TorchEngine(
            load_deployment(deployment["path"]),
            tokenizer.eos_token_id,
            tokenizer.pad_token_id,
            args.top_logprobs,
            args.extra_samples,
        )
    keys = lambda name: tuple(k for k in os.environ.get(name, "").split(",") if k)  # noqa: E731
    cfg = GatewayConfig(
        deployment_id=deployment["deployment_id"],
        serve_keys=keys("PRODRL_API_KEYS"),
        feedback_keys=keys("PRODRL_FEEDBACK_KEYS"),
        max_body_bytes=args.max_body_bytes,
        default_max_tokens=args.max_tokens,
        model_aliases=tuple(args.model_alias),
        record=not args.no_record,
    )
    sessions = SessionIndex(args.ttl)
    landing = LandingLog(
        store,
        Path(args.spool or Path(args.root) / "spool"),
        flush_records=args.flush_records,
        flush_seconds=args.flush_seconds,
        max_pending=args.max_pending,
        fsync=args.fsync,
    )
    landing.tick = lambda: expire_unscored(landing, sessions)
    batcher = BatchingEngine(engine, max_batch=args.max_batch, wait_ms=args.batch_wait_ms)
    return create_app(Serving(cfg, batcher, tokenizer, landing, sessions, config.max_position_embeddings))


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--root", default=".prodrl", help="store root: tables/ (registry, landing) and spool/")
    p.add_argument("--deployment", help="deployment id to serve (default: the live one)")
    p.add_argument("--tokenizer", default="data/tokenizer")
    p.add_argument(
        "--engine",
        choices=["embedded", "vllm"],
        default="embedded",
        help="embedded torch sampler (CPU default) or a vLLM server started for recording (GPU)",
    )
    p.add_argument("--vllm-url", default="http://127.0.0.1:8001", help="the vLLM server (--engine vllm)")
    p.add_argument("--vllm-model", help="model name the vLLM server serves (default: the deployment path)")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--spool", help="spool folder (default: <root>/spool)")
    p.add_argument("--max-tokens", type=int, default=256, help="default max_tokens")
    p.add_argument(
        "--model-alias",
        action="append",
        default=["live"],
        help="another name a request's `model` may use for the served deployment (repeatable)",
    )
    p.add_argument("--max-body-bytes", type=int, default=1_000_000)
    p.add_argument("--top-logprobs", type=int, default=20, help="K: head of mu recorded per position")
    p.add_argument("--extra-samples", type=int, default=0, help="M extra samples recorded per position")
    p.add_argument("--flush-records", type=int, default=256)
    p.add_argument("--flush-seconds", type=float, default=1.0)
    p.add_argument("--max-pending", type=int, default=10_000, help="above this many unflushed records: 503")
    p.add_argument(
        "--ttl", type=float, default=3600.0, help="seconds an unscored trajectory waits for a reward"
    )
    p.add_argument("--max-batch", type=int, default=32)
    p.add_argument("--batch-wait-ms", type=float, default=5.0)
    p.add_argument("--fsync", action="store_true", help="fsync every record (survives power loss, slower)")
    p.add_argument("--no-record", action="store_true", help="serve without recording (benchmarks only)")
    p.add_argument(
        "--keep-alive",
        type=float,
        default=75.0,
        help="seconds an idle connection stays open (above a load balancer's, so it closes first)",
    )
    return p


def main() -> None:
    args = parser().parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    uvicorn.run(
        build_app(args),
        host=args.host,
        port=args.port,
        log_level="warning",
        timeout_keep_alive=args.keep_alive,
    )


if __name__ == "__main__":
    main()
