"""Checkpoint and deployment folders under one root: a local folder or an object store (s3://).

On S3 every write is a new immutable folder: `writing(uri)` stages the files locally, uploads them
under `<uri>/<upload id>/` and then, last, a manifest of their names and sizes; the caller
registers that versioned URI once the write is over. A folder without its manifest is incomplete
and cannot be read, so no registry row names a partial folder, and a re-run never touches the
folder an earlier row names. Readers get a local copy: a local folder is its own copy; an S3 folder
is downloaded once into the cache (its files checked against the manifest). Locally a folder is
written in a temporary sibling and renamed into place. S3 credentials and endpoint come from the
storage options the Delta tables use (AWS_ACCESS_KEY_ID, AWS_SECRET_ACCESS_KEY, AWS_SESSION_TOKEN,
AWS_REGION, AWS_ENDPOINT_URL).
"""

from __future__ import annotations

import hashlib
import json
import shutil
import tempfile
import uuid
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from pathlib import Path
from typing import NamedTuple

from pyarrow import fs

from prodrl_pipeline.folders import replacing

S3 = "s3://"
COMPLETE = ".complete"  # marks a finished download in the cache
MANIFEST = ".manifest.json"  # uploaded last: the folder's files and sizes


class Upload(NamedTuple):
    folder: Path
    """Where to write the files."""
    uri: str
    """What to register once the write is over (versioned on S3)."""


def is_remote(uri: str) -> bool:
    if "://" in uri and not uri.startswith(S3):
        raise ValueError(f"{uri}: only local folders and s3:// URIs are supported")
    return uri.startswith(S3)


def s3_filesystem(storage_options: Mapping[str, str]) -> fs.S3FileSystem:
    """pyarrow's S3 client configured from deltalake-style storage options."""
    o = {k.upper(): v for k, v in storage_options.items()}
    kwargs = {
        "access_key": o.get("AWS_ACCESS_KEY_ID"),
        "secret_key": o.get("AWS_SECRET_ACCESS_KEY"),
        "session_token": o.get("AWS_SESSION_TOKEN"),
        "region": o.get("AWS_REGION") or o.get("AWS_DEFAULT_REGION"),
    }
    if endpoint := o.get("AWS_ENDPOINT_URL") or o.get("AWS_ENDPOINT"):
        scheme, _, host = endpoint.rpartition("://")
        kwargs |= {"scheme": scheme or "https", "endpoint_override": host.rstrip("/")}
    return fs.S3FileSystem(**{k: v for k, v in kwargs.items() if v})


class Artifacts:
    """Folders under `root` (a local path or s3://bucket/prefix); `cache` holds downloaded copies."""

    def __init__(self, root: str, storage_options: Mapping[str, str] | None = None, cache: str | Path = ""):
        self.root = root.rstrip("/")
        self.storage_options = dict(storage_options or {})
        self.cache = Path(cache or Path(tempfile.gettempdir(), "prodrl-artifacts"))
        self._s3 = s3_filesystem(self.storage_options) if is_remote(self.root) else None

    def uri(self, *parts: str) -> str:
        """The folder `parts` below the root: an absolute local path or an s3:// URI."""
        if self._s3 is None:
            return str(Path(self.root, *parts).absolute())
        return "/".join([self.root, *parts])

    @contextmanager
    def writing(self, uri: str) -> Iterator[Upload]:
        """Where to write the folder `uri`, and what to register after a clean exit: locally `uri`
        itself, written in a temporary sibling that replaces it on exit (a kill leaves the old
        folder or the new one); on S3 `<uri>/<upload id>`, uploaded on exit."""
        if not is_remote(uri):
            with replacing(Path(uri)) as tmp:
                yield Upload(tmp, uri)
            return
        final = f"{uri.rstrip('/')}/{uuid.uuid4().hex}"
        with tempfile.TemporaryDirectory(prefix="prodrl-upload-") as staging:
            yield Upload(Path(staging), final)
            files = {
                str(f.relative_to(staging)): f.stat().st_size
                for f in sorted(Path(staging).rglob("*"))
                if f.is_file()
            }
            s3, target = self._client(), final.removeprefix(S3)
            fs.copy_files(staging, target, source_filesystem=fs.LocalFileSystem(), destination_filesystem=s3)
            with s3.open_output_stream(f"{target}/{MANIFEST}") as out:
                out.write(json.dumps({"files": files}).encode())

    def local(self, uri: str) -> Path:
        """A local folder holding `uri`'s files (an S3 folder downloaded into the cache once)."""
        if not is_remote(uri):
            return Path(uri)
        s3, source = self._client(), uri.removeprefix(S3).rstrip("/")
        try:
            with s3.open_input_stream(f"{source}/{MANIFEST}") as f:
                files = json.loads(f.read())["files"]
        except (FileNotFoundError, OSError) as e:
            raise FileNotFoundError(f"{uri}: no such folder, or its upload never completed") from e
        folder = self.cache_folder(uri)
        if (folder / COMPLETE).exists():
            return folder
        self.cache.mkdir(parents=True, exist_ok=True)
        staging = Path(tempfile.mkdtemp(prefix=f"{folder.name}.", dir=self.cache))
        try:
            for name, size in files.items():
                if Path(name).is_absolute() or ".." in Path(name).parts:
                    raise ValueError(f"{uri}: its manifest names {name!r}, outside the folder")
                (staging / name).parent.mkdir(parents=True, exist_ok=True)
                fs.copy_files(f"{source}/{name}", str(staging / name), source_filesystem=s3,
                              destination_filesystem=fs.LocalFileSystem())  # fmt: skip
                if (staging / name).stat().st_size != size:
                    raise OSError(
                        f"{uri}/{name}: {(staging / name).stat().st_size} bytes, the manifest says {size}"
                    )
            (staging / COMPLETE).touch()
            staging.rename(folder)
        except OSError:
            if not (folder / COMPLETE).exists():  # not a concurrent reader's finished copy
                raise
        finally:
            shutil.rmtree(staging, ignore_errors=True)
        return folder

    def cache_folder(self, uri: str) -> Path:
        """Where `local` keeps its copy of the S3 folder `uri` (downloads in progress are its
        siblings `<name>.<random>`)."""
        return self.cache / hashlib.sha256(uri.encode()).hexdigest()[:24]

    def filesystem(self) -> tuple[fs.FileSystem, str]:
        """pyarrow's filesystem for the root, and the root's path in it (S3: `bucket/prefix`)."""
        if self._s3 is None:
            return fs.LocalFileSystem(), str(Path(self.root).absolute())
        return self._s3, self.root.removeprefix(S3)

    def _client(self) -> fs.S3FileSystem:
        return self._s3 or s3_filesystem(self.storage_options)


STORAGE_OPTIONS_ENV = "PRODRL_STORAGE_OPTIONS"
"""Object-store options (a JSON object) handed to child processes: the environment, not the
command line, where other users of the machine could read the credentials."""


def storage_options_from_environment(env: Mapping[str, str]) -> dict[str, str]:
    raw = env.get(STORAGE_OPTIONS_ENV) or "{}"
    options = json.loads(raw)
    if not isinstance(options, dict) or not all(isinstance(v, str) for v in options.values()):
        raise ValueError(f"{STORAGE_OPTIONS_ENV} must be a JSON object of strings")
    return options
