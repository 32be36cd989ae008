"""A vLLM server for recording: its command line, its start, an in-place weight reload, and the
golden-prompt check that the weights it serves are the deployment's.

Reload (vLLM >= 0.30, server started with VLLM_SERVER_DEV_MODE=1): `POST /collective_rpc` with
`reload_weights(weights_path=...)` loads the new export layer by layer into the running engine,
`POST /update_weight_version` tags everything generated from then on (responses report it per
token range when asked with `return_weight_versions`), and `POST /reset_prefix_cache` drops KV
blocks computed with the old weights. The golden check then asks for greedy completions of fixed
prompts and compares them with what the embedded engine computes on the same export: the new
weights are live when they agree better with the new deployment's tokens than with the old one's.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path

import httpx

RECORDING_FLAGS = ("--logprobs-mode", "processed_logprobs", "--generation-config", "vllm")
"""Log-probs after temperature, top-k/top-p and structured-output masks (what was sampled from),
and no sampling defaults taken from the model's generation_config (the request's are recorded)."""


def serve_command(
    export: str | Path, port: int, top_logprobs: int = 20, extra: Sequence[str] = ()
) -> list[str]:
    """`vllm serve` on a deployment export with the recording flags, on loopback."""
    return [
        sys.executable,
        "-m",
        "vllm.entrypoints.openai.api_server",
        "--model",
        str(export),
        "--served-model-name",
        "prodrl",
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        *RECORDING_FLAGS,
        "--max-logprobs",
        str(top_logprobs + 1),
        "--structured-outputs-config",
        '{"backend": "guidance"}',
        *extra,
    ]


class VLLMServer:
    """`vllm serve` as a child process (dev mode on, for reloads); `url` once `start()` returns."""

    def __init__(self, command: Sequence[str], log: Path):
        self.command, self.log, self.process = list(command), log, None
        port = self.command[self.command.index("--port") + 1]
        self.url = f"http://127.0.0.1:{port}"

    def start(self, timeout: float = 600.0) -> VLLMServer:
        env = {**os.environ, "VLLM_SERVER_DEV_MODE": "1"}
        with self.log.open("ab") as log:
            self.process = subprocess.Popen(self.command, stdout=log, stderr=log, env=env)
        deadline = time.monotonic() + timeout
        while True:
            try:
                if httpx.get(f"{self.url}/health", timeout=2).status_code == 200:
                    return self
            except httpx.TransportError:
                pass
            if self.process.poll() is not None or time.monotonic() > deadline:
                self.stop()
                raise RuntimeError(f"vLLM did not start; its log: {self.log}")
            time.sleep(1)  # polling a readiness probe, not waiting for an event

    def stop(self) -> None:
        if self.process is not None and self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(timeout=60)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()


def reload(url: str, export: str | Path, version: str, client: httpx.Client | None = None) -> None:
    """Load `export` into the running server in place and tag its output `version`."""
    http = client or httpx.Client(timeout=600)
    calls = [
        ("/collective_rpc", {"method": "reload_weights", "kwargs": {"weights_path": str(export)}}),
        ("/update_weight_version", {"new_version": version}),
        ("/reset_prefix_cache", None),
    ]
    for path, body in calls:
        r = http.post(f"{url.rstrip('/')}{path}", json=body)
        if r.status_code >= 400:
            raise RuntimeError(f"vLLM {path} answered {r.status_code}: {r.text[:500]}")


def greedy_tokens(
    url: str,
    model: str,
    prompts: Sequence[Sequence[int]],
    max_tokens: int,
    client: httpx.Client | None = None,
) -> list[list[int]]:
    """The server's greedy completion ids of each token-id prompt."""
    http = client or httpx.Client(timeout=120)
    out = []
    for prompt in prompts:
        r = http.post(
            f"{url.rstrip('/')}/v1/completions",
            json={
                "model": model,
                "prompt": list(prompt),
                "max_tokens": max_tokens,
                "temperature": 0,
                "return_token_ids": True,
            },
        )
        r.raise_for_status()
        out.append(r.json()["choices"][0]["token_ids"])
    return out


def agreement(served: Sequence[Sequence[int]], expected: Sequence[Sequence[int]]) -> float:
    """Mean over prompts of the length of the common prefix ÷ the expected length (1: identical)."""
    scores = []
    for got, want in zip(served, expected, strict=True):
        common = next(
            (i for i, (a, b) in enumerate(zip(got, want, strict=False)) if a != b), min(len(got), len(want))
        )
        scores.append(common / max(len(want), 1))
    return sum(scores) / len(scores)


def golden_check(
    served: Sequence[Sequence[int]],
    new: Sequence[Sequence[int]],
    old: Sequence[Sequence[int]] | None,
    minimum: float = 0.5,
) -> tuple[bool, str]:
    """Whether the served greedy completions show the new weights: agreement with the new
    deployment's tokens at least `minimum` and above the agreement with the old one's."""
    a_new = agreement(served, new)
    a_old = agreement(served, old) if old is not None else None
    passed = a_new >= minimum and (a_old is None or a_new > a_old or new == old)
    reason = f"golden prompts agree {a_new:.2f} with the new deployment" + (
        f" and {a_old:.2f} with the old one" if a_old is not None else ""
    )
    return passed, reason
