"""The study runner on the real round graph at tiny settings: a replay beside its source,
resume after an interruption, and the report."""

import hashlib
import math

import pytest
from dagster import AssetKey, instance_for_test

from assets.study import report, run_study
from prodrl_pipeline.evals.gate import paired_difference
from prodrl_pipeline.evals.study import (
    COMPARISONS,
    Difference,
    StudyConfig,
    f_quantile,
    f_sf,
    mde,
    run_order,
    seed_difference,
    t975,
    t_quantile,
    variance_p,
    verdict,
)
from prodrl_pipeline.evals.study_report import finding
from prodrl_pipeline.records.store import DeltaStore
from tests.test_pipeline import TINY


def _checkpoints(root):
    return {
        str(p.relative_to(root)): hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(root.glob("*/s0/checkpoints/*/r*/model.safetensors"))
    }


def test_study_runs_resumes_and_reports(tmp_path):
    root = tmp_path / "study"
    with instance_for_test() as instance:
        # "interrupted" after round 1: the re-run asked for 2 rounds runs only what is missing
        assert run_study(instance, root, ["retok16"], [0], rounds=1, defaults=TINY) == 2
        first = _checkpoints(root)
        assert sorted(first) == [
            "sc16/s0/checkpoints/retok16/r000001/model.safetensors",
            "sc16/s0/checkpoints/sc16/r000001/model.safetensors",
        ]
        assert run_study(instance, root, ["retok16"], [0], rounds=2, defaults=TINY) == 2
        after = _checkpoints(root)
        assert len(after) == 4 and {k: after[k] for k in first} == first  # round 1 untouched
        assert run_study(instance, root, ["retok16"], [0], rounds=2, defaults=TINY) == 0
        # a configuration whose settings changed since its rounds ran is refused, not mixed in
        changed = StudyConfig("sc16", {"estimator": {"type": "reinforce"}})
        with pytest.MonkeyPatch.context() as mp:
            mp.setattr("assets.study.run_order", lambda names: [changed])
            with pytest.raises(
                SystemExit, match=r"sc16 round 1 was trained with other settings \(estimator\)"
            ):
                run_study(instance, root, ["sc16"], [0], rounds=2, defaults=TINY)

        # the compared round-2 evaluations replaced by known ones: sc16 solves 12 of the 16 held-out
        # puzzles, retok16 4 of those: d = 1 on 8 puzzles, 0 on 8, mean 0.5, se sqrt(4/15)/4
        tables = DeltaStore(str(root / "sc16" / "s0" / "tables"))
        rows = [r for r in tables.read("eval_results").to_pylist() if r["round"] == 2]
        ids = sorted({r["puzzle_id"] for r in rows})
        assert len(ids) == 16
        known = [
            {**r, "solved": ids.index(r["puzzle_id"]) < (12 if r["deployment_id"] == "sc16-r000002" else 4)}
            for r in rows
        ]
        tables.overwrite("eval_results", known, "round = 2")
        out = tmp_path / "docs" / "results.md"
        report(instance, root, [0], out)
        shown = instance.get_latest_materialization_event(
            AssetKey("study_report")
        ).asset_materialization.metadata
    text = out.read_text()
    assert shown["findings"].value.splitlines()[2].startswith("| recorded tokens learn better")
    assert "data:image/png;base64," in shown["a_heldout_solve_rate"].value  # the curves in the UI
    row = next(
        line for line in text.splitlines() if line.startswith("| recorded tokens") and "16 steps" in line
    )
    cells = [c.strip() for c in row.strip().strip("|").split("|")]
    assert cells[3] == "2" and cells[7] == "1"  # compared at round 2, one seed
    se = (4 / 15) ** 0.5 / 4
    low, high = 0.5 - 1.96 * se, 0.5 + 1.96 * se
    assert cells[4:7] == ["0.750", "0.250", f"+0.500 ({low:+.3f} to {high:+.3f})"]
    assert cells[8:] == [f"{2.801585 * se:.3f}", "reproduced"]  # (z.975 + z.80) se
    assert "not run" in next(line for line in text.splitlines() if "reference-model IS" in line)
    for png in ("a_heldout_solve_rate.png", "a_engine_mismatch.png"):
        assert (out.parent / "results" / png).read_bytes()[:4] == b"\x89PNG"


def test_replays_run_after_their_source_and_verdicts_follow_the_interval():
    assert [c.name for c in run_order(["retok1", "tis_ppo"])] == ["tis_ppo", "sc1", "retok1"]
    d = seed_difference([0.03, 0.05, 0.04])
    assert d.low > 0 and verdict("better", d) == "reproduced"
    assert verdict("better", Difference(-0.04, -0.06, -0.02, 3)) == "not reproduced"
    assert verdict("better", Difference(0.01, -0.01, 0.03, 3)) == "inconclusive"
    assert verdict("better", Difference(0.0, 0.0, 0.0, 3)) == "not reproduced"  # identical in every seed
    assert verdict("no_worse", Difference(-0.005, -0.015, 0.005, 3), margin=0.02) == "reproduced"
    assert verdict("no_worse", Difference(-0.005, -0.015, 0.005, 3), margin=0.01) == "inconclusive"
    assert verdict("no_worse", Difference(-0.03, -0.04, -0.02, 3), margin=0.01) == "not reproduced"
    # less variance: a one-sided F-test; 2 vs 2 degrees of freedom: P(F >= f) = 1 / (1 + f)
    assert f_sf(3.0, 2, 2) == pytest.approx(0.25) and f_sf(6.388, 4, 4) == pytest.approx(0.05, abs=1e-4)
    assert verdict("less_variance", p=variance_p(0.0069, 0.0104, 3)) == "inconclusive"  # p = 0.31
    assert verdict("less_variance", p=variance_p(0.001, 0.01, 3)) == "reproduced"  # p = 0.0099
    assert verdict("less_variance", p=variance_p(0.01, 0.001, 3)) == "not reproduced"
    assert seed_difference([0.02], single_seed_se=0.005).low == 0.02 - 1.96 * 0.005
    # Student's t with 2 degrees of freedom (4.302653), not a normal quantile
    assert seed_difference([0.0, 0.03, 0.06]).high == pytest.approx(0.03 + 4.302653 * 0.03 / 3**0.5)
    assert t975(30) == pytest.approx(2.0423, abs=1e-4) and t975(9) == pytest.approx(2.2622, abs=1e-4)


def test_each_finding_states_the_difference_its_seeds_could_detect():
    """MDE at 80% power against textbook quantiles: t.975(2) = 4.3027, t.80(2) = 1.0607,
    F.95(2, 2) = 19, F.80(2, 2) = 4; and the finding built from known per-seed results."""
    assert t_quantile(0.8, 2) == pytest.approx(1.0607, abs=1e-4)
    assert f_quantile(0.95, 2, 2) == pytest.approx(19.0) and f_quantile(0.8, 2, 2) == pytest.approx(4.0)
    assert mde("better", 3, sd=0.01) == pytest.approx((4.3027 + 1.0607) * 0.01 / 3**0.5, abs=1e-5)
    assert mde("less_variance", 3) == pytest.approx(76**0.5) and mde("less_variance", 2) == math.inf
    solved = {f"p{i}": i < 50 for i in range(100)}
    pairs = [  # A solves 3, 4, 5 more puzzles than B in seeds 0, 1, 2: differences 0.03, 0.04, 0.05
        paired_difference(solved | {f"p{i}": True for i in range(50, 50 + extra)}, solved)
        for extra in (3, 4, 5)
    ]
    cmp = next(c for c in COMPARISONS if c.kind == "better")
    got = finding(cmp, 20, pairs)
    assert got["verdict"] == "reproduced" and got["mde"] == f"{(4.3027 + 1.0607) * 0.01 / 3**0.5:.3f}"
    close = [
        paired_difference(solved | {"p50": True}, solved),
        paired_difference(solved, solved | {"p50": True}),
    ]
    got = finding(cmp, 20, close + [paired_difference(solved, solved)])  # +0.01, -0.01, 0: sd 0.01
    assert got["verdict"] == "inconclusive (MDE 0.031)" and got["A − B (95% CI)"].startswith("+0.000")
    spread = next(c for c in COMPARISONS if c.kind == "less_variance")
    assert finding(spread, 20, pairs)["mde"] == "sd ratio 8.7x"
