"""A throwaway PostgreSQL server on loopback for tests: Debian's binaries (`make test` installs
the package), a fresh cluster in a temporary folder, a free port, stopped afterwards. PostgreSQL
refuses to run as root, so as root the cluster belongs to the package's `postgres` user."""

from __future__ import annotations

import glob
import os
import pwd
import shutil
import subprocess
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from prodrl_pipeline.gateway.process import free_port


def _binary(name: str) -> str:
    found = sorted(glob.glob(f"/usr/lib/postgresql/*/bin/{name}")) or [shutil.which(name)]
    if not found[-1]:
        raise RuntimeError(
            f"PostgreSQL's {name} is missing: `make test` installs Debian's postgresql package"
        )
    return found[-1]


@contextmanager
def postgres_server() -> Iterator[dict]:
    """Start a cluster in a fresh folder under the system's temporary directory (the `postgres`
    user must reach it: pytest's own folders are private to root); yields how to reach its
    `dagster` database (Dagster's `postgres_db` settings); removes it all afterwards."""
    folder = Path(tempfile.mkdtemp(prefix="prodrl-pg-"))
    data, sockets = folder / "data", folder / "sockets"
    sockets.mkdir()
    as_root = os.geteuid() == 0
    user = "postgres" if as_root else pwd.getpwuid(os.geteuid()).pw_name
    if as_root:
        shutil.chown(folder, user)
        shutil.chown(sockets, user)
    prefix = ["runuser", "-u", user, "--"] if as_root else []

    def run(*cmd: str) -> None:
        done = subprocess.run([*prefix, *cmd], capture_output=True, text=True, timeout=120)
        if done.returncode:
            raise RuntimeError(f"{' '.join(cmd)} failed: {done.stderr[-2000:]}")

    port = free_port()
    run(_binary("initdb"), "-D", str(data), "-A", "trust", "-U", user, "--no-sync")
    options = f"-h 127.0.0.1 -p {port} -k {sockets} -F"  # loopback only; -F: no fsync (a test cluster)
    run(_binary("pg_ctl"), "-D", str(data), "-o", options, "-l", str(folder / "server.log"), "-w", "start")
    try:
        run(_binary("createdb"), "-h", "127.0.0.1", "-p", str(port), "-U", user, "dagster")
        yield {
            "username": user,
            "password": "",
            "hostname": "127.0.0.1",
            "port": port,
            "db_name": "dagster",
            "scheme": "postgresql+psycopg2",  # SQLAlchemy 2.1 defaults to psycopg 3, which is not installed
        }
    finally:
        run(_binary("pg_ctl"), "-D", str(data), "-m", "fast", "-w", "stop")
        shutil.rmtree(folder, ignore_errors=True)
