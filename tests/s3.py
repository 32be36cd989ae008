"""A throwaway S3-compatible server on loopback for tests: moto's server in its own process (in the
test's process it would wait on the GIL that deltalake holds while it waits for the server's reply),
on a free port, with one bucket, stopped afterwards."""

from __future__ import annotations

import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import boto3
from botocore.exceptions import EndpointConnectionError

from prodrl_pipeline.gateway.process import free_port

BUCKET = "prodrl-test"


def s3_client(options: dict):
    """boto3's client for the server the storage `options` name."""
    return boto3.client(
        "s3",
        endpoint_url=options["AWS_ENDPOINT_URL"],
        aws_access_key_id=options["AWS_ACCESS_KEY_ID"],
        aws_secret_access_key=options["AWS_SECRET_ACCESS_KEY"],
        region_name=options["AWS_REGION"],
    )


@contextmanager
def s3_server(log: Path) -> Iterator[dict]:
    """The server, its log in `log`, bucket `BUCKET` created; yields the deltalake-style storage
    options that reach it."""
    port = free_port()
    with log.open("w") as out:
        server = subprocess.Popen(
            [sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(port)], stdout=out, stderr=out
        )
    options = {
        "AWS_ENDPOINT_URL": f"http://127.0.0.1:{port}",
        "AWS_ACCESS_KEY_ID": "test",
        "AWS_SECRET_ACCESS_KEY": "test",
        "AWS_REGION": "us-east-1",
        "AWS_ALLOW_HTTP": "true",
    }
    client = s3_client(options)
    deadline = time.monotonic() + 30
    try:
        while True:  # readiness probe
            try:
                client.create_bucket(Bucket=BUCKET)
                break
            except EndpointConnectionError:
                assert time.monotonic() < deadline and server.poll() is None, "moto's server did not start"
                time.sleep(0.1)
        yield options
    finally:
        server.terminate()
        server.wait(timeout=30)
