"""Dagster's run, event and schedule storage on a real PostgreSQL server (started by the test on
loopback): a round runs and the round sensor ticks against it."""

import psycopg2
from dagster import AssetKey, instance_for_test

from tests.postgres import postgres_server
from tests.test_pipeline import _resources, run_rounds
from tests.test_sensor import _tick


def test_a_round_and_the_sensor_run_on_postgres_storage(tmp_path):
    resources = _resources(tmp_path / "store")
    with postgres_server() as db:
        storage = {"storage": {"postgres": {"postgres_db": db}}}
        with instance_for_test(overrides=storage) as instance:
            assert type(instance.run_storage).__name__ == "PostgresRunStorage"
            run_rounds(instance, resources, (1,))
            assert "r000001" in instance.get_materialized_partitions(AssetKey("eval_report"))
            result, _ = _tick(instance, resources, None)  # round 1 is deployed: round 2 may start
            assert [r.partition_key for r in result.run_requests] == ["r000002"]
        connect = dict(host=db["hostname"], port=db["port"], user=db["username"], dbname=db["db_name"])
        with psycopg2.connect(**connect) as conn, conn.cursor() as cur:  # the rows really are in PostgreSQL
            cur.execute("SELECT count(*) FROM runs")
            (runs,) = cur.fetchone()
            cur.execute("SELECT count(*) FROM event_logs WHERE dagster_event_type = 'ASSET_MATERIALIZATION'")
            (materializations,) = cur.fetchone()
    assert runs == 2 and materializations == 6  # base_model, then the round's five assets
