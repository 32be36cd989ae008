"""Advisory locks between processes on one machine (POSIX `flock` on a small lock file). The kernel
drops a lock when its holder dies, so a killed run never leaves one behind.

- `holding(path, owner, task)`: exclusive and not waiting. The lock file records its `Holder` (owner,
  task, pid, host, since); a second taker gets `Busy`, which names it. On release the record stays,
  marked released, so `holder(path)` tells who holds a lock, or who held it last, and
  `Holder.gone()` whether that process has ended (a holder killed while holding never marks it).
- `folder_lock(folder, shared)`: a readers-writer lock for a folder that is replaced whole. Loads
  hold it shared; the swap in `folders.replacing` holds it exclusively. Each waits for the other, so
  a load never sees a folder half swapped.
"""

from __future__ import annotations

import errno
import fcntl
import json
import os
import socket
from collections.abc import Iterator
from contextlib import contextmanager
from datetime import UTC, datetime
from pathlib import Path
from typing import IO, NamedTuple

PRIVATE = ".tmp-"
"""Name prefix of a folder being written, before it is renamed into place."""


class Busy(RuntimeError):
    """The lock is held by someone else; the message is the holder's description."""


class Holder(NamedTuple):
    """A lock file's record of the process that holds it, or held it last (`released`)."""

    owner: str
    """Who, e.g. `run <run id>`."""
    task: str
    """What it does under the lock, e.g. `step checkpoint`."""
    pid: int
    host: str
    since: str
    """When it took the lock (UTC)."""
    released: bool = False

    def __str__(self) -> str:
        return f"{self.owner} ({self.task}, pid {self.pid} on {self.host}, since {self.since} UTC)"

    def gone(self) -> bool | None:
        """Whether its process has ended (a zombie has); None on another host, which cannot tell."""
        if self.host != socket.gethostname():
            return None
        try:
            os.kill(self.pid, 0)
        except ProcessLookupError:
            return True
        except PermissionError:  # another user's process
            return False
        try:
            return Path(f"/proc/{self.pid}/stat").read_text().rsplit(")", 1)[1].split()[0] == "Z"
        except (OSError, IndexError):  # no /proc here, or it ended since
            return False


def holder(path: Path) -> Holder | None:
    """The record in the lock file `path`; None where there is none (never taken, or unreadable)."""
    try:
        return Holder(**json.loads(path.read_text()))
    except (OSError, ValueError, TypeError):
        return None


def _open(path: Path) -> IO[str] | None:
    """The lock file, created if it can be; None where its folder is missing or the storage is
    read-only and it does not exist (nothing there can be swapped either). Other errors raise."""
    try:
        return path.open("a+")
    except OSError as e:
        if e.errno not in (errno.EROFS, errno.ENOENT):
            raise
    try:
        return path.open()
    except FileNotFoundError:
        return None


@contextmanager
def holding(path: Path, owner: str, task: str) -> Iterator[None]:
    """Hold `path` exclusively for the block, or raise `Busy(description of the holder)` at once."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("a+") as f:
        try:
            fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            held = holder(path)
            raise Busy(
                str(held) if held and not held.released else "another process (it has not said which yet)"
            ) from None
        me = Holder(owner, task, os.getpid(), socket.gethostname(), f"{datetime.now(UTC):%Y-%m-%d %H:%M:%S}")
        _record(f, me)
        try:
            yield
        finally:
            _record(f, me._replace(released=True))  # still held: a taker that reads now finds it released


def _record(f: IO[str], record: Holder) -> None:
    f.truncate(0)
    f.write(json.dumps(record._asdict()))
    f.flush()


@contextmanager
def folder_lock(folder: Path, shared: bool) -> Iterator[None]:
    """Hold the readers-writer lock of `folder` (the file `.<name>.lock` beside it), waiting for it.
    A folder being written (`PRIVATE`: the temporary sibling of `folders.replacing`) belongs to its
    writer alone, and is read without one."""
    f = None if folder.name.startswith(PRIVATE) else _open(folder.parent / f".{folder.name}.lock")
    if f is None:
        yield
        return
    with f:
        fcntl.flock(f, fcntl.LOCK_SH if shared else fcntl.LOCK_EX)
        yield
