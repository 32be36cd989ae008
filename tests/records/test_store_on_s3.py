"""The store on an S3-compatible server (moto on loopback): every operation reaches the bucket
through the store's storage options, a kept snapshot catches up with another writer's commits
(there is no local commit file to look at), and a round overwrite replaces only its round."""

import pytest

from prodrl_pipeline.records.registry import live_deployment, set_live
from prodrl_pipeline.records.store import DeltaStore
from tests.records.test_store import _call, _register
from tests.s3 import BUCKET, s3_server


@pytest.fixture(scope="module")
def s3(tmp_path_factory):
    with s3_server(tmp_path_factory.mktemp("moto") / "moto.log") as options:
        yield options


def _ids(table) -> list[tuple]:
    return sorted((r["round"], r["call_id"]) for r in table.to_pylist())


def test_the_store_reads_writes_overwrites_and_queries_tables_in_a_bucket(s3):
    root = f"s3://{BUCKET}/writes/"
    ours, theirs = DeltaStore(root, storage_options=s3, lineage=True), DeltaStore(root, storage_options=s3)
    assert ours.root == f"s3://{BUCKET}/writes" and not ours.exists("calls")
    ours.append("calls", [_call(1, 1, [1], [-1.0]), _call(2, 2, [2], [-1.0])])
    assert ours.exists("calls") and ours.table("calls").version() == 0
    theirs.append("calls", [_call(3, 1, [3], [-1.0])])  # another writer: our kept snapshot catches up
    assert _ids(ours.read("calls", 1)) == [(1, "c1"), (1, "c3")]
    assert ours.overwrite_round("calls", [_call(4, 1, [4], [-1.0])], 1) == 1
    assert _ids(theirs.read("calls")) == [(1, "c4"), (2, "c2")]
    assert _ids(ours.read("calls", version=1)) == [(1, "c1"), (1, "c3"), (2, "c2")]
    assert ours.versions_written == {"calls": {0, 2}} and ours.versions_read == {"calls": {1}}
    got = ours.query("SELECT count(*) AS n FROM calls WHERE round = 2", ["calls"]).to_pylist()
    assert got == [{"n": 1}]
    assert ours.transaction_version("calls", "gateway-1") == -1
    assert ours.append("calls", [_call(5, 2, [5], [-1.0])], transaction=("gateway-1", 7))
    assert not theirs.append("calls", [_call(5, 2, [5], [-1.0])], transaction=("gateway-1", 7))
    assert theirs.transaction_version("calls", "gateway-1") == 7


def test_the_live_pointer_moves_in_a_bucket(s3):
    store = DeltaStore(f"s3://{BUCKET}/registry", storage_options=s3)
    _register(store, "base", "r1")
    set_live(store, "r1")
    assert live_deployment(DeltaStore(f"s3://{BUCKET}/registry", storage_options=s3))["deployment_id"] == "r1"
