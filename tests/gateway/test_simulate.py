"""The traffic simulator against a real gateway: lab episodes through the openai client, rewards
late and out of order, everything landed as played."""

import asyncio
import re

import chess
import httpx
import pytest

import prodrl_pipeline.simulate as simulator
from prodrl_pipeline.envs.chess_env import MOVE_TOOL, move_text
from prodrl_pipeline.records.store import DeltaStore
from prodrl_pipeline.simulate import SimulationConfig, check_loopback, simulate
from tests.gateway.conftest import FEEDBACK_KEY, SERVE_KEY


def _solution_only(episode):
    """The `move` tool offering only the puzzle's next move: the tiny test model then plays every
    puzzle to its end, so episodes run several turns (a test double for a strong model)."""
    best = move_text(episode.board, chess.Move.from_uci(episode.puzzle.moves[episode.ply]))
    params = {
        **MOVE_TOOL["function"]["parameters"],
        "properties": {"move": {"type": "string", "enum": [best]}},
    }
    return {**MOVE_TOOL, "function": {**MOVE_TOOL["function"], "parameters": params}}


def test_simulated_users_play_lab_episodes_and_reward_them_late_and_out_of_order(
    gateway, heldout, monkeypatch
):
    monkeypatch.setattr(simulator, "_move_tool", _solution_only)
    puzzles = [p for p in heldout if p.n_player_moves >= 2][:6]
    cfg = SimulationConfig(users=3, episodes=6, reward_delay=0.3, max_tokens=64, seed=1)
    report = asyncio.run(simulate(gateway.url, SERVE_KEY, FEEDBACK_KEY, puzzles, cfg))
    assert report.errors == [] and report.abandoned == []
    assert report.episodes == report.solved == report.rewards_posted == 6
    assert report.calls == sum(p.n_player_moves for p in puzzles) > report.episodes  # multi-turn
    assert report.rewarded != report.finished  # posted newest first within each batch
    metrics = httpx.get(f"{gateway.url}/metrics", headers={"Authorization": f"Bearer {SERVE_KEY}"}).text
    gauge = {m[1]: int(m[2]) for m in re.finditer(r"^prodrl_gateway_(\w+) (\d+)$", metrics, re.M)}
    # each later turn's tools carry that turn's legal moves, and the template renders the tools in
    # the system prompt: the prompt no longer extends the previous call (the lab renders no tools)
    assert gauge["prefix_breaks_total"] == report.calls - report.episodes
    assert gauge["prefix_extends_total"] == 0
    gateway.stop()
    tables = DeltaStore(gateway.root / "tables")
    calls = tables.read("landing_calls").to_pylist()
    feedback = tables.read("landing_feedback").to_pylist()
    assert len(calls) == report.calls and {c["trajectory_id"] for c in calls} == set(report.finished)
    assert all(c["finish_reason"] == "stop" for c in calls)  # every turn ended in its move call
    assert {f["trajectory_id"]: f["reward"] for f in feedback} == report.rewards


def test_a_second_run_never_reuses_the_first_runs_trajectories(gateway, heldout):
    cfg = SimulationConfig(users=2, episodes=2, reward_delay=0.0, seed=0)
    first, second = (
        asyncio.run(simulate(gateway.url, SERVE_KEY, FEEDBACK_KEY, heldout, cfg)) for _ in range(2)
    )
    assert first.errors == second.errors == [] and not set(first.finished) & set(second.finished)


def test_puzzles_are_played_again_in_turn_and_stop_ends_play(gateway, heldout):
    cfg = SimulationConfig(users=1, episodes=5, reward_delay=0.0, seed=0)
    report = asyncio.run(simulate(gateway.url, SERVE_KEY, FEEDBACK_KEY, heldout[:2], cfg))
    assert report.errors == [] and report.episodes == len(set(report.finished)) == 5  # 2 puzzles, 5 episodes
    seen: list[int] = []
    stopped = asyncio.run(
        simulate(
            gateway.url,
            SERVE_KEY,
            FEEDBACK_KEY,
            heldout,
            SimulationConfig(users=2, episodes=50, reward_delay=0.0, think_seconds=0.05, seed=0),
            progress=lambda r: seen.append(r.episodes),
            stop=lambda: len(seen) >= 2,
        )
    )
    assert 2 <= stopped.episodes <= 3  # the other user may be mid-episode when stop turns true


@pytest.mark.parametrize(
    "url",
    [
        "http://example.com:8000",
        "http://10.0.0.5:8000",
        "http://[::2]:80",
        "http://127.0.0.1.evil.com",
        "http://127.0.0.1@evil.com",
        "http://evil.com\\@127.0.0.1",
        "http://0.0.0.0:8000",
    ],
)
def test_the_simulator_refuses_gateways_off_this_machine(url):
    with pytest.raises(ValueError, match="loopback|user info"):
        check_loopback(url)
    for ok in ("http://127.0.0.1:8000", "http://localhost:1", "http://LOCALHOST.:1", "http://[::1]:8000/v1"):
        check_loopback(ok)
