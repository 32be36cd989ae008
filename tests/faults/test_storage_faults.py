"""Storage faults on a real filesystem: a small tmpfs mounted by the test (root is needed to mount;
`make test` runs as root in CI) filled up, then remounted read-only, under a Delta commit and under
a checkpoint write. Each write fails with an error that names what failed, every table stays
readable at its previous version, the previous checkpoint stays whole, and writing works again once
the fault is gone."""

from __future__ import annotations

import subprocess
from datetime import UTC, datetime
from pathlib import Path

import pytest

from prodrl_pipeline.records.store import DeltaStore, StorageError
from prodrl_pipeline.rl.checkpoint import load_checkpoint, save_checkpoint


@pytest.fixture
def small_disk(tmp_path):
    mount = tmp_path / "disk"
    mount.mkdir()
    done = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=8m", "tmpfs", str(mount)], capture_output=True)
    if done.returncode:
        pytest.skip(f"cannot mount a tmpfs here (needs root): {done.stderr.decode().strip()}")
    yield mount
    subprocess.run(["umount", "-l", str(mount)], check=True)


def _fill(disk: Path) -> Path:
    filler = disk / "filler"
    with filler.open("wb") as f:
        try:
            while True:
                f.write(b"\0" * 65536)
        except OSError:
            pass
    return filler


def _rejects(n: int, tag: str) -> list[dict]:
    now = datetime.now(UTC)
    row = {"table_name": "calls", "round": 1, "reason": tag * 500, "record_json": "{}", "rejected_at": now}
    return [{**row, "record_id": f"{tag}{i}"} for i in range(n)]


def _remount(disk: Path, mode: str) -> None:
    subprocess.run(["mount", "-o", f"remount,{mode}", str(disk)], check=True)


def test_a_full_or_read_only_disk_fails_writes_clearly_and_keeps_what_was_committed(small_disk, tiny_model):
    tables = DeltaStore(small_disk / "tables")
    tables.overwrite_round("rejects", _rejects(10, "a"), 1)
    save_checkpoint(small_disk / "ckpt", tiny_model, None, {"step": 1})
    filler = _fill(small_disk)
    for write in (
        lambda: tables.overwrite_round("rejects", _rejects(400, "b"), 1),
        lambda: save_checkpoint(small_disk / "ckpt", tiny_model, None, {"step": 2}),
    ):
        with pytest.raises(OSError, match="No space left|rejects"):
            write()
    with pytest.raises(StorageError, match="table 'rejects'.*last committed version \\(0\\)"):
        tables.overwrite_round("rejects", _rejects(400, "b"), 1)
    assert tables.table("rejects").version() == 0
    assert sorted(r["record_id"] for r in tables.read("rejects").to_pylist()) == [f"a{i}" for i in range(10)]
    assert load_checkpoint(small_disk / "ckpt")[2]["step"] == 1  # the previous checkpoint, whole
    assert not [p.name for p in small_disk.iterdir() if p.name.startswith(".tmp-")]  # no partial left
    filler.unlink()
    save_checkpoint(small_disk / "bare", tiny_model, None, {"step": 1})
    (small_disk / ".bare.lock").unlink()  # read-only, a load can neither make its lock file
    _remount(small_disk, "ro")
    try:
        with pytest.raises(StorageError, match="Read-only|read-only"):
            tables.overwrite_round("rejects", _rejects(10, "c"), 1)
        with pytest.raises(OSError, match="Read-only|read-only"):
            save_checkpoint(small_disk / "ckpt", tiny_model, None, {"step": 3})
        assert tables.read("rejects").num_rows == 10 and load_checkpoint(small_disk / "ckpt")[2]["step"] == 1
        assert load_checkpoint(small_disk / "bare")[2]["step"] == 1  # nor lock it: nothing can swap it
    finally:
        _remount(small_disk, "rw")
    tables.overwrite_round("rejects", _rejects(10, "d"), 1)  # the fault is gone: writing works again
    save_checkpoint(small_disk / "ckpt", tiny_model, None, {"step": 4})
    assert tables.table("rejects").version() == 1 and load_checkpoint(small_disk / "ckpt")[2]["step"] == 4
