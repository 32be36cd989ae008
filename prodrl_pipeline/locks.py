"""Advisory locks between processes on one machine (POSIX `flock` on a small lock file). The kernel
drops a lock when its holder dies, so a killed run never leaves one behind.

- `holding(path, holder)`: exclusive and not waiting. A second taker gets `Busy`, which names the
  holder (the holder's description is written into the lock file while it holds it).
- `folder_lock(folder, shared)`: a readers-writer lock for a folder that is replaced whole. Loads
  hold it shared; the swap in `folders.replacing` holds it exclusively. Each waits for the other, so
  a load never sees a folder half swapped.
"""

from __future__ import annotations

import errno
import fcntl
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import IO

PRIVATE = ".tmp-"
"""Name prefix of a folder being written, before it is renamed into place."""


class Busy(RuntimeError):
    """The lock is held by someone else; the message is the holder's description."""


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
def holding(path: Path, holder: str) -> Iterator[None]:
    """Hold `path` exclusively for the block, or raise `Busy(description of the holder)` at once."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("a+") as f:
        try:
            fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            f.seek(0)
            raise Busy(f.read().strip() or "another process (it has not said which yet)") from None
        f.truncate(0)
        f.write(holder)
        f.flush()
        try:
            yield
        finally:
            f.truncate(0)  # still held: a taker that reads now finds no stale holder


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
