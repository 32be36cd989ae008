"""The production gate end to end through the real gateway and a real Dagster instance: the gateway
routes new trajectories between the canary's candidate and live (stable per trajectory, recorded
per call), the sensor waits for their rewards, and `canary_job` rolls a worse candidate back
(live unchanged, nothing lost) and promotes an equal one (live moves, the gateway follows)."""

import httpx
from dagster import build_sensor_context, instance_for_test

from assets.canary import canary_job, canary_sensor
from prodrl_pipeline.evals.canary import CanaryConfig
from prodrl_pipeline.gateway.deployments import candidate_arm
from prodrl_pipeline.records import canaries
from prodrl_pipeline.records.registry import live_deployment
from prodrl_pipeline.records.snapshot import count_available
from prodrl_pipeline.records.store import DeltaStore
from tests.gateway.conftest import FEEDBACK_KEY, Gateway, make_root
from tests.gateway.test_follow import _chat, _health, _register, _until
from tests.test_pipeline import _resources

GATE = CanaryConfig(share=0.5, margin=0.2, confidence=0.95, min_per_arm=6, max_wait_hours=24.0)
TRAJECTORIES = 24


def _play(url: str, prefix: str) -> dict[str, str]:
    """Two calls per new trajectory; the deployment each trajectory was served by."""
    served = {}
    for i in range(TRAJECTORIES):
        tid = f"{prefix}-{i}"
        models = {_chat(url, tid, max_tokens=2)["model"] for _ in range(2)}
        assert len(models) == 1, f"{tid} moved between deployments: {models}"
        served[tid] = models.pop()
    return served


def _reward(url: str, rewards: dict[str, float]) -> None:
    for tid, reward in rewards.items():
        r = httpx.post(
            f"{url}/v1/feedback",
            json={"trajectory_id": tid, "reward": reward},
            headers={"Authorization": f"Bearer {FEEDBACK_KEY}"},
        )
        assert r.status_code == 200, r.text


def _decide(instance, resources) -> dict:
    """One canary sensor tick that requests a decision, and that run; the gate check it reported."""
    with build_sensor_context(instance=instance, resources=resources) as ctx:
        request = canary_sensor()(ctx)
    result = canary_job.execute_in_process(request.run_config, instance=instance, resources=resources)
    (check,) = result.get_asset_check_evaluations()
    assert check.check_name == "deploy_gate" and check.asset_key.path == ["deployment"]
    return check


def _waits(instance, resources) -> str:
    with build_sensor_context(instance=instance, resources=resources) as ctx:
        return canary_sensor()(ctx).skip_message


def test_a_worse_candidate_is_rolled_back_and_an_equal_one_promoted(tmp_path, tokenizer):
    root = make_root(tmp_path, tokenizer)
    store = DeltaStore(root / "tables")
    resources = _resources(root, source="production")
    gw = Gateway(root, "--follow-seconds", "0.1", "--drain-seconds", "1").start()
    try:
        with instance_for_test() as instance:
            # a worse candidate
            _register(root, tokenizer, "main-r000001", seed=11)
            first = canaries.open_canary(
                store, deployment_id="main-r000001", round_=1, control_id="base", config=GATE
            )
            _until(lambda: _health(gw.url)["canary"] == first["canary_id"], "the gateway runs the canary")
            served = _play(gw.url, "a")
            expected = {
                tid: "main-r000001" if candidate_arm(first["canary_id"], tid, GATE.share) else "base"
                for tid in served
            }
            assert served == expected  # each new trajectory on its hashed arm, every call of it
            assert {"main-r000001", "base"} == set(served.values())
            assert "waiting: 0 candidate" in _waits(instance, resources)  # no reward yet
            worse = {
                t: (0.0 if d == "base" else -1.0) + 0.1 * (i % 2) for i, (t, d) in enumerate(served.items())
            }
            _reward(gw.url, worse)  # the candidate's trajectories score 1 lower
            _until(lambda: store.read("landing_feedback").num_rows == TRAJECTORIES, "rewards land")
            check = _decide(instance, resources)
            assert not check.passed and check.description.startswith("rolled back: candidate")
            meta = {k: v.value for k, v in check.metadata.items()}
            n_candidate = sum(d == "main-r000001" for d in served.values())
            assert (meta["n_candidate"], meta["n_control"]) == (n_candidate, TRAJECTORIES - n_candidate)
            assert meta["lower_bound"] < -GATE.margin and meta["decided_by"] == canaries.BY_RULE
            assert live_deployment(store)["deployment_id"] == "base" and meta["live_now"] == "base"
            calls = store.read("landing_calls").to_pylist()
            assert len(calls) == 2 * TRAJECTORIES  # nothing lost: both arms' calls stay recorded
            for c in calls:  # with the arm that served them
                arm = "candidate" if c["deployment_id"] == "main-r000001" else "control"
                assert (c["canary_id"], c["arm"]) == (first["canary_id"], arm)
            _until(lambda: _health(gw.url)["canary"] is None, "the gateway ends the canary")
            assert _chat(gw.url, "after-rollback")["model"] == "base"

            # an equal candidate
            _register(root, tokenizer, "main-r000002", seed=12)
            second = canaries.open_canary(
                store, deployment_id="main-r000002", round_=2, control_id="base", config=GATE
            )
            _until(lambda: _health(gw.url)["canary"] == second["canary_id"], "the gateway runs the canary")
            served = _play(gw.url, "b")
            _reward(gw.url, {t: float(i % 2) for i, t in enumerate(served)})
            _until(lambda: store.read("landing_feedback").num_rows == 2 * TRAJECTORIES, "rewards land")
            check = _decide(instance, resources)
            assert check.passed and check.description.startswith("promoted: candidate")
            assert abs(check.metadata["diff"].value) <= 0.2
            assert live_deployment(store)["deployment_id"] == "main-r000002"
            _until(lambda: _health(gw.url)["deployment_id"] == "main-r000002", "the gateway follows live")
            assert _health(gw.url)["canary"] is None
            candidate_arm_trajectories = sum(d == "main-r000002" for d in served.values())
            n, _ = count_available(store, 3, "main-r000002", 100)  # the next round takes them
            assert n == candidate_arm_trajectories
            rows = {r["canary_id"]: r for r in canaries.canaries(store)}
            assert (rows[first["canary_id"]]["status"], rows[second["canary_id"]]["status"]) == (
                canaries.ROLLED_BACK,
                canaries.PROMOTED,
            )
    finally:
        gw.stop()
