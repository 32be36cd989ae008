"""Gateway throughput with recording on vs off, side by side, and latency percentiles.

Two gateway processes serve the same lab-size NVFP4 deployment, one recording (spool + Delta
landing) and one not (`--no-record`). Bursts of chat requests at fixed concurrency alternate
between them; throughput is completed requests per second per burst (median over bursts), latency
is per request. Goal: recording on / off >= 0.97. Run: `make bench` or
`.venv/bin/python -m bench.gateway`.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import tempfile
import time
from pathlib import Path

import httpx

from prodrl_pipeline.envs.chat import load_tokenizer
from prodrl_pipeline.envs.chess_env import ChessEpisode
from prodrl_pipeline.envs.lab_data import iter_lab_puzzles
from prodrl_pipeline.gateway.process import GatewayProcess, live_root
from prodrl_pipeline.model import TinyQwen3Config, build_model


async def _burst(url: str, bodies: list[dict], concurrency: int) -> tuple[float, list[float]]:
    latencies: list[float] = []
    queue = list(bodies)

    async def worker(client: httpx.AsyncClient) -> None:
        while queue:
            body = queue.pop()
            t0 = time.perf_counter()
            r = await client.post(f"{url}/v1/chat/completions", json=body)
            r.raise_for_status()
            latencies.append(time.perf_counter() - t0)

    limits = httpx.Limits(max_connections=concurrency)
    async with httpx.AsyncClient(limits=limits, timeout=120) as client:
        t0 = time.perf_counter()
        await asyncio.gather(*(worker(client) for _ in range(concurrency)))
        return len(bodies) / (time.perf_counter() - t0), latencies


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--requests", type=int, default=256, help="requests per burst")
    parser.add_argument("--concurrency", type=int, default=32)
    parser.add_argument("--bursts", type=int, default=5, help="bursts per variant, alternating")
    parser.add_argument("--max-tokens", type=int, default=16)
    args = parser.parse_args()
    puzzles = list(iter_lab_puzzles("data", "heldout"))
    bodies = [
        {"messages": ChessEpisode(p).messages, "max_tokens": args.max_tokens, "user": f"s{i}"}
        for i, p in enumerate(puzzles[: args.requests])
    ]
    with tempfile.TemporaryDirectory() as tmp:
        tok = load_tokenizer("data/tokenizer")
        root = live_root(Path(tmp), build_model(TinyQwen3Config(), len(tok), tok.pad_token_id))
        servers = {
            "recording on": GatewayProcess(root, "--max-batch", "64").start(),
            "recording off": GatewayProcess(root, "--max-batch", "64", "--no-record").start(),
        }
        try:
            for gw in servers.values():  # warm-up
                asyncio.run(_burst(gw.url, bodies[:32], args.concurrency))
            rates = {name: [] for name in servers}
            lat = {name: [] for name in servers}
            for _ in range(args.bursts):
                for name, gw in servers.items():
                    rate, latencies = asyncio.run(_burst(gw.url, bodies, args.concurrency))
                    rates[name].append(rate)
                    lat[name] += latencies
        finally:
            for gw in servers.values():
                gw.stop()
    print(
        f"gateway, lab model (NVFP4), {args.requests} chat requests x {args.bursts} bursts, "
        f"concurrency {args.concurrency}, max_tokens {args.max_tokens}"
    )
    for name in servers:
        q = statistics.quantiles(lat[name], n=100)
        print(
            f"  {name:14s} {statistics.median(rates[name]):7.1f} req/s   p50 {q[49] * 1000:6.0f} ms   "
            f"p99 {q[98] * 1000:6.0f} ms"
        )
    ratio = statistics.median(rates["recording on"]) / statistics.median(rates["recording off"])
    print(f"  throughput recording on / off = {ratio:.3f}")


if __name__ == "__main__":
    main()
