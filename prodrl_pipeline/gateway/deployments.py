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
- While the registry has an active canary (`records.canaries.active`), its candidate is loaded
  beside live (smoke-checked too) and each new trajectory is routed by `candidate_arm`: to the
  candidate, or to live as the control arm; its calls record the canary and the arm. When the
  canary closes, the candidate drains as an old deployment does, or becomes current if live moved
  to it (promoted).
"""

from __future__ import annotations

import hashlib
import logging
import math
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Literal

from prodrl_pipeline.engine.processing import SamplingParams
from prodrl_pipeline.engine.rows import Request
from prodrl_pipeline.gateway.batcher import BatchingEngine
from prodrl_pipeline.records import canaries
from prodrl_pipeline.records.registry import export_of, live_deployment, lookup
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


def candidate_arm(canary_id: str, trajectory_id: str, share: float) -> bool:
    """Whether canary `canary_id` routes the new trajectory `trajectory_id` to its candidate:
    u = the first 8 bytes of blake2b(canary_id NUL trajectory_id) as an integer / 2^64, uniform on
    [0, 1); candidate iff u < share. Stable per trajectory id (every call of a trajectory, in any
    gateway process), independent across canaries."""
    digest = hashlib.blake2b(f"{canary_id}\0{trajectory_id}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "big") / 2**64 < share


@dataclass(frozen=True)
class Arm:
    """The canary that routed a trajectory, and to which arm."""

    canary_id: str
    name: Literal["candidate", "control"]


@dataclass(frozen=True)
class Canary:
    """The active canary as the gateway runs it: its candidate loaded beside live."""

    canary_id: str
    share: float
    candidate: Loaded


@dataclass(frozen=True)
class Route:
    """Where one call goes: the deployment leased to it and, for a trajectory's first call routed
    by a canary, its arm."""

    loaded: Loaded
    arm: Arm | None = None


def smoke_check(loaded: Loaded, prompt_id: int) -> None:
    """One sampled token from the deployment; ValueError unless its log-prob is finite."""
    request = Request([prompt_id], SamplingParams(max_tokens=1))
    completion, _ = loaded.engine.submit(request).result(timeout=120)
    if len(completion.logprobs) != 1 or not math.isfinite(completion.logprobs[0]):
        raise ValueError(f"{loaded.deployment_id}: smoke generation gave log-probs {completion.logprobs}")


class Deployments:
    """The current deployment, the active canary's candidate and the ones still draining;
    thread-safe."""

    def __init__(self, first: Loaded, drain_seconds: float = 60.0):
        self.drain_seconds = drain_seconds
        self._lock = threading.Lock()
        self._current = first
        self._canary: Canary | None = None
        self._draining: list[Loaded] = []
        self.switches = 0
        self.load_failures = 0
        self.last_error: str | None = None

    @property
    def current(self) -> Loaded:
        return self._current

    @property
    def canary(self) -> Canary | None:
        return self._canary

    def ids(self) -> list[str]:
        """Loaded deployment ids: the current one, the canary's candidate, the draining ones."""
        with self._lock:
            candidate = [self._canary.candidate] if self._canary else []
            return [d.deployment_id for d in (self._current, *candidate, *self._draining)]

    def draining(self) -> list[str]:
        with self._lock:
            return [d.deployment_id for d in self._draining]

    def acquire(self, model: str | None, pinned: str | None, trajectory_id: str | None = None) -> Route:
        """Where a call goes: `model` if it names a loaded deployment, else the trajectory's
        `pinned` one while it serves, else (a new `trajectory_id`) the arm the active canary routes
        it to, else the current one. The deployment is leased until `release`: a leased one is not
        closed."""
        with self._lock:
            now = time.monotonic()
            serving = {d.deployment_id: d for d in self._draining if d.retire_at > now}
            if self._canary:
                serving[self._canary.candidate.deployment_id] = self._canary.candidate
            serving[self._current.deployment_id] = self._current
            route = Route(serving.get(model) or serving.get(pinned) or self._current)
            if model not in serving and pinned not in serving and trajectory_id is not None and self._canary:
                c = self._canary
                to_candidate = candidate_arm(c.canary_id, trajectory_id, c.share)
                route = Route(
                    c.candidate if to_candidate else self._current,
                    Arm(c.canary_id, "candidate" if to_candidate else "control"),
                )
            route.loaded.leases += 1
            return route

    def release(self, loaded: Loaded) -> None:
        with self._lock:
            loaded.leases -= 1

    def switch(self, new: Loaded) -> Loaded:
        """Make `new` current; the previous one drains. Returns the previous one."""
        with self._lock:
            return self._promote(new)

    def revive(self, deployment_id: str, export: str) -> Loaded | None:
        """Make the loaded deployment `deployment_id`, loaded from `export`, current: the active
        canary's candidate (promoted; the canary ends) or a draining one (live moved back to it
        before it was closed); the previous current one drains. Returns the previous one, None if
        that export is neither."""
        with self._lock:
            if self._canary and (self._canary.candidate.deployment_id, self._canary.candidate.export) == (
                deployment_id,
                export,
            ):
                candidate, self._canary = self._canary.candidate, None
                return self._promote(candidate)
            found = [d for d in self._draining if (d.deployment_id, d.export) == (deployment_id, export)]
            if not found:
                return None
            self._draining.remove(found[0])
            return self._promote(found[0])

    def start_canary(self, canary: Canary) -> None:
        """Route new trajectories by `canary` from now (a previous canary's candidate drains)."""
        self.end_canary()
        with self._lock:
            self._canary = canary

    def end_canary(self) -> str | None:
        """New trajectories all go to the current deployment; the candidate drains. Its id."""
        with self._lock:
            if self._canary is None:
                return None
            candidate, self._canary = self._canary.candidate, None
            candidate.retire_at = time.monotonic() + self.drain_seconds
            self._draining.append(candidate)
            return candidate.deployment_id

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
            candidate = [self._canary.candidate] if self._canary else []
            everything, self._draining, self._canary = [self._current, *candidate, *self._draining], [], None
        for d in everything:
            d.engine.close()


class LiveFollower:
    """A thread that polls the deployments and canaries registries every `poll_seconds`: when the
    live row names another deployment or another export of the current one (its path, and so its
    vLLM label, changed), it loads it (`load`, a registry row -> Loaded, smoke-checked) and switches
    to it; when the active canary changes, it loads the new one's candidate or ends the canary; it
    also closes drained deployments."""

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
        self._seen: tuple[int, int] | None = None  # registry versions last acted on
        self._failed: tuple[tuple[str, str], float] | None = None  # ((id, path), retry time)
        self._canary_failed: tuple[str, float] | None = None  # (canary id, retry time)

    def check(self, now: float | None = None) -> str | None:
        """One poll: switch to the live deployment if it changed (its id or its export, `export_of`),
        then follow the active canary. Returns the id switched to."""
        now = time.monotonic() if now is None else now
        self.deployments.retire(now)
        version = (
            self.store.table("deployments").version(),
            self.store.table("canaries").version() if self.store.exists("canaries") else -1,
        )
        retry_due = any(f is not None and now >= f[1] for f in (self._failed, self._canary_failed))
        if version == self._seen and not retry_due:
            return None
        self._seen = version
        switched = self._follow_live(now)
        self._follow_canary(now)
        return switched

    def _follow_live(self, now: float) -> str | None:
        live = live_deployment(self.store)
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
            log.info("live moved to %s, already loaded: serving it; %s drains", target, old.deployment_id)
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

    def _follow_canary(self, now: float) -> None:
        """Run the registry's active canary: load its candidate (a failed load is retried after
        `retry_seconds`; meanwhile live serves every trajectory), or end the one that closed."""
        found = canaries.active(canaries.canaries(self.store)) if self.store.exists("canaries") else None
        row = found[0] if found else None
        if row is not None and row["deployment_id"] == self.deployments.current.deployment_id:
            row = None  # promoted: live serves it (the canary's decision is recorded after the move)
        running = self.deployments.canary
        if (row and row["canary_id"]) == (running and running.canary_id):
            return
        if row is None:
            self._canary_failed = None
            if ended := self.deployments.end_canary():
                log.info("canary %s ended: %s drains", running.canary_id, ended)
            return
        failed = self._canary_failed
        if failed and failed[0] == row["canary_id"] and now < failed[1]:
            return
        try:
            loaded = self.load(lookup(self.store, "deployments", "deployment_id", row["deployment_id"]))
        except Exception as e:  # noqa: BLE001 - live keeps serving every trajectory
            message = f"loading canary {row['canary_id']}'s candidate failed: {type(e).__name__}: {e}"
            log.exception(message)
            self.deployments.failed(message)
            self._canary_failed = (row["canary_id"], now + self.retry_seconds)
            return
        self._canary_failed = None
        self.deployments.start_canary(Canary(row["canary_id"], row["share"], loaded))
        log.info(
            "canary %s: %s serves %.0f%% of new trajectories beside %s",
            row["canary_id"],
            row["deployment_id"],
            100 * row["share"],
            self.deployments.current.deployment_id,
        )

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
