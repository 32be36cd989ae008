import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from prodrl_pipeline.model import build_model
from prodrl_pipeline.quant.nvfp4 import export_deployment
from prodrl_pipeline.records.registry import register_deployment
from prodrl_pipeline.records.store import DeltaStore
from tests.conftest import TINY

SERVE_KEY, FEEDBACK_KEY = "sk-serve-test", "sk-feedback-test"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def make_root(root: Path, tokenizer) -> Path:
    """A store root with one live NVFP4 deployment of a tiny model."""
    model = build_model(TINY, len(tokenizer), tokenizer.pad_token_id)
    export_deployment(model, root / "deployments" / "base", "nvfp4")
    store = DeltaStore(root / "tables")
    register_deployment(
        store,
        deployment_id="base",
        round_=0,
        checkpoint_id="base",
        path=str(root / "deployments" / "base"),
        quant_format="nvfp4",
        sampling_json="{}",
    )
    store.set_live("base")
    return root


class Gateway:
    """A real gateway process on loopback."""

    def __init__(self, root: Path, *args: str):
        self.root, self.args, self.port = root, args, free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.proc: subprocess.Popen | None = None

    def start(self, timeout: float = 60.0) -> "Gateway":
        env = {**os.environ, "PRODRL_API_KEYS": SERVE_KEY, "PRODRL_FEEDBACK_KEYS": FEEDBACK_KEY}
        cmd = [
            sys.executable,
            "-m",
            "prodrl_pipeline.gateway",
            "--root",
            str(self.root),
            "--port",
            str(self.port),
            "--flush-seconds",
            "0.2",
            "--max-tokens",
            "16",
            *self.args,
        ]
        with (self.root / f"gateway-{self.port}.log").open("a") as log:  # the child keeps its own handle
            self.proc = subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=log)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:  # readiness probe, not a sleep-as-synchronisation
            if self.proc.poll() is not None:
                raise RuntimeError(f"gateway exited with {self.proc.returncode}; see {self.root}")
            try:
                if httpx.get(f"{self.url}/healthz", timeout=1).status_code == 200:
                    return self
            except httpx.TransportError:
                pass
            time.sleep(0.1)
        raise TimeoutError("gateway did not become healthy")

    def stop(self) -> None:
        if self.proc and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)  # graceful: flushes the landing log
            self.proc.wait(timeout=60)

    def kill(self) -> None:
        self.proc.send_signal(signal.SIGKILL)
        self.proc.wait(timeout=10)


@pytest.fixture
def gateway(tmp_path, tokenizer):
    gw = Gateway(make_root(tmp_path, tokenizer)).start()
    yield gw
    gw.stop()
