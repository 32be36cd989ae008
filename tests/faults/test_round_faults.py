"""A round under SIGKILL: a child process runs round 1 and is killed at a random moment of it,
then the round is run again to completion; afterwards no table holds a duplicate or a partial
row, every registered checkpoint and export loads, the live pointer names the base or round 1's
deployment (which loads), and the round's calls, checkpoint and export are bit-identical to an
uninterrupted run's. One kill lands inside each of the round's five steps, at a random moment of
its duration. Prints, per stage the kill landed in (the step the killed run had started and not
finished, from its event log), kills, completed re-runs, calls lost and duplicate rows."""

from __future__ import annotations

import json
import os
import random
import shutil
import signal
import subprocess
import sys
import threading
import time
from collections import Counter, defaultdict
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from dagster import DagsterInstance, ExecuteInProcessResult, materialize

from assets.base_model import base_model
from assets.partitions import round_key
from prodrl_pipeline.quant.nvfp4 import load_deployment
from prodrl_pipeline.records.registry import live_deployment, round_id
from prodrl_pipeline.records.store import DeltaStore
from prodrl_pipeline.rl.checkpoint import META_FILE, load_checkpoint
from tests.faults.round_child import CHILD_LAB
from tests.test_pipeline import ASSETS, ROUND, _resources

REPO = Path(__file__).resolve().parents[2]
STAGES = ("trajectories", "advantages", "checkpoint", "deployment", "eval_report")
"""One kill inside each, at a random moment of the step's uninterrupted duration."""
COMMITS = {
    "calls": "trajectories",
    "rejects": "trajectories",
    "trajectories": "trajectories",
    "advantages": "advantages",
    "policy_logprobs": "checkpoint",
    "checkpoints": "checkpoint",
    "train_steps": "checkpoint",
    "deployments": "deployment",
    "eval_results": "deployment",
    "live": "deployment",
}
"""Every commit of a round, in the order a round makes them, and the step it lands in: a chain of
runs each SIGKILLed right after the next one (tests/faults/round_child.py), each re-running the
round after the previous kill. A re-run that skips a commit (what it marks is stored) never dies."""
KEYS = {  # what makes a row unique in each table the round writes
    "calls": ("call_id",),
    "trajectories": ("trajectory_id",),
    "advantages": ("round", "trajectory_id"),
    "train_steps": ("experiment", "round", "step"),
    "policy_logprobs": ("experiment", "round", "call_id"),
    "checkpoints": ("checkpoint_id",),
    "deployments": ("deployment_id",),
    "eval_results": ("round", "deployment_id", "puzzle_id"),
    "rejects": ("table_name", "round", "record_id"),
}


@contextmanager
def _instance(home: Path) -> Iterator[DagsterInstance]:
    """The instance in `home` (DAGSTER_HOME set while it is open, restored afterwards)."""
    before = os.environ.get("DAGSTER_HOME")
    os.environ["DAGSTER_HOME"] = str(home)
    try:
        with DagsterInstance.get() as instance:
            yield instance
    finally:
        if before is None:
            os.environ.pop("DAGSTER_HOME", None)
        else:
            os.environ["DAGSTER_HOME"] = before


def _stop(child: subprocess.Popen) -> None:
    if child.poll() is None:
        os.killpg(child.pid, signal.SIGKILL)
    child.wait()


def _child(
    root: Path, home: Path, logs: int = subprocess.DEVNULL, kill_after: str = "", rounds: tuple[int, ...] = ()
) -> subprocess.Popen:
    """tests/faults/round_child.py on `root` and the instance in `home`: round 1, round K (`rounds`
    = (K,)) or a replay of rounds FIRST..LAST (`rounds` = (FIRST, LAST))."""
    env = {**os.environ, "DAGSTER_HOME": str(home), "PYTHONPATH": str(REPO), "KILL_AFTER": kill_after}
    command = [sys.executable, "-m", "tests.faults.round_child", str(root), *map(str, rounds)]
    return subprocess.Popen(
        command, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=logs, text=True, start_new_session=True
    )


def _kill_during(root: Path, home: Path, step: str, delay: float) -> int:
    """Start the round, SIGKILL it `delay` seconds after Dagster logs the start of `step`;
    returns the child's exit status."""
    child = _child(root, home, logs=subprocess.PIPE)
    started, marker = threading.Event(), f'Started execution of step "{step}"'

    def follow() -> None:  # reads the child's log as it comes (a full pipe would stall it)
        for line in child.stderr:
            if marker in line:
                started.set()

    threading.Thread(target=follow, daemon=True).start()
    try:
        assert started.wait(timeout=300), f"{step} never started"
        time.sleep(delay)  # the fault's moment inside the step, not a synchronisation
    finally:
        _stop(child)
    return child.returncode


def _kill_after_a_resumable_save(root: Path, home: Path) -> bool:
    """Start the round, SIGKILL it as soon as the trainer's resumable state appears; returns
    whether the state was still there (the kill landed inside training, after a save)."""
    state = root / "partial" / "main" / "r000001" / "resume.json"
    child = _child(root, home)
    deadline = time.monotonic() + 300
    try:
        while not state.exists():  # watching for the file the fault is aimed at
            assert child.poll() is None and time.monotonic() < deadline, "the round never saved a state"
            time.sleep(0.005)
    finally:
        _stop(child)
    return state.exists()


def _step_seconds(home: Path) -> dict[str, float]:
    """How long each step of the newest run took, from its event log."""
    with _instance(home) as instance:
        run = instance.get_runs(limit=1)[0]
        start, seconds = {}, {}
        for event in instance.all_logs(run.run_id):
            if event.dagster_event is None:
                continue
            kind, step = event.dagster_event.event_type_value, event.dagster_event.step_key
            if kind == "STEP_START":
                start[step] = event.timestamp
            elif kind == "STEP_SUCCESS":
                seconds[step] = event.timestamp - start[step]
    return seconds


def _round(instance: DagsterInstance, root: Path, k: int = 1) -> ExecuteInProcessResult:
    """Round `k` of the child's lab, in this process (a re-run needs no fresh interpreter: all it
    must find is on disk and in the instance); its failures returned, not raised."""
    instance.add_dynamic_partitions("rounds", [round_key(k)])
    return materialize(
        ASSETS,
        selection=ROUND,
        partition_key=round_key(k),
        instance=instance,
        resources=_resources(root, **CHILD_LAB),
        raise_on_error=False,
    )


def _run_to_end(root: Path, home: Path) -> float:
    """Round 1, uninterrupted; returns its seconds."""
    with _instance(home) as instance:
        t0 = time.monotonic()
        assert _round(instance, root).success, "the round failed"
        return time.monotonic() - t0


def _killed_in(home: Path) -> str:
    """The step the newest run was in when it died (the last started, unfinished one)."""
    with _instance(home) as instance:
        run = instance.get_runs(limit=1)[0]
        started, finished = [], set()
        for event in instance.all_logs(run.run_id):
            if event.dagster_event is None:
                continue
            kind, step = event.dagster_event.event_type_value, event.dagster_event.step_key
            if kind == "STEP_START":
                started.append(step)
            elif kind in ("STEP_SUCCESS", "STEP_FAILURE"):
                finished.add(step)
    running = [s for s in started if s not in finished]
    return running[-1] if running else ("before the first step" if not started else "between steps")


def _base(root: Path, home: Path) -> None:
    home.mkdir(parents=True, exist_ok=True)
    with _instance(home) as instance:
        assert materialize([base_model], instance=instance, resources=_resources(root, **CHILD_LAB)).success


def _left_behind(tables: DeltaStore, last: int) -> int:
    """What any kill may leave: checks that every registered checkpoint and export loads and that
    live names round `last` or the one before (and loads); returns the duplicate rows."""
    duplicated = 0
    for name, key in KEYS.items():
        counts = Counter(tuple(r[k] for k in key) for r in tables.read(name).to_pylist())
        duplicated += sum(n - 1 for n in counts.values())
    for row in tables.read("checkpoints").to_pylist():
        load_checkpoint(row["path"])  # a registered checkpoint is complete
    for row in tables.read("deployments").to_pylist():
        load_deployment(row["path"])
    assert live_deployment(tables)["deployment_id"] in (round_id("main", last - 1), round_id("main", last))
    return duplicated


def _invariants(root: Path, reference: Path, rounds: tuple[int, ...] = (1,)) -> dict[str, int]:
    """Checks what must hold after the re-run of the last of `rounds`, which all ran in `reference`
    uninterrupted; returns the calls lost and the duplicate rows."""
    tables, ref = DeltaStore(root / "tables"), DeltaStore(reference / "tables")
    duplicated = _left_behind(tables, rounds[-1])
    assert not list(root.rglob("*.tmp-*.lock")), "a lock file of a temporary folder was left behind"
    served = lambda store: {  # noqa: E731 (every column but the wall-clock time it was made)
        c["call_id"]: {k: v for k, v in c.items() if k != "created_at"}
        for k in rounds
        for c in store.read("calls", k).to_pylist()
    }
    ours, theirs = served(tables), served(ref)
    assert {k: v for k, v in ours.items() if k in theirs} == {k: theirs[k] for k in ours if k in theirs}
    for kind, k in ((kind, k) for kind in ("checkpoints", "deployments") for k in rounds):
        row = next(r for r in tables.read(kind).to_pylist() if r["round"] == k)
        ref_row = next(r for r in ref.read(kind).to_pylist() if r["round"] == k)
        weights = (Path(row["path"]) / "model.safetensors").read_bytes()
        assert weights == (Path(ref_row["path"]) / "model.safetensors").read_bytes(), f"{kind} of {k} differ"
    return {"lost": len(set(theirs) - set(ours)), "duplicated": duplicated}


def test_a_round_killed_inside_each_stage_and_re_run_loses_and_doubles_nothing(tmp_path):
    reference, ref_home = tmp_path / "reference", tmp_path / "reference-home"
    _base(reference, ref_home)
    template, home_template = tmp_path / "template", tmp_path / "template-home"
    shutil.copytree(reference, template)  # the base model, built once
    shutil.copytree(ref_home, home_template)
    round_seconds = _run_to_end(reference, ref_home)
    seconds = _step_seconds(ref_home)
    rng = random.Random(0)
    table: dict[str, Counter] = defaultdict(Counter)
    for cycle, step in enumerate(STAGES):
        root, home = tmp_path / f"root{cycle}", tmp_path / f"home{cycle}"
        shutil.copytree(template, root)
        shutil.copytree(home_template, home)
        status = _kill_during(root, home, step, rng.uniform(0, seconds[step]))
        stage = _killed_in(home) if status == -signal.SIGKILL else "after the end"
        table[stage]["kills"] += 1
        _run_to_end(root, home)
        table[stage]["re-runs completed"] += 1
        table[stage].update(_invariants(root, reference))
    root, home = tmp_path / "root-commits", tmp_path / "home-commits"  # aimed: after each commit
    shutil.copytree(template, root)
    shutil.copytree(home_template, home)
    for commit, step in COMMITS.items():
        child = _child(root, home, kill_after=commit)
        assert child.wait(timeout=600) == -signal.SIGKILL, f"the re-run never made the {commit} commit"
        assert _killed_in(home) == step
        stage = f"{step}, right after the {commit} commit"
        table[stage]["kills"] += 1
        table[stage]["duplicated"] += _left_behind(DeltaStore(root / "tables"), 1)
        table[stage]["re-runs completed"] += 1  # the next run of the chain re-runs the round
    _run_to_end(root, home)
    lost = _invariants(root, reference)
    assert lost == {"lost": 0, "duplicated": 0}
    assert live_deployment(DeltaStore(root / "tables"))["deployment_id"] == "main-r000001"
    root, home = tmp_path / "root-resume", tmp_path / "home-resume"  # aimed: training after a save
    shutil.copytree(template, root)
    shutil.copytree(home_template, home)
    resumable = _kill_after_a_resumable_save(root, home)
    stage = "checkpoint, after a resumable save" if resumable else "checkpoint, after its state was cleared"
    table[stage]["kills"] += 1
    _run_to_end(root, home)
    table[stage]["re-runs completed"] += 1
    table[stage].update(_invariants(root, reference))
    ckpt = next(r for r in DeltaStore(root / "tables").read("checkpoints").to_pylist() if r["round"] == 1)
    resumed = json.loads((Path(ckpt["path"]) / META_FILE).read_text()).get("resumed_after_steps")
    assert resumed is not None or not resumable, "the re-run trained from the start instead of resuming"
    print(f"\nround: {round_seconds:.1f} s uninterrupted; the aimed kill resumed after {resumed} steps")
    print(f"{'killed in':52} kills  re-runs  calls lost  duplicate rows")
    for stage, n in sorted(table.items()):
        print(f"{stage:52} {n['kills']:5}  {n['re-runs completed']:7}  {n['lost']:10}  {n['duplicated']:14}")
    assert sum(n["kills"] for n in table.values()) == len(STAGES) + len(COMMITS) + 1
    assert sum(n["re-runs completed"] for n in table.values()) == len(STAGES) + len(COMMITS) + 1
    assert all(n["lost"] == n["duplicated"] == 0 for n in table.values())
