"""Checkpoint and deployment folders under one root: a local folder or an object store (s3://).

A folder is written whole into a local staging folder and uploaded before the caller registers
it, so no registry row names a folder that was never complete. Readers get a local copy: a local
URI is its own copy; an s3:// folder is downloaded once into the cache, keyed by its URI and the
upload id written with it (a re-run that rewrites the folder gets a fresh copy).
S3 credentials and endpoint come from the same storage options the Delta tables use
(AWS_ACCESS_KEY_ID, AWS_SECRET_ACCESS_KEY, AWS_SESSION_TOKEN, AWS_REGION, AWS_ENDPOINT_URL).
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

from pyarrow import fs

S3 = "s3://"
COMPLETE = ".complete"  # marks a finished download in the cache
UPLOAD_ID = ".upload-id"  # written with every upload: which version of the folder this is


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
        scheme, _, host = endpoint.partition("://")
        kwargs |= {"scheme": scheme, "endpoint_override": host.rstrip("/")}
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
    def writing(self, uri: str) -> Iterator[Path]:
        """A local folder to write `uri` into; on a clean exit an s3:// folder's previous files are
        removed and the new ones uploaded. A local URI is written in place."""
        if not is_remote(uri):
            Path(uri).mkdir(parents=True, exist_ok=True)
            yield Path(uri)
            return
        with tempfile.TemporaryDirectory(prefix="prodrl-upload-") as staging:
            yield Path(staging)
            (Path(staging) / UPLOAD_ID).write_text(uuid.uuid4().hex)
            target = uri.removeprefix(S3)
            s3 = self._client()
            s3.delete_dir_contents(target, missing_dir_ok=True)
            fs.copy_files(staging, target, source_filesystem=fs.LocalFileSystem(), destination_filesystem=s3)

    def local(self, uri: str) -> Path:
        """A local folder holding `uri`'s files (downloaded into the cache once per version)."""
        if not is_remote(uri):
            return Path(uri)
        s3, source = self._client(), uri.removeprefix(S3)
        infos = s3.get_file_info(fs.FileSelector(source, recursive=True, allow_not_found=True))
        files = sorted((i.path, i.size, str(i.mtime)) for i in infos if i.type == fs.FileType.File)
        if not files:
            raise FileNotFoundError(f"{uri}: no such folder (or it is empty)")
        marker = f"{source.rstrip('/')}/{UPLOAD_ID}"
        if any(f[0] == marker for f in files):
            with s3.open_input_stream(marker) as f:
                files = [(marker, f.read().decode())]
        key = hashlib.sha256(repr((uri, files)).encode()).hexdigest()[:24]
        folder = self.cache / key
        if (folder / COMPLETE).exists():
            return folder
        self.cache.mkdir(parents=True, exist_ok=True)
        staging = Path(tempfile.mkdtemp(prefix=f"{key}.", dir=self.cache))
        try:
            fs.copy_files(
                source, str(staging), source_filesystem=s3, destination_filesystem=fs.LocalFileSystem()
            )
            (staging / COMPLETE).touch()
            staging.rename(folder)
        except OSError:
            if not (folder / COMPLETE).exists():  # not a concurrent reader's finished copy
                raise
        finally:
            shutil.rmtree(staging, ignore_errors=True)
        return folder

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
