"""A Delta-reading entry point exits with its own status every time, never by an abort at teardown.

Reading Delta through deltalake's pyarrow dataset (`DeltaTable.to_pyarrow_table`,
`to_pyarrow_dataset`) can kill the interpreter as it exits: a pyarrow I/O thread still calling into
Python while the interpreter finalizes ("terminate called without an active exception", status 134;
a segmentation fault when a scan is left unfinished). The project reads through the store
(`DeltaStore.read`, `DeltaStore.query`) or deltalake's QueryBuilder, and its docs through polars'
own reader (`pl.read_delta`)."""

import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from prodrl_pipeline.records.store import DeltaStore

REPO = Path(__file__).resolve().parent.parent
RUNS = 30
ROUNDS = 40
LISTING = [sys.executable, "-m", "prodrl_pipeline.records"]


@pytest.fixture(scope="module")
def root(tmp_path_factory) -> Path:
    """A store root whose `trajectories` table holds 40 rounds of 50 rows, a file each."""
    root = tmp_path_factory.mktemp("store")
    store = DeltaStore(root / "tables")
    row = {"deployment_id": "d", "task_id": "x", "reward": 1.0, "n_calls": 1}
    for k in range(1, ROUNDS + 1):
        rows = [{**row, "trajectory_id": f"t{k}-{i}", "round": k} for i in range(50)]
        store.overwrite_round("trajectories", rows, k)
    return root


def runs(command: list[str], n: int) -> list[subprocess.CompletedProcess]:
    """`command` run `n` times, two at a time; a run that hangs fails the test after 60 s."""

    def once(_: int) -> subprocess.CompletedProcess:
        return subprocess.run(command, cwd=REPO, capture_output=True, text=True, timeout=60)

    with ThreadPoolExecutor(2) as pool:
        return list(pool.map(once, range(n)))


def test_the_table_listing_exits_cleanly_every_time(root):
    done = runs([*LISTING, "--root", str(root), "trajectories"], RUNS)
    unclean = [d for d in done if d.returncode or "terminate called" in d.stderr]
    assert not unclean, [(d.returncode, d.stderr[-300:]) for d in unclean]  # e.g. [(-6, "terminate ...")]
    assert all(d.stdout.split()[-3:] == ["trajectories", str(ROUNDS - 1), str(50 * ROUNDS)] for d in done)


def test_the_table_listing_exits_1_when_a_named_table_is_absent(root):
    done = subprocess.run([*LISTING, "--root", str(root), "calls"], cwd=REPO, capture_output=True, text=True)
    assert done.returncode == 1 and done.stdout.split()[-2:] == ["calls", "absent"], done
