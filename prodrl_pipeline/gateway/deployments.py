"""The deployments a gateway serves, and how it follows the registry's live pointer.

Contract (docs/gateway.md, "Following the live pointer"):
- New trajectories go to the current deployment. A trajectory keeps the deployment that served
  its first call while that deployment is loaded, so its calls come from one policy; a request
  whose `model` names a loaded deployment is served by that one.
- When the live pointer moves, or the live deployment is re-exported (same id, another path: a
  re-run of its round), the new export is loaded beside the current one, off the serving path, and
  must pass a one-token smoke generation (finite log-probs). It becomes current between two
  requests. The old one finishes every call already given to it and serves the
  trajectories it started for `drain_seconds` more; then, once no call holds it, it is closed.
- Every record names the deployment that produced it (the one the call was leased to).
- A load that fails leaves the current deployment serving; the error is logged, counted on
  /metrics, shown on /healthz, and the load is retried after `retry_seconds`.
"""

from __future__ import annotations

import logging
import math
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

from prodrl_pipeline.engine.processing import SamplingParams
from prodrl_pipeline.engine.rows import Request
from prodrl_pipeline.gateway.batcher import BatchingEngine
from prodrl_pipeline.records.registry import export_of
from prodrl_pipeline.records.store import DeltaStore

log = logging.getLogger("prodrl.gateway")


@dataclass(eq=False)
class Loaded:
    """One deployment loaded in the gateway: its id, its engine, its context length and the export
    it was loaded from (`records.registry.export_of` its registry row)."""

    deployment_id: str
    engine: BatchingEngine
    max_positions: int
    export: str = ""
    retire_at: float | None = None
    """Monotonic time after which it takes no new trajectories' calls (None while current)."""
    leases: int = 0
    """Calls between routing and submission to its engine."""


def smoke_check(loaded: Loaded, prompt_id: int) -> None:
    """One sampled token from the deployment; ValueError unless its log-prob is finite."""
    request = Request([prompt_id], SamplingParams(max_tokens=1))
    completion, _ = loaded.engine.submit(request).result(timeout=120)
    if len(completion.logprobs) != 1 or not math.isfinite(completion.logprobs[0]):
        raise ValueError(f"{loaded.deployment_id}: smoke generation gave log-probs {completion.logprobs}")


class Deployments:
    """The current deployment and the ones still draining; thread-safe."""

    def __init__(self, first: Loaded, drain_seconds: float = 60.0):
        self.drain_seconds = drain_seconds
        self._lock = threading.Lock()
        self._current = first
        self._draining: list[Loaded] = []
        self.switches = 0
        self.load_failures = 0
        self.last_error: str | None = None

    @property
    def current(self) -> Loaded:
        return self._current

    def ids(self) -> list[str]:
        """Loaded deployment ids, the current one first."""
        with self._lock:
            return [d.deployment_id for d in (self._current, *self._draining)]

    def draining(self) -> list[str]:
        with self._lock:
            return [d.deployment_id for d in self._draining]

    def acquire(self, model: str | None, pinned: str | None) -> Loaded:
        """The deployment a call goes to (`model` if it names a loaded deployment, else the
        trajectory's `pinned` one while it drains, else the current one), leased until `release`:
        a leased deployment is not closed."""
        with self._lock:
            now = time.monotonic()
            serving = {d.deployment_id: d for d in self._draining if d.retire_at > now}
            serving[self._current.deployment_id] = self._current
            chosen = serving.get(model) or serving.get(pinned) or self._current
            chosen.leases += 1
            return chosen

    def release(self, loaded: Loaded) -> None:
        with self._lock:
            loaded.leases -= 1

    def switch(self, new: Loaded) -> Loaded:
        """Make `new` current; the previous one drains. Returns the previous one."""
        with self._lock:
            return self._promote(new)

    def revive(self, deployment_id: str, export: str) -> Loaded | None:
        """Make the draining deployment `deployment_id`, loaded from `export`, current again (live
        moved back to it before it was closed); the previous current one drains. Returns the
        previous one, None if that export is not draining."""
        with self._lock:
            found = [d for d in self._draining if (d.deployment_id, d.export) == (deployment_id, export)]
            if not found:
                return None
            self._draining.remove(found[0])
            return self._promote(found[0])

    def _promote(self, new: Loaded) -> Loaded:
        """(Lock held.) `new` becomes current, the current one drains from now."""
        old, self._current = self._current, new
        new.retire_at = None
        old.retire_at = time.monotonic() + self.drain_seconds
        self._draining.append(old)
        self.switches += 1
        self.last_error = None
        return old

    def failed(self, message: str | None) -> None:
        """Record a failed load (None: the failure no longer matters, live is served)."""
        with self._lock:
            self.load_failures += message is not None
            self.last_error = message

    def retire(self, now: float | None = None) -> list[str]:
        """Close the draining deployments past their drain time that no call holds; their ids."""
        now = time.monotonic() if now is None else now
        with self._lock:
            done = [d for d in self._draining if d.retire_at <= now and d.leases == 0]
            self._draining = [d for d in self._draining if d not in done]
        for d in done:
            d.engine.close()  # finishes what it was given
        return [d.deployment_id for d in done]

    def close(self) -> None:
        """Close every engine (shutdown): each finishes what it was given."""
        with self._lock:
            everything, self._draining = [self._current, *self._draining], []
        for d in everything:
            d.engine.close()


class LiveFollower:
    """A thread that polls the deployments registry every `poll_seconds` and, when the live row
    names another deployment or another export of the current one (its path, and so its vLLM
    label, changed), loads it (`load`, a registry row -> Loaded, smoke-checked) and switches to it;
    it also closes drained deployments."""

    def __init__(
        self,
        store: DeltaStore,
        deployments: Deployments,
        load: Callable[[dict], Loaded],
        poll_seconds: float = 2.0,
        retry_seconds: float = 30.0,
    ):
        self.store, self.deployments, self.load = store, deployments, load
        self.poll_seconds, self.retry_seconds = poll_seconds, retry_seconds
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._seen: int | None = None  # registry version last acted on
        self._failed: tuple[tuple[str, str], float] | None = None  # ((id, path), retry time)

    def check(self, now: float | None = None) -> str | None:
        """One poll: switch to the live deployment if it changed (its id or its export, `export_of`).
        Returns the id switched to."""
        now = time.monotonic() if now is None else now
        self.deployments.retire(now)
        version = self.store.table("deployments").version()
        retry_due = self._failed is not None and now >= self._failed[1]
        if version == self._seen and not retry_due:
            return None
        live = self.store.live_deployment()
        self._seen = version
        current = self.deployments.current
        wanted = None if live is None else (live["deployment_id"], export_of(live))
        if wanted is None or wanted == (current.deployment_id, current.export):
            if self._failed:
                self._failed = None
                self.deployments.failed(None)
            return None
        target = live["deployment_id"]
        if self._failed and self._failed[0] == wanted and now < self._failed[1]:
            return None
        if (old := self.deployments.revive(*wanted)) is not None:
            log.info(
                "live moved back to %s, still loaded: serving it again; %s drains", target, old.deployment_id
            )
            self._failed = None
            return target
        if target == current.deployment_id:
            log.info("live %s was re-exported (%s): loading it beside the old export", target, live["path"])
        else:
            log.info("live moved to %s: loading it beside %s", target, current.deployment_id)
        try:
            loaded = self.load(live)
        except Exception as e:  # noqa: BLE001 - any failure keeps the current deployment serving
            message = f"loading {target} failed: {type(e).__name__}: {e}"
            log.exception("%s; still serving %s", message, self.deployments.current.deployment_id)
            self.deployments.failed(message)
            self._failed = (wanted, now + self.retry_seconds)
            return None
        self._failed = None
        old = self.deployments.switch(loaded)
        log.info(
            "now serving %s; %s drains for %g s",
            target,
            old.deployment_id,
            self.deployments.drain_seconds,
        )
        return target

    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, name="live-follower", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self._thread:
            self._thread.join()

    def _run(self) -> None:
        while not self._stop.wait(self.poll_seconds):
            try:
                self.check()
            except Exception:  # noqa: BLE001 - a registry read can fail transiently; poll again
                log.exception("following the live pointer")
