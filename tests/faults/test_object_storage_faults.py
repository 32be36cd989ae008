"""Storage faults on object storage: an S3-compatible server (moto) behind an HTTP proxy that the test
makes fail chosen requests with 503 (a throttled or unavailable service). A Delta commit whose log
entry cannot be written, or a store that answers nothing, fails with an error naming the table, and
the table reads at its previous version once the service is back; an upload whose files or manifest
cannot be written fails, and the version it was writing can never be read."""

from __future__ import annotations

import json
import subprocess
import sys
import urllib.request
from collections.abc import Iterator
from datetime import UTC, datetime

import pytest

from prodrl_pipeline.artifacts import Artifacts
from prodrl_pipeline.records.store import DeltaStore, StorageError
from tests.faults.faulty_proxy import CONTROL
from tests.test_object_storage import BUCKET, s3  # noqa: F401 (the fixture)


class Proxy:
    """The proxy process: `fail(methods, contains)` sets which requests get 503, `refused` counts them."""

    def __init__(self, upstream: str):
        self.process = subprocess.Popen(
            [sys.executable, "-m", "tests.faults.faulty_proxy", upstream], stdout=subprocess.PIPE, text=True
        )
        self.url = f"http://127.0.0.1:{int(self.process.stdout.readline())}"

    def _control(self, rule: dict | None = None) -> dict:
        data, method = (None, "GET") if rule is None else (json.dumps(rule).encode(), "PUT")
        request = urllib.request.Request(self.url + CONTROL, data=data, method=method)
        with urllib.request.urlopen(request, timeout=30) as answer:
            return json.loads(answer.read())

    def fail(self, methods: tuple[str, ...] = (), contains: str = "") -> None:
        self._control({"methods": list(methods), "contains": contains})

    @property
    def refused(self) -> int:
        return self._control()["refused"]


@pytest.fixture
def proxy(s3) -> Iterator[tuple[Proxy, dict]]:  # noqa: F811 (the fixture)
    server = Proxy(s3["AWS_ENDPOINT_URL"])
    options = {
        **s3,
        "AWS_ENDPOINT_URL": server.url,
        "max_retries": "2",  # the client's own retries, kept short: the fault outlasts them
        "retry_timeout": "5s",
    }
    yield server, options
    server.process.kill()
    server.process.wait()


def _rows(tag: str, n: int) -> list[dict]:
    now = datetime.now(UTC)
    return [
        {"table_name": "calls", "round": 1, "record_id": f"{tag}{i}", "reason": tag, "record_json": "{}",
         "rejected_at": now}
        for i in range(n)
    ]  # fmt: skip


def test_a_commit_that_cannot_be_written_fails_naming_the_table_which_keeps_its_version(proxy):
    """A commit whose log entry is refused, then a service that answers nothing: each fails with a
    StorageError naming the table (one plain line, the storage's own reason in it); the table reads
    at its previous version once the service is back, and takes the next commit."""
    server, options = proxy
    tables = DeltaStore(f"s3://{BUCKET}/t", storage_options=options)
    tables.overwrite_round("rejects", _rows("a", 5), 1)
    server.fail(("PUT",), "/_delta_log/")
    with pytest.raises(StorageError, match=r"table 'rejects' failed: .*last committed version \(0\)"):
        tables.overwrite_round("rejects", _rows("b", 7), 1)
    assert server.refused > 0, "the fault never fired"
    assert tables.table("rejects").version() == 0  # reads still work: only the commit failed
    assert sorted(r["record_id"] for r in tables.read("rejects").to_pylist()) == [f"a{i}" for i in range(5)]
    server.fail(("GET", "PUT", "POST", "DELETE", "HEAD"))  # the whole service down
    with pytest.raises(StorageError, match=r"table 'rejects' .*cannot be read: the storage failed: .*503"):
        tables.overwrite_round("rejects", _rows("c", 3), 1)
    server.fail()  # back
    assert sorted(r["record_id"] for r in tables.read("rejects").to_pylist()) == [f"a{i}" for i in range(5)]
    tables.overwrite_round("rejects", _rows("d", 2), 1)
    assert tables.table("rejects").version() == 1 and tables.read("rejects").num_rows == 2


@pytest.mark.parametrize("failing", ["model.safetensors", ".manifest.json"])
def test_an_upload_that_fails_midway_fails_and_its_version_is_never_readable(proxy, tmp_path, failing):
    server, options = proxy
    artifacts = Artifacts(f"s3://{BUCKET}/a", options, tmp_path / "cache")
    uri = artifacts.uri("checkpoints", "r1")
    with artifacts.writing(uri) as first:
        (first.folder / "model.safetensors").write_bytes(b"v1" * 1000)
    server.fail(("PUT", "POST"), failing)
    with pytest.raises(OSError), artifacts.writing(uri) as second:
        (second.folder / "model.safetensors").write_bytes(b"v2" * 1000)
    assert server.refused > 0, "the fault never fired"
    server.fail()
    with pytest.raises(FileNotFoundError, match="never completed"):
        Artifacts(f"s3://{BUCKET}/a", options, tmp_path / "fresh").local(second.uri)
    assert (artifacts.local(first.uri) / "model.safetensors").read_bytes() == b"v1" * 1000
