"""Load, then SIGKILL mid-load, then restart: every call a client saw answered lands exactly once."""

import asyncio
import time
from collections import Counter

import httpx

from prodrl_pipeline.records.store import DeltaStore
from tests.gateway.conftest import SERVE_KEY, Gateway, make_root

SESSIONS, CALLS_PER_SESSION, KILL_AFTER = 200, 3, 150


async def _wave(
    gw: Gateway, calls_per_session: int, answered: list[str], kill_after: int | None = None
) -> None:
    async def session(i: int, client: httpx.AsyncClient) -> None:
        for _ in range(calls_per_session):
            body = {"messages": [{"role": "user", "content": f"session {i}"}], "max_tokens": 8}
            try:
                r = await client.post(
                    f"{gw.url}/v1/chat/completions",
                    json=body,
                    headers={"Authorization": f"Bearer {SERVE_KEY}", "X-Prodrl-Trajectory-Id": f"s{i}"},
                )
            except httpx.TransportError:  # the server died under us: this call was not answered
                return
            if r.status_code == 200:
                answered.append(r.json()["prodrl"]["call_id"])

    limits = httpx.Limits(max_connections=SESSIONS, max_keepalive_connections=SESSIONS)
    async with httpx.AsyncClient(limits=limits, timeout=120) as client:
        tasks = [asyncio.create_task(session(i, client)) for i in range(SESSIONS)]
        if kill_after is not None:
            deadline = time.monotonic() + 120
            while len(answered) < kill_after:  # bounded wait for the load to be under way
                assert time.monotonic() < deadline, f"only {len(answered)} calls answered"
                await asyncio.sleep(0.01)
            gw.kill()
        await asyncio.gather(*tasks)


def test_sigkill_mid_load_then_restart_loses_and_duplicates_nothing(tmp_path, tokenizer):
    gw = Gateway(make_root(tmp_path, tokenizer), "--max-batch", "64", "--flush-seconds", "0.5").start()
    answered: list[str] = []
    asyncio.run(_wave(gw, CALLS_PER_SESSION, answered, kill_after=KILL_AFTER))
    before_kill = len(answered)
    assert KILL_AFTER <= before_kill < SESSIONS * CALLS_PER_SESSION  # killed mid-load
    gw.start()  # same root and spool: the spool is replayed into Delta exactly once
    asyncio.run(_wave(gw, 1, answered))
    gw.stop()
    calls = DeltaStore(gw.root / "tables").read("landing_calls").to_pylist()
    landed = Counter(c["call_id"] for c in calls)
    assert max(landed.values()) == 1  # no call twice
    assert set(answered) <= set(landed)  # no answered call lost
    indexes = Counter((c["trajectory_id"], c["call_index"]) for c in calls)
    assert max(indexes.values()) == 1  # call indexes continue across the restart
    print(f"answered {len(answered)} ({before_kill} before SIGKILL), landed {len(landed)}")
