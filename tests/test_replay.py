"""Replay backfills: rounds re-derived from stored traffic in one run, in round order; a
counterfactual replay under another experiment leaves the original lineage and live pointer alone."""

import hashlib
import json

from dagster import AssetKey, instance_for_test, materialize
from dagster._core.storage.tags import ASSET_PARTITION_RANGE_END_TAG, ASSET_PARTITION_RANGE_START_TAG

from assets.partitions import round_key
from prodrl_pipeline.records.registry import live_deployment
from tests.test_pipeline import ASSETS, ROUND, _resources, run_rounds


def _hashes(root, experiment: str) -> dict[str, str]:
    return {
        p.parent.name: hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted((root / "checkpoints" / experiment).glob("r*/model.safetensors"))
    }


def _range(first: int, last: int) -> dict[str, str]:
    return {ASSET_PARTITION_RANGE_START_TAG: round_key(first), ASSET_PARTITION_RANGE_END_TAG: round_key(last)}


def test_replay_is_in_order_and_bit_identical_and_counterfactual_leaves_the_original_alone(tmp_path):
    resources = _resources(tmp_path, gate_margin=1.0)  # tiny models: keep the gate out of this test
    tables = resources["store"].tables()
    with instance_for_test() as instance:
        run_rounds(instance, resources, (1, 2, 3))
        original = _hashes(tmp_path, "main")
        assert len(original) == 3 and live_deployment(tables)["deployment_id"] == "main-r000003"

        # replay rounds 1..3 from the stored traffic in ONE run (single-run backfill policy)
        replay = materialize(
            ASSETS, selection=ROUND[1:], instance=instance, resources=resources, tags=_range(1, 3)
        )
        assert replay.success
        starts = [e.step_key for e in replay.all_events if e.event_type_value == "STEP_START"]
        assert starts.count("checkpoint") == 1  # one step looped over r1, r2, r3 in order
        assert _hashes(tmp_path, "main") == original  # bit-identical on CPU
        train = tables.read("train_steps").to_pylist()
        assert sorted(r["step"] for r in train if r["experiment"] == "main") == [1, 2, 3, 4, 5, 6]

        lineage = sorted(tables.read("checkpoints").to_pylist(), key=lambda r: r["checkpoint_id"])

        # counterfactual: the same traffic, another estimator, its own chain, never live
        advantages_version = tables.table("advantages").version()
        cf = _resources(tmp_path, gate_margin=1.0, experiment="cf-tis", counterfactual=True)
        run_config = {"ops": {"checkpoint": {"config": {"estimator": {"type": "tis_ppo"}}}}}
        result = materialize(
            ASSETS,
            selection=ROUND[1:],
            instance=instance,
            resources=cf,
            tags=_range(1, 3),
            run_config=run_config,
        )
        assert result.success
        assert tables.table("advantages").version() == advantages_version  # kept, not rewritten
        assert _hashes(tmp_path, "main") == original
        after = sorted(tables.read("checkpoints").to_pylist(), key=lambda r: r["checkpoint_id"])
        assert [r for r in after if r["experiment"] != "cf-tis"] == lineage
        assert live_deployment(tables)["deployment_id"] == "main-r000003"
        chain = {r["checkpoint_id"]: r["parent_id"] for r in tables.read("checkpoints").to_pylist()}
        assert chain["cf-tis-r000002"] == "cf-tis-r000001" and chain["cf-tis-r000001"] == "base"
        assert set(_hashes(tmp_path, "cf-tis")) == {"r000001", "r000002", "r000003"}
        meta_of = {
            exp: json.loads((tmp_path / "checkpoints" / exp / "r000002" / "prodrl.json").read_text())
            for exp in ("main", "cf-tis")
        }
        assert {exp: m["trainer"]["estimator"]["type"] for exp, m in meta_of.items()} == {
            "main": "score_centering",  # the default estimator
            "cf-tis": "tis_ppo",
        }
        meta = instance.get_latest_materialization_event(
            AssetKey("eval_report")
        ).asset_materialization.metadata
        assert (
            "main solve rate" in meta["vs_original"].value
            and "cf-tis solve rate" in meta["vs_original"].value
        )

        # a replay whose settings would give the round other advantages is refused: the original's stay
        odd = _resources(tmp_path, experiment="cf-odd", counterfactual=True, batch_size=4)
        refused = materialize(
            ASSETS, selection=ROUND[1:2], partition_key=round_key(1), instance=instance, resources=odd,
            raise_on_error=False,
        )  # fmt: skip
        assert not refused.success
        failure = next(e for e in refused.all_events if e.event_type_value == "STEP_FAILURE")
        assert "give other advantages than those stored" in str(failure.event_specific_data)
        assert tables.table("advantages").version() == advantages_version
