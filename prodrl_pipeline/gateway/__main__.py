"""`python -m prodrl_pipeline.gateway`: serve the live deployment (following the live pointer as it
moves) or a named one, and record every call.

    python -m prodrl_pipeline.gateway --root .prodrl --port 8000
API keys come from the environment: PRODRL_API_KEYS and PRODRL_FEEDBACK_KEYS (comma-separated;
unset means no key is needed); object-store options for s3:// tables and exports from
PRODRL_STORAGE_OPTIONS (a JSON object) or the usual AWS_* variables.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
from collections.abc import Callable
from pathlib import Path

import uvicorn
from fastapi import FastAPI
from transformers import AutoConfig, PreTrainedTokenizerBase

from prodrl_pipeline.artifacts import Artifacts, storage_options_from_environment
from prodrl_pipeline.chat.render import load_tokenizer
from prodrl_pipeline.engine.sampler import TorchEngine
from prodrl_pipeline.engine.vllm import VLLMEngine
from prodrl_pipeline.engine.vllm_server import served_label, swap, weight_label
from prodrl_pipeline.gateway.app import create_app
from prodrl_pipeline.gateway.batcher import BatchingEngine
from prodrl_pipeline.gateway.deployments import Deployments, LiveFollower, Loaded, smoke_check
from prodrl_pipeline.gateway.landing import LandingLog
from prodrl_pipeline.gateway.serving import GatewayConfig, Serving, expire_unscored
from prodrl_pipeline.gateway.sessions import SessionIndex
from prodrl_pipeline.model import pad_id
from prodrl_pipeline.quant.nvfp4 import load_deployment
from prodrl_pipeline.records.registry import export_of, live_deployment, lookup
from prodrl_pipeline.records.store import DeltaStore


def embedded_loader(
    args: argparse.Namespace, tokenizer: PreTrainedTokenizerBase, artifacts: Artifacts
) -> Callable[[dict], Loaded]:
    """Loads a registry row's export (a folder, or an s3:// one copied locally) into the embedded
    engine; its vocabulary must be the first loaded deployment's (the gateway's tokenizer is
    fixed), and it must pass the smoke check."""
    first_vocab: list[int] = []

    def load(row: dict) -> Loaded:
        path = artifacts.local(row["path"])
        if not path.is_dir():
            raise ValueError(f"{row['deployment_id']}: its export {path} is not a local folder")
        engine = TorchEngine(
            load_deployment(path, row["quant_format"]),
            tokenizer.eos_token_id,
            pad_id(tokenizer),
            args.top_logprobs,
            args.extra_samples,
        )
        vocab = first_vocab[0] if first_vocab else engine.vocab_size
        if engine.vocab_size != vocab or len(tokenizer) > vocab:
            raise ValueError(
                f"{row['deployment_id']}: vocabulary of {engine.vocab_size} does not match the served "
                f"{vocab} and the tokenizer's {len(tokenizer)}"
            )
        batcher = BatchingEngine(engine, max_batch=args.max_batch, wait_ms=args.batch_wait_ms)
        loaded = Loaded(
            row["deployment_id"], batcher, engine.model.config.max_position_embeddings, export_of(row)
        )
        try:
            smoke_check(loaded, tokenizer.eos_token_id)
        except Exception:
            batcher.close(wait=False)  # a stuck engine must not hang the follower
            raise
        first_vocab[:] = [vocab]
        return loaded

    return load


def vllm_loader(
    args: argparse.Namespace, tokenizer: PreTrainedTokenizerBase, artifacts: Artifacts
) -> Callable[[dict], Loaded]:
    """A registry row's deployment as served by the vLLM server at --vllm-url. With --vllm-follow
    that server is swapped in place for each deployment and tags its output with the deployment's
    label (the `deployment` asset does both; `vllm_server.weight_label`): every completion must
    carry that label, and the smoke check confirms it before the gateway switches."""

    def load(row: dict) -> Loaded:
        config = AutoConfig.from_pretrained(artifacts.local(row["path"]))
        engine = VLLMEngine(
            args.vllm_url,
            args.vllm_model,
            config.vocab_size,
            args.top_logprobs,
            weight_version=weight_label(row) if args.vllm_follow else None,
        )
        batcher = BatchingEngine(engine, max_batch=args.max_batch, wait_ms=args.batch_wait_ms)
        loaded = Loaded(row["deployment_id"], batcher, config.max_position_embeddings, export_of(row))
        if args.vllm_follow:
            try:
                smoke_check(loaded, tokenizer.eos_token_id)
            except Exception:
                batcher.close(wait=False)
                raise
        return loaded

    return load


def build_app(args: argparse.Namespace) -> FastAPI:
    options = storage_options_from_environment(os.environ)
    store = DeltaStore(args.tables_uri or str(Path(args.root) / "tables"), storage_options=options)
    artifacts = Artifacts(args.root, options, Path(args.root) / "cache")
    if args.deployment:
        deployment = lookup(store, "deployments", "deployment_id", args.deployment)
    elif (deployment := live_deployment(store)) is None:
        raise SystemExit(
            f"no live deployment under {args.root}: run `make demo` (or name one with --deployment)"
        )
    tokenizer = load_tokenizer(args.tokenizer)
    if args.engine == "vllm" and args.vllm_follow and served_label(args.vllm_url) != weight_label(deployment):
        swap(args.vllm_url, artifacts.local(deployment["path"]), weight_label(deployment))  # a fresh server
    load = (vllm_loader if args.engine == "vllm" else embedded_loader)(args, tokenizer, artifacts)
    first = load(deployment)
    keys = lambda name: tuple(k for k in os.environ.get(name, "").split(",") if k)  # noqa: E731
    cfg = GatewayConfig(
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
    deployments = Deployments(first, drain_seconds=args.drain_seconds)
    follows = (
        (args.engine == "embedded" or args.vllm_follow) and not args.deployment and args.follow_seconds > 0
    )
    follower = LiveFollower(store, deployments, load, args.follow_seconds) if follows else None
    return create_app(Serving(cfg, deployments, tokenizer, landing, sessions, follower))


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument(
        "--root", default=".prodrl", help="store root: tables/ (registry, landing), spool/ and cache/"
    )
    p.add_argument("--tables-uri", default="", help="the tables' folder or s3:// URI, if not <root>/tables")
    p.add_argument(
        "--deployment", help="deployment id to serve, and keep serving (default: follow the live one)"
    )
    p.add_argument(
        "--follow-seconds",
        type=float,
        default=2.0,
        help="poll the live pointer this often and switch to the new live deployment (0: never)",
    )
    p.add_argument(
        "--drain-seconds",
        type=float,
        default=60.0,
        help="after a switch, the old deployment serves the trajectories it started this long",
    )
    p.add_argument("--tokenizer", default="data/tokenizer")
    p.add_argument(
        "--engine",
        choices=["embedded", "vllm"],
        default="embedded",
        help="embedded torch sampler (CPU default) or a vLLM server started for recording (GPU)",
    )
    p.add_argument("--vllm-url", default="http://127.0.0.1:8001", help="the vLLM server (--engine vllm)")
    p.add_argument(
        "--vllm-model",
        default="prodrl",
        help="model name the vLLM server serves (its --served-model-name)",
    )
    p.add_argument(
        "--vllm-follow",
        action="store_true",
        help="the vLLM server (dev mode) is swapped in place per deployment (lab.vllm_url): follow "
        "the live pointer, refuse completions not tagged with the serving deployment's label, and "
        "on start load the live deployment into the server if it serves another",
    )
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


def main() -> int:
    """0 once the server has shut down by itself; a start-up failure exits non-zero with its
    reason; a stop by SIGINT or SIGTERM shuts down gracefully (the landing log committed), then ends
    the process by that signal (uvicorn raises it again)."""
    args = parser().parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    uvicorn.run(
        build_app(args),
        host=args.host,
        port=args.port,
        log_level="warning",
        timeout_keep_alive=args.keep_alive,
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
