"""Run the gateway as a child process on loopback (tests, benchmarks, scripts)."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class GatewayProcess:
    """`python -m prodrl_pipeline.gateway --root ROOT ARGS...` on a free loopback port."""

    def __init__(self, root: Path, *args: str, env: dict[str, str] | None = None):
        self.root, self.args, self.env, self.port = Path(root), args, env or {}, free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.proc: subprocess.Popen | None = None

    def start(self, timeout: float = 60.0) -> GatewayProcess:
        cmd = [
            sys.executable,
            "-m",
            "prodrl_pipeline.gateway",
            "--root",
            str(self.root),
            "--port",
            str(self.port),
            *self.args,
        ]
        with (self.root / f"gateway-{self.port}.log").open("a") as log:  # the child keeps its own handle
            self.proc = subprocess.Popen(
                cmd, env={**os.environ, **self.env}, stdout=subprocess.DEVNULL, stderr=log
            )
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:  # readiness probe
            if self.proc.poll() is not None:
                raise RuntimeError(
                    f"gateway exited with {self.proc.returncode}; see {self.root}/gateway-*.log"
                )
            try:
                if httpx.get(f"{self.url}/healthz", timeout=1).status_code == 200:
                    return self
            except httpx.TransportError:
                pass
            time.sleep(0.1)
        raise TimeoutError("gateway did not become healthy")

    def stop(self) -> None:
        """Graceful stop: the landing log is committed before the process exits."""
        if self.proc and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            self.proc.wait(timeout=60)

    def kill(self) -> None:
        self.proc.send_signal(signal.SIGKILL)
        self.proc.wait(timeout=10)
