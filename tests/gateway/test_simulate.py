"""The traffic simulator against a real gateway: lab episodes through the openai client, rewards
late and out of order, everything landed as played."""

import asyncio
from collections import Counter

import pytest

from prodrl_pipeline.records.store import DeltaStore
from prodrl_pipeline.simulate import SimulationConfig, check_loopback, simulate
from tests.gateway.conftest import FEEDBACK_KEY, SERVE_KEY


def test_simulated_users_play_lab_episodes_and_reward_them_late_and_out_of_order(gateway, heldout):
    cfg = SimulationConfig(users=3, episodes=6, reward_delay=0.3, max_tokens=64, seed=1)
    report = asyncio.run(simulate(gateway.url, SERVE_KEY, FEEDBACK_KEY, heldout, cfg))
    assert report.errors == [] and report.episodes == 6 and report.rewards_posted == 6
    assert report.rewarded != report.finished  # out of order (seeded delays)
    gateway.stop()
    tables = DeltaStore(gateway.root / "tables")
    calls = tables.read("landing_calls").to_pylist()
    feedback = tables.read("landing_feedback").to_pylist()
    assert Counter(c["trajectory_id"] for c in calls).total() == report.calls
    assert {c["trajectory_id"] for c in calls} == set(report.finished)
    assert all(c["finish_reason"] == "stop" for c in calls)  # every turn ended in its move call
    by_traj = {f["trajectory_id"]: f for f in feedback}
    assert {t: f["reward"] for t, f in by_traj.items()} == report.rewards
    last_call = max(c["created_at"] for c in calls)
    assert min(f["received_at"] for f in feedback) > min(c["created_at"] for c in calls)
    assert max(f["received_at"] for f in feedback) > last_call  # rewards trail the traffic


@pytest.mark.parametrize("url", ["http://example.com:8000", "http://10.0.0.5:8000", "http://[::2]:80"])
def test_the_simulator_refuses_gateways_off_this_machine(url):
    with pytest.raises(ValueError, match="loopback"):
        check_loopback(url)
    check_loopback("http://127.0.0.1:8000")
    check_loopback("http://localhost:1")
