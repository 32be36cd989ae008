"""The production snapshot over real landing tables: which trajectories a round takes, that a
pinned snapshot reads the same rows again, and that traffic landing while rounds snapshot is taken
exactly once."""

import threading
import time
from datetime import UTC, datetime, timedelta

import pytest

from prodrl_pipeline.gateway.landing import LandingLog
from prodrl_pipeline.records.snapshot import count_available, snapshot_production
from prodrl_pipeline.records.store import DeltaStore
from tests.gateway.test_landing import _call, _feedback

T0 = datetime(2026, 11, 30, tzinfo=UTC)


def _served(i: int, deployment: str = "d", index: int = 0, minutes: int | None = None) -> dict:
    call = _call(i) | {"deployment_id": deployment, "call_index": index, "call_id": f"c{i}-{index}"}
    return call | {"created_at": T0 + timedelta(minutes=i if minutes is None else minutes)}


def _scored(i: int, reward: float, seconds: int = 0, fid: str | None = None) -> dict:
    return _feedback(i) | {
        "reward": reward,
        "feedback_id": fid or f"f{i}-{seconds}",
        "received_at": T0 + timedelta(seconds=seconds),
    }


def test_a_round_takes_scored_trajectories_served_wholly_by_its_deployment(tmp_path):
    store = DeltaStore(tmp_path)
    with pytest.raises(
        RuntimeError, match=r"no production traffic yet: \['landing_calls', 'landing_feedback'\]"
    ):
        snapshot_production(store, 1, "d", 10)
    assert count_available(store, 1, "d", 10) == (0, {})
    store.append(
        "landing_calls",
        [
            _served(1),
            _served(1, index=1, minutes=9),  # two calls
            _served(2),
            _served(3, "other"),
            _served(4),
            _served(4, "other", index=1),  # 4: two deployments
            _served(5),
            _served(6),
            _served(7, minutes=0),  # 7: the earliest
        ],
    )
    store.append(
        "landing_feedback",
        [
            _scored(1, 0.0, 1),
            _scored(1, 1.0, 2),  # the latest feedback wins
            _scored(2, 0.5),
            _scored(3, 1.0),
            _scored(4, 1.0),
            _scored(6, 1.0),
            _scored(7, 0.25),
            _scored(6, 0.0, 5, fid="a"),
            _scored(6, 0.75, 5, fid="b"),  # a tie in time: the larger id wins
        ],
    )  # 5 has no feedback
    store.overwrite_round("trajectories", [{"trajectory_id": "t2", "round": 3, "reward": 0.5}], 3)

    snap = snapshot_production(store, 1, "d", limit=10)
    assert [t["trajectory_id"] for t in snap.trajectories] == ["t7", "t1", "t6"]  # by first call
    t1 = snap.trajectories[1]
    assert (t1["reward"], t1["n_calls"], t1["n_completion_tokens"]) == (1.0, 2, 2)
    assert (t1["started_at"], t1["finished_at"]) == (T0 + timedelta(minutes=1), T0 + timedelta(minutes=9))
    assert snap.trajectories[2]["reward"] == 0.75
    assert all(
        t["round"] == 1 and t["task_id"] is None and t["source"] == "production" for t in snap.trajectories
    )
    assert all(t["deployment_id"] == "d" for t in snap.trajectories)
    assert sorted(c["call_id"] for c in snap.calls) == ["c1-0", "c1-1", "c6-0", "c7-0"]
    assert all(c["round"] == 1 for c in snap.calls)
    assert snap.versions == {"landing_calls": 0, "landing_feedback": 0}
    # round 3 took t2; re-snapshotting round 3 itself may take it again (a re-run)
    assert "t2" in {t["trajectory_id"] for t in snapshot_production(store, 3, "d", 10).trajectories}
    assert [t["trajectory_id"] for t in snapshot_production(store, 1, "d", limit=2).trajectories] == [
        "t7",
        "t1",
    ]
    assert count_available(store, 1, "d", 10) == (3, snap.versions)
    assert count_available(store, 1, "d", 2)[0] == 2

    # later traffic does not change a snapshot pinned to its versions
    store.append("landing_calls", [_served(8, minutes=-5), _served(1, index=2, minutes=10)])
    store.append("landing_feedback", [_scored(8, 1.0), _scored(7, 0.0, 9)])
    again = snapshot_production(store, 1, "d", 10, versions=snap.versions)
    assert again.trajectories == snap.trajectories and again.calls == snap.calls
    latest = snapshot_production(store, 1, "d", 10)
    assert [t["trajectory_id"] for t in latest.trajectories] == ["t8", "t7", "t1", "t6"]
    assert latest.trajectories[1]["reward"] == 0.0 and latest.trajectories[2]["n_calls"] == 3
    assert latest.versions == {"landing_calls": 1, "landing_feedback": 1}
    with pytest.raises(ValueError, match="deployment id \"d' OR '1\" must match"):
        snapshot_production(store, 1, "d' OR '1", 10)


def test_traffic_landing_while_rounds_snapshot_is_taken_once(tmp_path):
    """The gateway's landing log appends (and commits) from its own thread while round after round
    snapshots and stores its trajectories: every snapshot is whole (each chosen trajectory with all
    its calls), and once traffic stops every scored trajectory was taken by exactly one round."""
    store = DeltaStore(tmp_path / "tables")
    log = LandingLog(store, tmp_path / "spool", flush_records=4, flush_seconds=0.01)
    log.start()
    n, stop = 120, threading.Event()

    def traffic():
        for i in range(n):
            log.append("call", _served(i, minutes=0) | {"created_at": T0 + timedelta(seconds=i)})
            log.append("call", _served(i, index=1, minutes=0) | {"created_at": T0 + timedelta(seconds=i)})
            log.append("feedback", _scored(i, 1.0))
        stop.set()

    writer = threading.Thread(target=traffic)
    writer.start()
    taken: dict[str, int] = {}
    round_, deadline = 0, time.monotonic() + 120

    def take(round_: int) -> list[dict]:
        snap = snapshot_production(store, round_, "d", limit=25)
        calls: dict[str, int] = {}
        for c in snap.calls:
            calls[c["trajectory_id"]] = calls.get(c["trajectory_id"], 0) + 1
        for t in snap.trajectories:
            assert calls.get(t["trajectory_id"]) == t["n_calls"] == 2, f"round {round_}: {t} partial"
            assert t["trajectory_id"] not in taken, f"round {round_} took {t['trajectory_id']} again"
            taken[t["trajectory_id"]] = round_
        store.overwrite_round("trajectories", snap.trajectories, round_)
        return snap.trajectories

    try:
        while not stop.is_set() or log.pending:  # rounds while the traffic lands
            assert time.monotonic() < deadline, "the traffic did not land in time"
            if all(store.exists(t) for t in ("landing_calls", "landing_feedback")):
                round_ += 1
                take(round_)
            else:
                stop.wait(0.01)
    finally:
        stop.set()
        writer.join()
        log.stop()
    for later in range(round_ + 1, round_ + 2 + n // 25):  # what is left, 25 a round
        if not take(later):
            break
    assert sorted(taken) == sorted(f"t{i}" for i in range(n))
    assert store.read("trajectories").num_rows == n


def test_a_trajectory_completed_between_the_two_version_reads_is_taken_whole_or_not_at_all(tmp_path):
    """The landing log commits a trajectory's last call, then its reward, while a snapshot pins the
    two landing tables' versions one after the other: the snapshot must not take the trajectory
    with its first call only (its n_calls would then be 1, and the second call lost to training)."""

    class Landing(DeltaStore):
        landed = False

        def table(self, table, version=None):
            dt = super().table(table, version)
            if table in ("landing_calls", "landing_feedback") and version is None and not self.landed:
                self.landed = True  # between the first and the second version read
                self.append("landing_calls", [_served(1, index=1)])
                self.append("landing_feedback", [_scored(1, 1.0)])
            return dt

    for count in (True, False):
        store = Landing(tmp_path / str(count))
        store.append("landing_calls", [_served(1)])
        store.append("landing_feedback", [_scored(2, 1.0)])
        if count:  # the sensor's count is of the versions it returns
            versions = {"landing_calls": 1, "landing_feedback": 0}  # the call landed between the reads
            assert count_available(store, 1, "d", limit=10) == (0, versions)
    snap = snapshot_production(store, 1, "d", limit=10)
    assert [t["trajectory_id"] for t in snap.trajectories] == []  # its reward was not visible yet
    later = snapshot_production(store, 1, "d", limit=10)
    assert [(t["trajectory_id"], t["n_calls"]) for t in later.trajectories] == [("t1", 2)]
