"""Locks between processes: a round held by one run is refused to another with its holder named, and
released when the holder dies, which its record then shows; a folder replaced whole is never seen
half swapped by a load."""

import os
import socket
import subprocess
import sys
import threading

import pytest

from prodrl_pipeline.folders import replacing
from prodrl_pipeline.locks import Busy, folder_lock, holder, holding
from prodrl_pipeline.rl.checkpoint import load_checkpoint, save_checkpoint
from tests.conftest import build_tiny

HOLD = """
import sys
from pathlib import Path
from prodrl_pipeline.locks import holding
with holding(Path(sys.argv[1]), "run child", "step checkpoint"):
    print("held", flush=True)
    sys.stdin.read()  # holds until the parent closes stdin or kills it
"""


def test_a_held_lock_is_refused_naming_its_holder_and_released_when_the_holder_is_killed(tmp_path):
    lock = tmp_path / "locks" / "r000001.lock"
    child = subprocess.Popen(
        [sys.executable, "-c", HOLD, str(lock)], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
    )
    here = socket.gethostname()
    try:
        assert child.stdout.readline().strip() == "held"
        busy = rf"^run child \(step checkpoint, pid {child.pid} on {here}, since [0-9-]+ [0-9:]+ UTC\)$"
        with pytest.raises(Busy, match=busy), holding(lock, "run parent", "step advantages"):
            pass
        assert holder(lock).gone() is False
        child.kill()  # SIGKILL: no clean-up runs in the holder
        os.waitid(os.P_PID, child.pid, os.WEXITED | os.WNOWAIT)  # it has ended, not yet reaped
        assert holder(lock).gone() is True  # a zombie has ended
        child.wait()
        killed = holder(lock)
        assert (killed.owner, killed.pid, killed.released) == ("run child", child.pid, False)  # never let go
        assert killed.gone()
        assert killed._replace(host="another-machine").gone() is None  # only its own host can tell
        with holding(lock, "run parent", "step advantages"):
            assert holder(lock)[:4] == ("run parent", "step advantages", os.getpid(), here)
        assert holder(lock).released and holder(lock).owner == "run parent"  # the last holder stays named
    finally:
        child.kill()
        child.wait()


def test_a_second_hold_in_the_same_process_is_refused_too(tmp_path):
    lock = tmp_path / "r.lock"
    refused = pytest.raises(Busy, match=r"^first \(a, pid ")
    with holding(lock, "first", "a"), refused, holding(lock, "second", "b"):
        pass
    with holding(lock, "third", "c"):  # released by the first on exit
        pass
    assert holder(tmp_path / "never.lock") is None


def test_a_swap_waits_for_a_load_holding_the_folder_shared(tmp_path):
    target = tmp_path / "ckpt"
    target.mkdir()
    (target / "weights").write_text("old")
    swapped = threading.Event()

    def rewrite() -> None:
        with replacing(target) as tmp:
            (tmp / "weights").write_text("new")
        swapped.set()

    with folder_lock(target, shared=True):
        writer = threading.Thread(target=rewrite)
        writer.start()
        writer.join(timeout=1.0)  # it could finish in well under a second if it did not wait
        assert writer.is_alive() and not swapped.is_set()
        assert (target / "weights").read_text() == "old"
    writer.join(timeout=30)
    assert swapped.is_set() and (target / "weights").read_text() == "new"


def test_loads_never_fail_while_the_checkpoint_is_rewritten_again_and_again(tmp_path, tokenizer):
    """A replay re-materializing a round swaps its checkpoint while a later round loads it as its
    parent: without the folder lock a load lands between the two renames (no folder) or reads
    files of two writes."""
    model, path = build_tiny(tokenizer), tmp_path / "checkpoints" / "r000001"
    save_checkpoint(path, model, None, {"write": 0})
    errors: list[BaseException] = []
    stop = threading.Event()

    def rewrite() -> None:
        n = 0
        while not stop.is_set():
            n += 1
            save_checkpoint(path, model, None, {"write": n})

    writer = threading.Thread(target=rewrite)
    writer.start()
    try:
        for _ in range(40):
            try:
                load_checkpoint(path)
            except Exception as e:  # noqa: BLE001 (any failure is the finding)
                errors.append(e)
    finally:
        stop.set()
        writer.join()
    assert not errors, errors[:3]
    assert sorted(p.name for p in path.parent.iterdir()) == [".r000001.lock", "r000001"]  # nothing left
