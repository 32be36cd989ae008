"""What no registry row names, found and removed: the artifact versions under the artifacts root's
`checkpoints/` and `deployments/` (on S3 each upload, `<uri>/<upload id>`: a re-run leaves the older
ones; locally each folder, and the temporary siblings a killed write left) and the entries of the
local download cache.

A version is the shallowest folder below `checkpoints/` or `deployments/` that holds files itself
(folder lock files aside: they stay). A registry row names it when the row's path is that folder,
lies inside it or holds it. A cache entry is named when it is the copy of a row's path (a download in
progress is not)."""

from __future__ import annotations

import contextlib
import shutil
from collections.abc import Iterable
from datetime import UTC, datetime
from pathlib import Path
from typing import NamedTuple

from pyarrow import fs

from prodrl_pipeline.artifacts import MANIFEST, S3, Artifacts, is_remote

KINDS = ("checkpoints", "deployments")
CACHE = "cache"


class Unreferenced(NamedTuple):
    """A version (or cache entry) no registry row names."""

    kind: str
    """`checkpoints`, `deployments` or `cache`."""
    uri: str
    """The version's URI (s3://... or a local path), or the cache entry's path."""
    files: int
    size: int
    """Bytes."""
    modified: datetime
    """Its newest file's modification time (UTC)."""


def unreferenced(artifacts: Artifacts, named: Iterable[str]) -> list[Unreferenced]:
    """Every version and cache entry that none of the paths in `named` (the registry rows') names,
    in kind and URI order."""
    named = list(named)
    keep = [_fs_path(uri) for uri in named]
    filesystem, root = artifacts.filesystem()
    out = []
    for kind in KINDS:
        selector = fs.FileSelector(f"{root}/{kind}", recursive=True, allow_not_found=True)
        files = [f for f in filesystem.get_file_info(selector) if f.type == fs.FileType.File and not _lock(f)]
        for folder, held in sorted(_versions(files).items()):
            if not any(_related(folder, k) for k in keep):
                uri = f"{S3}{folder}" if is_remote(artifacts.root) else folder
                size, newest = sum(f.size for f in held), max(f.mtime for f in held).astimezone(UTC)
                out.append(Unreferenced(kind, uri, len(held), size, newest))
    copies = {artifacts.cache_folder(uri).name for uri in named if is_remote(uri)}
    entries = sorted(artifacts.cache.iterdir()) if artifacts.cache.is_dir() else []
    for entry in (e for e in entries if e.name not in copies):
        stats = [f.stat() for f in (entry.rglob("*") if entry.is_dir() else [entry]) if f.is_file()]
        newest = datetime.fromtimestamp(max([entry.stat().st_mtime] + [s.st_mtime for s in stats]), UTC)
        out.append(Unreferenced(CACHE, str(entry), len(stats), sum(s.st_size for s in stats), newest))
    return out


def remove(artifacts: Artifacts, items: Iterable[Unreferenced]) -> None:
    """Delete each item: an S3 version's manifest first (a reader then finds it incomplete, never
    half deleted), then the rest of it."""
    filesystem, _ = artifacts.filesystem()
    for item in items:
        if item.kind == CACHE:
            if Path(item.uri).is_dir():
                shutil.rmtree(item.uri)
            else:
                Path(item.uri).unlink()
            continue
        folder = _fs_path(item.uri)
        with contextlib.suppress(FileNotFoundError):
            filesystem.delete_file(f"{folder}/{MANIFEST}")
        filesystem.delete_dir(folder)


def _lock(f: fs.FileInfo) -> bool:
    """A folder's lock file (`locks.folder_lock`), which stays."""
    return f.base_name.startswith(".") and f.base_name.endswith(".lock")


def _versions(files: list[fs.FileInfo]) -> dict[str, list[fs.FileInfo]]:
    """The files grouped by their version: the shallowest folder above them that holds files."""
    holding = {f.path.rsplit("/", 1)[0] for f in files}
    out: dict[str, list[fs.FileInfo]] = {}
    for f in files:
        parts = f.path.split("/")[:-1]
        folder = next(p for p in ("/".join(parts[:i]) for i in range(1, len(parts) + 1)) if p in holding)
        out.setdefault(folder, []).append(f)
    return out


def _related(folder: str, path: str) -> bool:
    return folder == path or folder.startswith(f"{path}/") or path.startswith(f"{folder}/")


def _fs_path(uri: str) -> str:
    """`uri` as pyarrow's filesystem names it: `bucket/key` on S3, an absolute path locally."""
    return uri.removeprefix(S3).rstrip("/") if is_remote(uri) else str(Path(uri).absolute())
