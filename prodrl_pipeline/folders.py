"""Replacing a folder whole: written in a temporary sibling, then renamed into place."""

from __future__ import annotations

import shutil
import tempfile
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path


@contextmanager
def replacing(target: Path) -> Iterator[Path]:
    """A temporary sibling of `target` to write into. On a clean exit it replaces `target` by two
    renames (a kill leaves the old folder, the new one, or, between the renames, the old one under
    `.old-<name>-*`); on an error it is removed and `target` is untouched."""
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".tmp-{target.name}-", dir=target.parent))
    try:
        yield tmp
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    old = target.parent / f".old-{target.name}-{uuid.uuid4().hex[:8]}"
    if target.exists():
        target.rename(old)
    tmp.rename(target)
    shutil.rmtree(old, ignore_errors=True)
