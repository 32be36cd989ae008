"""What the gateway knows about each trajectory (session): its calls so far, reward, expiry.

Kept in memory, rebuilt on start from the landing tables (after the spool replay), so feedback can
be answered 404 (unknown), 409 (already rewarded, or expired) without a table scan per request.
"""

from __future__ import annotations

import hashlib
import threading
import time
from array import array
from dataclasses import dataclass
from typing import Literal

from prodrl_pipeline.gateway.deployments import Arm
from prodrl_pipeline.records.store import DeltaStore

EXPIRED_TABLE = "landing_trajectories"  # `rejects.table_name` of trajectories expired unscored


@dataclass
class Session:
    n_calls: int = 0
    last_seen: float = 0.0
    rewarded: bool = False
    expired: bool = False
    served: tuple[int, bytes] | None = None
    """Length and digest of the last call's prompt + completion ids (this process's calls only)."""
    deployment: str | None = None
    """The deployment this process routed the trajectory's first call to."""
    arm: Arm | None = None
    """The canary arm that first call was routed to (None: no canary routed it)."""


def _digest(ids: list[int]) -> bytes:
    return hashlib.blake2b(array("q", ids).tobytes(), digest_size=16).digest()


class SessionIndex:
    def __init__(self, ttl_seconds: float):
        self.ttl = ttl_seconds
        self._sessions: dict[str, Session] = {}
        self._lock = threading.Lock()

    def load(self, store: DeltaStore) -> None:
        if store.exists("landing_calls"):
            rows = store.query(
                "SELECT trajectory_id, count(*) AS n, max(created_at) AS last "
                "FROM landing_calls GROUP BY trajectory_id",
                ["landing_calls"],
            ).to_pylist()
            for r in rows:
                self._sessions[r["trajectory_id"]] = Session(r["n"], r["last"].timestamp())
        if store.exists("landing_feedback"):
            for r in store.query(
                "SELECT DISTINCT trajectory_id FROM landing_feedback", ["landing_feedback"]
            ).to_pylist():
                self._sessions.setdefault(r["trajectory_id"], Session()).rewarded = True
        if store.exists("rejects"):
            sql = f"SELECT record_id FROM rejects WHERE table_name = '{EXPIRED_TABLE}'"
            for r in store.query(sql, ["rejects"]).to_pylist():
                self._sessions.setdefault(r["record_id"], Session()).expired = True

    def __len__(self) -> int:
        return len(self._sessions)

    @property
    def n_expired(self) -> int:
        return sum(s.expired for s in self._sessions.values())

    def next_call_index(self, trajectory_id: str) -> int:
        with self._lock:
            s = self._sessions.setdefault(trajectory_id, Session())
            s.n_calls += 1
            s.last_seen = time.time()
            return s.n_calls - 1

    def is_expired(self, trajectory_id: str) -> bool:
        with self._lock:
            s = self._sessions.get(trajectory_id)
            return bool(s and s.expired)

    def pinned(self, trajectory_id: str) -> str | None:
        with self._lock:
            s = self._sessions.get(trajectory_id)
            return s.deployment if s else None

    def pin(self, trajectory_id: str, deployment_id: str, arm: Arm | None = None) -> None:
        """Remember the deployment and canary arm of the trajectory's first call (later calls keep
        the first's)."""
        with self._lock:
            s = self._sessions.setdefault(trajectory_id, Session())
            if s.deployment is None:
                s.deployment, s.arm = deployment_id, arm

    def arm(self, trajectory_id: str, deployment_id: str) -> Arm | None:
        """The trajectory's canary arm, if `deployment_id` (the call's) is the one it was routed to."""
        with self._lock:
            s = self._sessions.get(trajectory_id)
            return s.arm if s and s.deployment == deployment_id else None

    def follow(self, trajectory_id: str, prompt_ids: list[int], completion_ids: list[int]) -> bool | None:
        """Does this call's prompt extend the trajectory's previous call's prompt + completion
        exactly? None when there is no previous call served by this process. Remembers this call."""
        served = list(prompt_ids) + list(completion_ids)
        with self._lock:
            s = self._sessions.setdefault(trajectory_id, Session())
            prev, s.served = s.served, (len(served), _digest(served))
        if prev is None:
            return None
        n, digest = prev
        return len(prompt_ids) >= n and _digest(prompt_ids[:n]) == digest

    def claim_reward(
        self, trajectory_id: str, overwrite: bool
    ) -> Literal["ok", "unknown", "expired", "rewarded"]:
        """Atomically check that a reward may be recorded, and mark the trajectory rewarded."""
        with self._lock:
            s = self._sessions.get(trajectory_id)
            if s is None or s.n_calls == 0:
                return "unknown"
            if s.expired:
                return "expired"
            if s.rewarded and not overwrite:
                return "rewarded"
            s.rewarded = True
            return "ok"

    def release_reward(self, trajectory_id: str) -> None:
        """Undo `claim_reward` when the reward could not be recorded."""
        with self._lock:
            if trajectory_id in self._sessions:
                self._sessions[trajectory_id].rewarded = False

    def expire(self, now: float | None = None) -> list[str]:
        """Trajectories unscored for longer than the TTL: marked expired and returned (once)."""
        now = time.time() if now is None else now
        out = []
        with self._lock:
            for tid, s in self._sessions.items():
                if not s.rewarded and not s.expired and s.n_calls and now - s.last_seen > self.ttl:
                    s.expired = True
                    out.append(tid)
        return out
