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
from transformers import PreTrainedModel

from prodrl_pipeline.quant.nvfp4 import export_deployment
from prodrl_pipeline.records.registry import register_deployment, set_live
from prodrl_pipeline.records.store import DeltaStore


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class GatewayProcess:
    """`python -m prodrl_pipeline.gateway --root ROOT ARGS...` on a free loopback port."""

    def __init__(self, root: Path, *args: str, env: dict[str, str] | None = None, cwd: Path | None = None):
        """`cwd`: the checkout whose code runs (another revision, for side-by-side benchmarks)."""
        self.root, self.args, self.env, self.port = Path(root), args, env or {}, free_port()
        self.cwd = cwd
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
                cmd, env={**os.environ, **self.env}, stdout=subprocess.DEVNULL, stderr=log, cwd=self.cwd
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


def live_root(root: Path, model: PreTrainedModel, quant_format: str = "nvfp4") -> Path:
    """A store root whose only deployment, `base`, is `model` exported and live: what a gateway
    needs to serve (tests, benchmarks)."""
    root = Path(root)
    export_deployment(model, root / "deployments" / "base", quant_format)
    store = DeltaStore(root / "tables")
    register_deployment(
        store,
        deployment_id="base",
        round_=0,
        checkpoint_id="base",
        path=str(root / "deployments" / "base"),
        quant_format=quant_format,
        sampling_json="{}",
    )
    set_live(store, "base")
    return root
