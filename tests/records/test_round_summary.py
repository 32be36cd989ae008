"""The per-round summary's held-out rate is over the puzzles every round was evaluated on: a round
that evaluates the full set beside rounds that evaluate a subset does not bend the curve."""

from prodrl_pipeline.records.queries import round_summary
from prodrl_pipeline.records.store import DeltaStore


def test_held_out_rates_are_over_the_puzzles_every_round_was_evaluated_on(tmp_path):
    store = DeltaStore(tmp_path)
    store.append("trajectories", [{"trajectory_id": f"t{i}", "round": 1, "reward": 1.0} for i in range(2)])
    store.append("train_steps", [{"experiment": "main", "round": 1, "step": 1, "engine_mismatch": 0.1}])
    full = {"p1": True, "p2": False, "p3": True, "p4": True}  # the base: all four puzzles, 3 solved
    subset = {"p1": True, "p2": True}  # round 1: the first two, both solved
    store.append(
        "eval_results",
        [
            {"round": k, "deployment_id": dep, "puzzle_id": p, "themes": "mateIn1", "solved": s}
            for k, dep, results in ((0, "base", full), (1, "main-r000001", subset))
            for p, s in results.items()
        ]
        + [{"round": 1, "deployment_id": "other-r000001", "puzzle_id": "p9", "themes": "", "solved": True}],
    )
    rows = round_summary(store, "main")
    got = [(r["round"], r["heldout_solve_rate"], r["mate_in_1"], r["heldout_puzzles"]) for r in rows]
    assert got == [(0, 0.5, 0.5, 2), (1, 1.0, 1.0, 2)]  # p1, p2 only: not the base's 0.75 on all four
    assert rows[1]["train_reward"] == 1.0 and rows[1]["engine_mismatch"] == 0.1
