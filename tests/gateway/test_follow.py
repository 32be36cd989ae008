"""The gateway follows the registry's live pointer: load beside, switch between requests, drain,
attribute every call to the deployment that served it, keep serving when a load fails."""

import dataclasses
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx

from prodrl_pipeline.artifacts import Artifacts
from prodrl_pipeline.engine.vllm_server import weight_label
from prodrl_pipeline.gateway.__main__ import embedded_loader, parser
from prodrl_pipeline.gateway.deployments import Deployments, LiveFollower
from prodrl_pipeline.gateway.serving import GatewayConfig, Serving
from prodrl_pipeline.gateway.sessions import SessionIndex
from prodrl_pipeline.model import build_model
from prodrl_pipeline.quant.nvfp4 import export_deployment
from prodrl_pipeline.records.registry import export_of, live_deployment, register_deployment, set_live
from prodrl_pipeline.records.store import DeltaStore
from tests.conftest import TINY
from tests.gateway.conftest import SERVE_KEY, Gateway, make_root

SERVE = {"Authorization": f"Bearer {SERVE_KEY}"}


def _register(root: Path, tokenizer, name: str, seed: int, broken: bool = False, folder: str = "") -> None:
    """Export a tiny model (another seed: other weights) as deployment `name`, into
    `deployments/<folder or name>`; `broken`: its weights file is truncated, as a failed copy would
    leave it."""
    path = root / "deployments" / (folder or name)
    export_deployment(
        build_model(dataclasses.replace(TINY, seed=seed), len(tokenizer), tokenizer.pad_token_id),
        path,
        "nvfp4",
    )
    if broken:
        weights = path / "model.safetensors"
        weights.write_bytes(weights.read_bytes()[:1000])
    register_deployment(
        DeltaStore(root / "tables"),
        deployment_id=name,
        round_=seed,
        checkpoint_id=name,
        path=str(path),
        quant_format="nvfp4",
        sampling_json="{}",
    )


def test_the_follower_loads_beside_switches_drains_and_survives_a_failed_load(tmp_path, tokenizer):
    root = make_root(tmp_path, tokenizer)
    store = DeltaStore(root / "tables")
    load = embedded_loader(parser().parse_args([]), tokenizer, Artifacts(str(root)))
    deployments = Deployments(load(live_deployment(store)), drain_seconds=10)
    follower = LiveFollower(store, deployments, load, retry_seconds=30)
    try:
        t0 = time.monotonic()
        assert follower.check(t0) is None  # live is what it serves
        _register(root, tokenizer, "r1", seed=11)
        assert follower.check(t0) is None  # registered is not live
        set_live(store, "r1")
        assert follower.check(t0) == "r1"
        assert deployments.ids() == ["r1", "base"] and deployments.draining() == ["base"]
        set_live(store, "base")  # rolled back before base was closed: served again, not reloaded
        assert follower.check(t0) == "base" and deployments.ids() == ["base", "r1"]
        set_live(store, "r1")
        assert follower.check(t0) == "r1" and deployments.ids() == ["r1", "base"]
        t1 = time.monotonic()  # base drains from its last switch (loads before it take real time)
        assert deployments.switches == 3 and deployments.load_failures == 0

        old_trajectory = deployments.acquire(None, pinned="base").loaded
        new_trajectory = deployments.acquire(None, pinned=None).loaded
        named = deployments.acquire("base", pinned="r1").loaded
        assert (old_trajectory.deployment_id, new_trajectory.deployment_id, named.deployment_id) == (
            "base",
            "r1",
            "base",
        )
        for d in (new_trajectory, named):
            deployments.release(d)
        assert deployments.retire(t1 + 5) == []  # still draining
        assert deployments.retire(t1 + 11) == []  # drained, but a call still holds it
        deployments.release(old_trajectory)
        assert deployments.retire(t1 + 11) == ["base"]
        assert deployments.acquire(None, pinned="base").loaded.deployment_id == "r1"  # base is gone

        _register(root, tokenizer, "broken", seed=12, broken=True)
        set_live(store, "broken")
        assert follower.check(t0 + 12) is None
        assert deployments.current.deployment_id == "r1" and deployments.load_failures == 1
        assert "broken" in deployments.last_error
        set_live(store, "broken")  # the registry moves (same target): not retried before the retry time
        assert follower.check(t0 + 13) is None and deployments.load_failures == 1
        assert follower.check(t0 + 43) is None and deployments.load_failures == 2
        set_live(store, "r1")  # the operator rolls live back: nothing to load
        assert follower.check(t0 + 44) is None and deployments.load_failures == 2
        assert deployments.last_error is None  # the failure no longer matters
    finally:
        deployments.close()


def test_the_follower_reloads_the_live_deployment_when_it_is_re_exported(tmp_path, tokenizer):
    """A re-run of the live round registers a new export under the same id (locally in the same
    folder, replaced in place; on S3 another version): another export and another vLLM label; the
    follower loads it beside the old export and switches; a registry commit that leaves the live
    row's export as it was loads nothing."""
    root = make_root(tmp_path, tokenizer)
    store = DeltaStore(root / "tables")
    load = embedded_loader(parser().parse_args([]), tokenizer, Artifacts(str(root)))
    _register(root, tokenizer, "r1", seed=11)
    set_live(store, "r1")
    deployments = Deployments(load(live_deployment(store)), drain_seconds=10)
    follower = LiveFollower(store, deployments, load)
    try:
        first = deployments.current
        assert follower.check() is None  # what it serves is live
        before = live_deployment(store)
        _register(root, tokenizer, "r1", seed=12)  # the round re-run: same id and folder, live kept
        live = live_deployment(store)
        assert live["deployment_id"] == "r1" and live["path"] == before["path"]
        assert weight_label(live) != weight_label(before)
        assert follower.check() == "r1"
        assert deployments.current.export == export_of(live) and deployments.current is not first
        assert deployments.ids() == ["r1", "r1"] and deployments.switches == 1  # the old export drains
        moved_on = deployments.acquire(None, pinned="r1").loaded
        assert moved_on is deployments.current  # its trajectories move on
        serving = Serving(GatewayConfig(), deployments, tokenizer, None, SessionIndex(60))
        assert serving.names() == ["r1", "live"]  # what /v1/models lists: the id once
        _register(root, tokenizer, "r2", seed=13)  # another row changes, live's export does not
        assert follower.check() is None and deployments.switches == 1 and deployments.load_failures == 0
    finally:
        deployments.close()


def _chat(url: str, tid: str, model: str = "live", max_tokens: int = 8) -> dict:
    body = {"model": model, "messages": [{"role": "user", "content": f"hi {tid}"}], "max_tokens": max_tokens}
    r = httpx.post(
        f"{url}/v1/chat/completions",
        json=body,
        headers={**SERVE, "X-Prodrl-Trajectory-Id": tid},
        timeout=60,
    )
    assert r.status_code == 200, r.text
    return r.json()


def _until(predicate, what: str, timeout: float = 60.0):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if value := predicate():
            return value
        time.sleep(0.05)  # polling an observable state, with a deadline
    raise TimeoutError(what)


def _health(url: str) -> dict:
    return httpx.get(f"{url}/healthz").json()


def test_the_gateway_follows_live_without_dropping_or_misattributing_a_call(tmp_path, tokenizer):
    root = make_root(tmp_path, tokenizer)
    store = DeltaStore(root / "tables")
    gw = Gateway(root, "--follow-seconds", "0.1", "--drain-seconds", "2").start()
    served: dict[str, str] = {}  # call id -> deployment named in the response
    try:

        def call(tid: str, **kw) -> str:
            out = _chat(gw.url, tid, **kw)
            served[out["prodrl"]["call_id"]] = out["model"]
            return out["model"]

        assert call("old") == "base"
        _register(root, tokenizer, "r1", seed=11)
        with ThreadPoolExecutor(8) as pool:  # calls in flight while the live pointer moves
            futures = [pool.submit(call, f"busy{i}", max_tokens=32) for i in range(16)]
            set_live(store, "r1")
            during = [f.result() for f in futures]
        assert set(during) <= {"base", "r1"}
        _until(lambda: _health(gw.url)["deployment_id"] == "r1", "switch to r1")
        assert call("old") == "base"  # its trajectory started on base, which is draining
        assert call("new") == "r1"
        assert call("new2", model="base") == "base"  # a loaded deployment can be named
        _until(lambda: _health(gw.url)["draining"] == [], "base drained")
        assert call("old") == "r1"  # base is closed: the trajectory moves, and that is counted
        metrics = httpx.get(f"{gw.url}/metrics", headers=SERVE).text
        assert "prodrl_gateway_calls_moved_deployment_total 1" in metrics
        assert "prodrl_gateway_deployment_switches_total 1" in metrics

        _register(root, tokenizer, "broken", seed=12, broken=True)
        set_live(store, "broken")
        error = _until(lambda: _health(gw.url)["follow_error"], "the failed load is reported")
        assert "broken" in error
        assert call("after") == "r1"  # still serving
        assert (
            "prodrl_gateway_deployment_load_failures_total 1"
            in httpx.get(f"{gw.url}/metrics", headers=SERVE).text
        )
    finally:
        gw.stop()
    landed = store.read("landing_calls").to_pylist()
    assert len(landed) == len(served) == len({c["call_id"] for c in landed})  # nothing lost or doubled
    assert {c["call_id"]: c["deployment_id"] for c in landed} == served  # each record names its server
