"""Folders of files: replaced whole (written in a temporary sibling, then renamed into place), and
read with errors that name the file and what is wrong with it."""

from __future__ import annotations

import shutil
import tempfile
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from prodrl_pipeline.locks import PRIVATE, folder_lock


@contextmanager
def replacing(target: Path) -> Iterator[Path]:
    """A temporary sibling of `target` to write into. On a clean exit it replaces `target` by two
    renames (a kill leaves the old folder, the new one, or, between the renames, the old one under
    `.old-<name>-*`), made while holding `target`'s folder lock, so a load holding it shared never
    sees the swap half done; on an error it is removed and `target` is untouched."""
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f"{PRIVATE}{target.name}-", dir=target.parent))
    try:
        yield tmp
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    old = target.parent / f".old-{target.name}-{uuid.uuid4().hex[:8]}"
    with folder_lock(target, shared=False):
        if target.exists():
            target.rename(old)
        tmp.rename(target)
    shutil.rmtree(old, ignore_errors=True)


class CorruptFileError(ValueError):
    """A file that is there but does not parse: truncated, or its bytes garbled."""


@contextmanager
def reading(file: Path, what: str) -> Iterator[None]:
    """Re-raise a failure to read or parse `file` (a part of `what`, e.g. "checkpoint /x") as an error
    naming both: FileNotFoundError if it is missing, CorruptFileError for whatever low-level error its
    parser raises on bad bytes (SafetensorError, UnpicklingError, JSONDecodeError, ...). Other OSErrors
    (permissions, I/O) pass as they are: they name the file already."""
    try:
        yield
    except FileNotFoundError as e:
        raise FileNotFoundError(f"{what}: {file.name} is missing") from e
    except OSError:
        raise
    except Exception as e:
        raise CorruptFileError(
            f"{what}: {file.name} is truncated or corrupt ({type(e).__name__}: {e})"
        ) from e
