"""Production path: gateway traffic + late rewards -> the `trajectories` asset's snapshot -> a round."""

import httpx
from dagster import AssetKey, instance_for_test, materialize

from assets.base_model import base_model
from assets.partitions import round_key
from prodrl_pipeline.records.store import DeltaStore
from tests.gateway.conftest import FEEDBACK_KEY, SERVE_KEY, Gateway
from tests.test_pipeline import ASSETS, ROUND, _resources

# trajectory ids as clients send them: plain in the header, any text as `user`
TIDS = [f"t{i}" if i % 2 else f"ü {i}@example.com\r\n'; --" for i in range(10)]


def test_a_round_trains_on_recorded_production_traffic(tmp_path):
    resources = _resources(tmp_path, source="production", steps=2, batch_size=4)
    with instance_for_test() as instance:
        assert materialize([base_model], instance=instance, resources=resources).success
        gw = Gateway(tmp_path).start()  # serves the live deployment: base
        serve = {"Authorization": f"Bearer {SERVE_KEY}"}
        for i in range(10):
            for turn in range(2):
                body = {"messages": [{"role": "user", "content": f"task {i} turn {turn}"}], "max_tokens": 6}
                named = {"X-Prodrl-Trajectory-Id": TIDS[i]} if i % 2 else {}
                r = httpx.post(
                    f"{gw.url}/v1/chat/completions",
                    json=body if i % 2 else {**body, "user": TIDS[i]},
                    headers={**serve, **named},
                )
                assert r.status_code == 200
            if i < 9:  # t9 stays unscored: it must not be trained on
                fb = {"trajectory_id": TIDS[i], "reward": float(i % 2)}
                r = httpx.post(
                    f"{gw.url}/v1/feedback", json=fb, headers={"Authorization": f"Bearer {FEEDBACK_KEY}"}
                )
                assert r.status_code == 200
        gw.stop()

        instance.add_dynamic_partitions("rounds", [round_key(1)])
        assert materialize(
            ASSETS, selection=ROUND, partition_key=round_key(1), instance=instance, resources=resources
        ).success
        tables = DeltaStore(tmp_path / "tables")
        trajs = tables.read("trajectories", 1).to_pylist()
        assert len(trajs) == 8 and {t["source"] for t in trajs} == {"production"}
        assert {t["deployment_id"] for t in trajs} == {"base"}
        assert {t["trajectory_id"] for t in trajs} == set(TIDS[:8])  # the earliest, exactly as named
        assert all(t["n_calls"] == 2 for t in trajs)
        assert tables.read("calls", 1).num_rows == 16
        meta = instance.get_latest_materialization_event(
            AssetKey("trajectories")
        ).asset_materialization.metadata
        pinned = {t: meta[f"{t}_version"].value for t in ("landing_calls", "landing_feedback")}

        # a replay reads the same landing versions, even after more traffic has landed
        tables.append(
            "landing_feedback",
            [
                {
                    "feedback_id": "late",
                    "trajectory_id": "t9",
                    "reward": 1.0,
                    "comment": None,
                    "overwrite": False,
                    "received_at": trajs[0]["finished_at"],
                }
            ],
        )
        recollect = {"ops": {"trajectories": {"config": {"recollect": True}}}}
        assert materialize(
            ASSETS,
            selection=ROUND[:1],
            partition_key=round_key(1),
            instance=instance,
            resources=resources,
            run_config=recollect,
        ).success
        again = tables.read("trajectories", 1).to_pylist()
        assert sorted(t["trajectory_id"] for t in again) == sorted(t["trajectory_id"] for t in trajs)
        meta = instance.get_latest_materialization_event(
            AssetKey("trajectories")
        ).asset_materialization.metadata
        assert {t: meta[f"{t}_version"].value for t in pinned} == pinned
        assert tables.live_deployment()["deployment_id"] == "main-r000001"
