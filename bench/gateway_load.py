"""The gateway under many concurrent multi-turn sessions, optionally against another revision.

`--sessions` sessions run at once, each making `--calls` chat calls in turn (the conversation
grows by the reply and a user turn), max_tokens `--max-tokens`, recording on. Reported per gateway:
calls per second over the whole load, and per-call latency p50 / p99. With `--compare REV` the
same load alternates between REV's gateway (a git worktree of that revision, same venv) and this
checkout's, serving the same deployment. Run: `.venv/bin/python -m bench.gateway_load --compare HEAD~5`.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import subprocess
import tempfile
import time
from pathlib import Path

import httpx

from prodrl_pipeline.chat.render import load_tokenizer
from prodrl_pipeline.envs.chess_env import ChessEpisode
from prodrl_pipeline.envs.lab_data import iter_lab_puzzles
from prodrl_pipeline.gateway.process import GatewayProcess, live_root
from prodrl_pipeline.model import TinyQwen3Config, build_model


async def _load(
    url: str, sessions: list[list[dict]], calls: int, max_tokens: int
) -> tuple[float, list[float]]:
    latencies: list[float] = []

    async def session(client: httpx.AsyncClient, i: int, messages: list[dict]) -> None:
        messages = list(messages)
        for _ in range(calls):
            t0 = time.perf_counter()
            r = await client.post(
                f"{url}/v1/chat/completions",
                json={"messages": messages, "max_tokens": max_tokens, "user": f"load-{i}-{id(messages)}"},
            )
            r.raise_for_status()
            latencies.append(time.perf_counter() - t0)
            reply = r.json()["choices"][0]["message"]["content"] or ""
            messages += [{"role": "assistant", "content": reply}, {"role": "user", "content": "Again."}]

    # idle pooled connections are dropped before a server may close them (uvicorn's default: 5 s):
    # else a request can race the server's close and fail with ReadError
    limits = httpx.Limits(max_connections=len(sessions), keepalive_expiry=4)
    async with httpx.AsyncClient(limits=limits, timeout=600) as client:
        t0 = time.perf_counter()
        await asyncio.gather(*(session(client, i, m) for i, m in enumerate(sessions)))
        return len(sessions) * calls / (time.perf_counter() - t0), latencies


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--sessions", type=int, default=200)
    parser.add_argument("--calls", type=int, default=3)
    parser.add_argument("--max-tokens", type=int, default=16)
    parser.add_argument("--rounds", type=int, default=2, help="loads per gateway, alternating")
    parser.add_argument("--compare", help="a git revision whose gateway runs beside this one")
    args = parser.parse_args()
    tok = load_tokenizer("data/tokenizer")
    puzzles = list(iter_lab_puzzles("data", "heldout"))[: args.sessions]
    sessions = [ChessEpisode(p).messages for p in puzzles]
    with tempfile.TemporaryDirectory() as tmp:
        root = live_root(Path(tmp), build_model(TinyQwen3Config(), len(tok), tok.pad_token_id))
        checkouts = {"this checkout": None}
        if args.compare:
            tree = Path(tmp) / "compare"
            subprocess.run(["git", "worktree", "add", "--detach", str(tree), args.compare], check=True)
            checkouts = {args.compare: tree, **checkouts}
        servers = {
            name: GatewayProcess(root, "--max-batch", "64", "--spool", str(Path(tmp) / f"spool-{i}"), cwd=cwd)
            for i, (name, cwd) in enumerate(checkouts.items())
        }
        results = {name: [] for name in servers}
        try:
            for gw in servers.values():
                gw.start()
                asyncio.run(_load(gw.url, sessions[:16], 1, args.max_tokens))  # warm-up
            for _ in range(args.rounds):
                for name, gw in servers.items():
                    results[name].append(asyncio.run(_load(gw.url, sessions, args.calls, args.max_tokens)))
        finally:
            for gw in servers.values():
                gw.stop()
            if args.compare:
                subprocess.run(
                    ["git", "worktree", "remove", "--force", str(Path(tmp) / "compare")], check=False
                )
    print(
        f"gateway load, lab model (NVFP4): {args.sessions} concurrent sessions x {args.calls} chat calls, "
        f"max_tokens {args.max_tokens}, {args.rounds} loads each (alternating)"
    )
    for name, runs in results.items():
        latencies = [t for _, lat in runs for t in lat]
        q = statistics.quantiles(latencies, n=100)
        rate = statistics.median(r for r, _ in runs)
        print(f"  {name:16s} {rate:6.1f} calls/s   p50 {q[49]:6.2f} s   p99 {q[98]:6.2f} s")
    if args.compare:
        new, old = (statistics.median(r for r, _ in results[n]) for n in ("this checkout", args.compare))
        print(f"  calls/s this checkout / {args.compare} = {new / old:.2f}")


if __name__ == "__main__":
    main()
