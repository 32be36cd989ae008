from collections import defaultdict
from datetime import UTC, datetime

import pytest

from prodrl_pipeline.records.queries import compute_advantages
from prodrl_pipeline.records.store import DeltaStore

NOW = datetime(2026, 11, 30, tzinfo=UTC)


def _trajs(round_, n, unscored=()):
    return [
        {
            "trajectory_id": f"r{round_}-t{i}",
            "round": round_,
            "deployment_id": "d",
            "task_id": f"p{i}",
            "reward": None if i in unscored else float((i * 7) % 3 == 0),
            "n_calls": 1,
            "n_completion_tokens": 3,
            "started_at": NOW,
            "finished_at": NOW,
            "source": "lab",
        }
        for i in range(n)
    ]


def test_batch_mean_baseline_per_minibatch(tmp_path):
    store = DeltaStore(tmp_path)
    store.overwrite_round("trajectories", _trajs(1, 50, unscored={3, 4}), 1)
    store.overwrite_round("trajectories", _trajs(2, 10), 2)
    rows = compute_advantages(store, round_=1, batch_size=8, steps=5, seed=0).to_pylist()
    assert len(rows) == 40  # 48 scored, S*B = 40 trained, each once
    assert len({r["trajectory_id"] for r in rows}) == 40
    assert all(r["trajectory_id"].startswith("r1-") and r["reward"] is not None for r in rows)
    groups = defaultdict(list)
    for r in rows:
        groups[r["minibatch"]].append(r)
    assert sorted(groups) == [0, 1, 2, 3, 4] and all(len(g) == 8 for g in groups.values())
    for g in groups.values():
        mean = sum(r["reward"] for r in g) / len(g)
        for r in g:
            assert r["baseline"] == pytest.approx(mean) and r["advantage"] == pytest.approx(
                r["reward"] - mean
            )
    again = compute_advantages(store, round_=1, batch_size=8, steps=5, seed=0).to_pylist()
    assert again == rows  # deterministic
    other = compute_advantages(store, round_=1, batch_size=8, steps=5, seed=1).to_pylist()
    assert {r["trajectory_id"] for r in other if r["minibatch"] == 0} != {
        r["trajectory_id"] for r in rows if r["minibatch"] == 0
    }


def test_bad_sizes_are_refused(tmp_path):
    with pytest.raises(ValueError, match="batch_size"):
        compute_advantages(DeltaStore(tmp_path), round_=1, batch_size=0, steps=1, seed=0)
