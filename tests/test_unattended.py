"""Production mode, unattended: the Dagster daemon with `round_sensor` and `canary_sensor` on, the
capture gateway following the live pointer and the canaries, and simulated users playing through
the real `openai` client. Nobody acts: rounds start, train, open their canary, are promoted by the
gate and go live by themselves, the gateway follows, and the landing tables account for every call
and reward exactly once."""

import asyncio
import json
import os
import shutil
import subprocess
import sys
import threading
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import pytest
import yaml
from dagster import (
    AssetKey,
    AssetRecordsFilter,
    DagsterInstance,
    DagsterRun,
    DagsterRunStatus,
    RunsFilter,
)
from dagster._core.scheduler.instigation import InstigatorStatus

from assets.launch import in_flight
from assets.partitions import rounds as round_partitions
from prodrl_pipeline.chat.render import load_tokenizer
from prodrl_pipeline.envs.lab_data import iter_lab_puzzles
from prodrl_pipeline.evals.gate import paired_difference
from prodrl_pipeline.evals.heldout import evaluate
from prodrl_pipeline.gateway.process import GatewayProcess
from prodrl_pipeline.model import build_model
from prodrl_pipeline.records import canaries
from prodrl_pipeline.records.registry import live_deployment, lookup
from prodrl_pipeline.records.store import DeltaStore
from prodrl_pipeline.rl.warmstart import solved_turns, warm_start
from prodrl_pipeline.simulate import SimulationConfig, SimulationReport, simulate
from resources.lab import LabResource
from tests.gateway.conftest import FEEDBACK_KEY, SERVE_KEY
from tests.test_pipeline import TINY, user_checkpoint

REPO = Path(__file__).resolve().parent.parent
DAGSTER = [sys.executable, "-m", "dagster"]


@dataclass
class Run:
    """What an unattended run left behind."""

    report: SimulationReport
    store: DeltaStore
    instance_home: Path
    seconds: float
    rows: list[dict] = field(default_factory=list)
    """Per round: traffic served by, live after, calls lost / duplicated."""


def _settings(tmp: Path, schedule: str, lab: dict) -> Path:
    path = tmp / "production.yaml"
    settings = {
        "lab": {"source": "production", "schedule": schedule, **lab},
        "store": {"root": str(tmp / "store")},
        "sensor": {"minimum_interval_seconds": 1},
    }
    path.write_text(yaml.safe_dump(settings))
    return path


def _decided(store: DeltaStore, k: int) -> bool:
    """Whether round `k`'s canary is decided."""
    row = canaries.of_round(canaries.canaries(store), f"main-r{k:06d}") if store.exists("canaries") else None
    return row is not None and row["status"] != canaries.OPEN


def _wait_for_rounds(
    instance: DagsterInstance,
    rounds: int,
    deadline: float,
    daemon: subprocess.Popen,
    settled: Callable[[], bool],
    stop_round_sensor: Callable[[], None],
) -> None:
    """Until round `rounds` is reported and `settled` (its canary decided), and no run is in
    flight; fails on a failed run. Once round `rounds` is added, stops `round_sensor` (the traffic
    the users send meanwhile would start a round more), and again while it is not stopped: the
    daemon writes a sensor's state back at each tick, over a stop made while the tick ran; it has
    stuck once it has held for a few of the daemon's iterations."""
    target = f"r{rounds:06d}"
    last_added, stopped_since = False, None
    while True:
        last_added = last_added or target in instance.get_dynamic_partitions(round_partitions.name)
        if last_added and not _stopped(instance, "round_sensor"):
            stop_round_sensor()
            stopped_since = time.monotonic()
        failed = instance.get_runs(RunsFilter(statuses=[DagsterRunStatus.FAILURE]))
        assert not failed, _failure(instance, failed[0])
        busy = in_flight(instance)
        reported = target in instance.get_materialized_partitions(AssetKey("eval_report"))
        stuck = stopped_since is not None and time.monotonic() - stopped_since > STOP_HOLDS_SECONDS
        if reported and settled() and not busy and stuck:
            return
        assert daemon.poll() is None, "the daemon exited"
        assert time.monotonic() < deadline, f"round {target} was not reported in time"
        time.sleep(1)  # polling the instance's state, with a deadline


STOP_HOLDS_SECONDS = 10
"""A sensor's stop that has held this long has stuck: the daemon evaluates its sensors every few
seconds (at most 1 s apart here) and writes a state back only at a tick it started."""


def _stopped(instance: DagsterInstance, sensor: str) -> bool:
    (state,) = [s for s in instance.all_instigator_state() if s.instigator_name == sensor]
    return state.status == InstigatorStatus.STOPPED


def _failure(instance: DagsterInstance, run: DagsterRun) -> str:
    """Which run failed, and the errors its event log holds."""
    errors = [
        f"{e.dagster_event.event_type_value}: {data.error.to_string()}"
        for e in instance.all_logs(run.run_id)
        if e.dagster_event is not None
        and (data := e.dagster_event.event_specific_data) is not None
        and getattr(data, "error", None) is not None
    ]
    partition = run.tags.get("dagster/partition")
    return f"run {run.run_id} of {run.job_name} ({partition}) failed:\n" + "\n".join(errors)[-6000:]


def run_unattended(
    tmp: Path,
    rounds: int,
    schedule: str = "sync",
    timeout: float = 600,
    users: int = 2,
    think_seconds: float = 1.0,
    **lab,
) -> Run:
    """Start everything, wait for `rounds` rounds, stop everything; the simulator stops starting
    episodes once the last round has taken its traffic (so no further round can start). `lab` names
    the `base_checkpoint`, whose tokenizer the gateway serves, and the `canary` settings: unless
    its type is off, the canary sensor runs too and the users play until the last round's canary is
    decided."""
    t0 = time.monotonic()
    home = tmp / "dagster_home"
    home.mkdir()
    shutil.copy(REPO / "instance.yaml", home / "dagster.yaml")
    env = {
        **os.environ,
        "DAGSTER_HOME": str(home),
        "PRODRL_SETTINGS": str(_settings(tmp, schedule, lab)),
        "PYTHONPATH": str(REPO),
    }
    location = ["-w", str(REPO / "workspace.yaml")]
    quiet = {"cwd": REPO, "env": env, "capture_output": True, "text": True, "timeout": 600}
    built = subprocess.run(
        [*DAGSTER, "asset", "materialize", "-m", "assets.definitions", "--select", "base_model"], **quiet
    )
    assert built.returncode == 0, built.stderr[-3000:]
    gated = lab.get("canary", {}).get("type") != "off"
    for name in ("round_sensor", "canary_sensor") if gated else ("round_sensor",):
        started = subprocess.run([*DAGSTER, "sensor", "start", name, *location], **quiet)
        assert started.returncode == 0, started.stderr[-3000:]

    store_root = tmp / "store"
    keys = {"PRODRL_API_KEYS": SERVE_KEY, "PRODRL_FEEDBACK_KEYS": FEEDBACK_KEY}
    follow = ["--follow-seconds", "0.5", "--drain-seconds", "2", "--flush-seconds", "0.2"]
    gateway = GatewayProcess(store_root, "--tokenizer", lab["base_checkpoint"], *follow, env=keys).start()
    with (tmp / "daemon.log").open("w") as log:
        daemon = subprocess.Popen(
            [str(Path(sys.executable).parent / "dagster-daemon"), "run", *location],
            cwd=REPO,
            env=env,
            stdout=log,
            stderr=log,
            start_new_session=True,
        )
    instance = DagsterInstance.from_config(str(home))
    last_taken, target = AssetKey("trajectories"), f"r{rounds:06d}"
    tables = DeltaStore(store_root / "tables")

    def settled() -> bool:
        return not gated or _decided(tables, rounds)

    def stop() -> bool:  # the last round's canary needs traffic of both arms
        return (
            _decided(tables, rounds) if gated else target in instance.get_materialized_partitions(last_taken)
        )

    def stop_round_sensor() -> None:
        stopped = subprocess.run([*DAGSTER, "sensor", "stop", "round_sensor", *location], **quiet)
        assert stopped.returncode == 0, stopped.stderr[-3000:]

    puzzles = list(iter_lab_puzzles(REPO / "data", "train"))
    cfg = SimulationConfig(
        users=users,
        episodes=1_000_000,  # bounded by `stop` and `timeout`
        max_seconds=timeout,
        reward_delay=0.2,
        think_seconds=think_seconds,
        seed=1,
    )
    result: dict = {}
    simulator = threading.Thread(
        target=lambda: result.update(
            report=asyncio.run(simulate(gateway.url, SERVE_KEY, FEEDBACK_KEY, puzzles, cfg, stop=stop))
        )
    )
    simulator.start()
    try:
        _wait_for_rounds(instance, rounds, t0 + timeout, daemon, settled, stop_round_sensor)
        simulator.join(timeout=120)
        assert "report" in result, "the simulator did not finish"
        live = live_deployment(DeltaStore(store_root / "tables"))["deployment_id"]
        deadline = time.monotonic() + 60
        while gateway_health(gateway)["deployment_id"] != live:  # the gateway follows the last move too
            assert time.monotonic() < deadline, "the gateway did not follow the last live move"
            time.sleep(0.1)
    finally:
        daemon.terminate()
        daemon.wait(timeout=60)
        gateway.stop()
        instance.dispose()
    return Run(result["report"], DeltaStore(store_root / "tables"), home, time.monotonic() - t0)


def gateway_health(gateway: GatewayProcess) -> dict:
    return httpx.get(f"{gateway.url}/healthz", timeout=5).json()


def _account(run: Run, rounds: int) -> None:
    """Everything the simulator sent is in the landing tables exactly once, and every round's rows
    are the landing rows of the trajectories it took; fills `run.rows`."""
    store, report = run.store, run.report
    assert not [e for e in report.errors if not e.startswith("stopped after")], report.errors[:5]
    landed = store.read("landing_calls").to_pylist()
    ids = Counter(c["call_id"] for c in landed)
    assert len(landed) == report.calls and max(ids.values()) == 1  # nothing lost, nothing doubled
    feedback = store.read("landing_feedback").to_pylist()
    assert sorted(f["trajectory_id"] for f in feedback) == sorted(report.rewarded)
    by_call = {c["call_id"]: c for c in landed}
    taken: Counter = Counter()
    with DagsterInstance.from_config(str(run.instance_home)) as instance:
        live_after = {k: _deployment_metadata(instance, k)["live_now"].value for k in range(1, rounds + 1)}
    for k in range(1, rounds + 1):
        trajs = store.read("trajectories", k).to_pylist()
        calls = store.read("calls", k).to_pylist()
        taken.update(t["trajectory_id"] for t in trajs)
        served_by = {t["deployment_id"] for t in trajs}
        assert len(served_by) == 1, f"round {k} mixes deployments {served_by}"
        (dep,) = served_by
        for c in calls:  # each round's call is its landing row, attributed to its server
            assert by_call[c["call_id"]]["deployment_id"] == c["deployment_id"] == dep
            assert by_call[c["call_id"]]["completion_token_ids"] == c["completion_token_ids"]
        expected = sum(1 for c in landed if c["trajectory_id"] in {t["trajectory_id"] for t in trajs})
        assert len(calls) == expected
        assert all(t["reward"] == report.rewards[t["trajectory_id"]] for t in trajs)
        run.rows.append(
            {
                "round": k,
                "traffic served by": dep,
                "trajectories": len(trajs),
                "calls": len(calls),
                "live after": live_after[k],
                "lost": expected - len(calls),
                "duplicated": len(calls) - len({c["call_id"] for c in calls}),
            }
        )
    assert max(taken.values()) == 1  # no trajectory trained twice


def _deployment_metadata(instance: DagsterInstance, k: int) -> dict:
    records = instance.fetch_materializations(
        AssetRecordsFilter(asset_key=AssetKey("deployment"), asset_partitions=[f"r{k:06d}"]), limit=1
    ).records
    return records[0].asset_materialization.metadata


def _lab_model(folder: Path) -> Path:
    """The lab's base model (its default size, warm-started as the lab's `base_model` does) as a
    deployment's owner would hand it over: an HF checkpoint with the lab's tokenizer."""
    lab = LabResource(data_dir=str(REPO / "data"))
    tok, cfg = lab.tokenizer(), lab.warm_start()
    model = build_model(lab.tiny_model(), len(tok), tok.pad_token_id)
    warm_start(model, solved_turns(tok, cfg.demonstrations(lab.puzzles("warmup"))), cfg, tok.pad_token_id)
    return user_checkpoint(folder, tok, model)


def _solved(store: DeltaStore, deployment_id: str) -> dict[str, bool]:
    """The deployment's greedy held-out results, evaluated here: production mode evaluates nothing."""
    lab = LabResource(data_dir=str(REPO / "data"))
    row = lookup(store, "deployments", "deployment_id", deployment_id)
    rows = evaluate(
        lab.engine(row["path"], row["quant_format"]),
        lab.tokenizer(),
        lab.puzzles("heldout"),
        deployment_id=deployment_id,
        round_=0,
    )
    return {r["puzzle_id"]: r["solved"] for r in rows}


def _print(run: Run, schedule: str) -> None:
    print(
        f"\nunattended {schedule} run: {len(run.rows)} rounds in {run.seconds:.0f} s; "
        f"{run.report.episodes} episodes, {run.report.calls} calls, {run.report.rewards_posted} rewards"
    )
    for row in run.rows:
        print("  " + ", ".join(f"{k}: {v}" for k, v in row.items()))


GATE = {"share": 0.5, "min_per_arm": 3, "margin": 3.0}
"""The canary gate on, deciding by its rule as soon as each arm has 3 scored trajectories. Rewards
are 0 or 1, so the lower bound of the difference is above -3 (t_{0.95, 2} * SE < 2): it promotes
whatever the tiny random model scores (its decisions are tested in tests/test_canary_gate.py and
tests/gateway/test_canary_routing.py)."""


def test_two_production_rounds_run_by_themselves_and_account_for_every_call(tmp_path):
    base = user_checkpoint(tmp_path / "model", load_tokenizer(REPO / "data" / "tokenizer"))
    run = run_unattended(
        tmp_path, rounds=2, **{**TINY, "steps": 2, "batch_size": 4}, base_checkpoint=str(base), canary=GATE
    )
    _account(run, 2)
    decided = {r["deployment_id"]: r for r in canaries.canaries(run.store)}
    for candidate in ("main-r000001", "main-r000002"):  # each promoted by the rule on both arms' rewards
        row = decided[candidate]
        numbers = json.loads(row["verdict_json"])
        assert (row["status"], row["decided_by"]) == (canaries.PROMOTED, canaries.BY_RULE)
        assert min(numbers["n_candidate"], numbers["n_control"]) >= GATE["min_per_arm"]
    arms = Counter((c["deployment_id"], c["arm"]) for c in run.store.read("landing_calls").to_pylist())
    assert arms[("main-r000001", "candidate")] and arms[("base", "control")]  # the canary's traffic
    _print(run, "sync")
    served = [r["traffic served by"] for r in run.rows]
    assert served == ["base", "main-r000001"]  # live moved after round 1, the gateway followed
    assert live_deployment(run.store)["deployment_id"] == "main-r000002"  # and after round 2
    with DagsterInstance.from_config(str(run.instance_home)) as instance:
        runs = instance.get_runs(RunsFilter(job_name="round_job"))
        assert sorted(r.tags["dagster/partition"] for r in runs) == ["r000001", "r000002"]
        assert {r.status for r in runs} == {DagsterRunStatus.SUCCESS}
    lags = [r["policy_lag_steps"] for r in run.store.read("train_steps").to_pylist()]
    assert sorted(lags) == [0, 0, 1, 1]  # synchronous: the traffic's policy is the trained one's parent


@pytest.mark.slow
def test_a_longer_unattended_async_run_raises_the_heldout_rate_on_simulated_traffic(tmp_path):
    """The lab's warm-started model as the deployment's checkpoint, one-round asynchrony, 4 rounds
    of 8 x 32 on simulated users: collection of round k+1 overlaps training of round k (policy lag
    >= S on some round), and the last live deployment solves more held-out puzzles than the base
    (paired, 95%)."""
    steps = 8
    base = _lab_model(tmp_path / "model")
    run = run_unattended(
        tmp_path,
        4,
        "async1",
        timeout=3000,
        users=4,
        think_seconds=1.0,
        steps=steps,
        batch_size=32,
        base_checkpoint=str(base),
        canary={"type": "off"},  # every round goes live: the test measures learning, not the gate
    )
    _account(run, 4)
    _print(run, "async1")
    lag = max(r["policy_lag_steps"] for r in run.store.read("train_steps").to_pylist())
    assert lag >= steps  # some round trained on traffic of the deployment two rounds back
    live = live_deployment(run.store)["deployment_id"]
    gain = paired_difference(_solved(run.store, live), _solved(run.store, "base"))
    print(
        f"  live {live} vs base: {gain.rate:.3f} vs {gain.baseline_rate:.3f} "
        f"(+{gain.diff:.3f} +- {1.96 * gain.se:.3f}, 95%)"
    )
    assert gain.diff - 1.96 * gain.se > 0
