"""Runs at once outside the run queue, on one store: a round another run is writing fails the step at
once with a message naming that run, before anything is written; two runs of one round started
together end with what one uninterrupted run makes (nothing lost or doubled, bit-identical); and a
replay backfill of earlier rounds beside the live round leaves both exactly as if run one after the
other (each load of a checkpoint or an export the replay swaps waits for the swap)."""

from __future__ import annotations

import shutil
from pathlib import Path

from assets.partitions import round_key
from prodrl_pipeline.locks import holder, holding
from prodrl_pipeline.records.registry import live_deployment
from prodrl_pipeline.records.store import DeltaStore
from tests.faults.test_round_faults import _base, _child, _instance, _invariants, _round, _run_to_end

BUSY = "is being written by run"


def _outcomes(home: Path) -> dict[str, list[str]]:
    """Each run in `home`'s instance: its step failures' messages (empty for a run that succeeded)."""
    with _instance(home) as instance:
        return {
            run.run_id: [
                e.dagster_event.step_failure_data.user_failure_data.description
                if e.dagster_event.step_failure_data.user_failure_data
                else e.dagster_event.step_failure_data.error.message
                for e in instance.all_logs(run.run_id)
                if e.dagster_event is not None and e.dagster_event.event_type_value == "STEP_FAILURE"
            ]
            for run in instance.get_runs()
        }


def test_a_round_another_run_is_writing_fails_at_once_naming_it_and_runs_once_it_is_free(tmp_path):
    root, home = tmp_path / "root", tmp_path / "home"
    _base(root, home)
    lock = root / "locks" / "main" / f"{round_key(1)}.lock"
    with _instance(home) as instance:
        with holding(lock, "run 0f1e2d3c", "step checkpoint"):
            held = str(holder(lock))  # run 0f1e2d3c (step checkpoint, pid ... on ..., since ... UTC)
            blocked = _round(instance, root, 1)
        assert not blocked.success
        failures = _outcomes(home)[blocked.run_id]
        assert failures == [
            f"round r000001 of main {BUSY} {held[4:]}. This run stops here; re-run it once "
            "that run has ended (what is stored is kept, a re-run reuses it)"
        ]
        tables = DeltaStore(root / "tables")
        assert tables.read("calls", 1).num_rows == 0 and tables.read("trajectories", 1).num_rows == 0
        assert _round(instance, root, 1).success  # the failed run let nothing stay held
    assert live_deployment(tables)["deployment_id"] in ("base", "main-r000001")


def test_two_runs_of_one_round_started_together_end_as_one_uninterrupted_run(tmp_path):
    reference, ref_home = tmp_path / "reference", tmp_path / "reference-home"
    _base(reference, ref_home)
    root, home = tmp_path / "root", tmp_path / "home"
    shutil.copytree(reference, root)
    shutil.copytree(ref_home, home)
    _run_to_end(reference, ref_home)
    with _instance(home) as instance:  # added once: two runs adding it at once race in the instance
        instance.add_dynamic_partitions("rounds", [round_key(1)])
    logs = [tmp_path / f"run{i}.log" for i in range(2)]
    runs = [_child(root, home, logs=log.open("w")) for log in logs]  # one instance and store, no queue
    for child in runs:
        assert child.stdout.readline().strip() == "ready"
    statuses = sorted(child.wait(timeout=600) for child in runs)
    refused = [failures for failures in _outcomes(home).values() if failures]
    assert statuses[0] == 0, "neither run ran through"
    assert len(refused) == statuses.count(1), [log.read_text()[-3000:] for log in logs]
    assert all(BUSY in message for failures in refused for message in failures)
    if refused:
        _run_to_end(root, home)  # the refused run, re-run: it reuses what the other stored
    assert _invariants(root, reference) == {"lost": 0, "duplicated": 0}
    print(f"\ntwo runs of round 1 at once: {len(refused)} refused with the holder named, then re-run")


def test_a_replay_backfill_beside_the_live_round_leaves_both_as_if_run_one_after_the_other(tmp_path):
    reference, ref_home = tmp_path / "reference", tmp_path / "reference-home"
    _base(reference, ref_home)
    with _instance(ref_home) as instance:
        assert _round(instance, reference, 1).success and _round(instance, reference, 2).success
    root, home = tmp_path / "root", tmp_path / "home"
    shutil.copytree(reference, root)
    shutil.copytree(ref_home, home)
    with _instance(ref_home) as instance:
        assert _round(instance, reference, 3).success  # the uninterrupted order: live round after
    live, replay = _child(root, home, rounds=(3,)), _child(root, home, rounds=(1, 2))
    for child in (live, replay):
        assert child.stdout.readline().strip() == "ready"
    assert (live.wait(timeout=600), replay.wait(timeout=600)) == (0, 0), _outcomes(home)
    assert _invariants(root, reference, rounds=(1, 2, 3)) == {"lost": 0, "duplicated": 0}
    assert live_deployment(DeltaStore(root / "tables"))["deployment_id"] == "main-r000003"
