"""Run folders behind a URL (`--run-dir s3://bucket/prefix`): where each part of the run lives.

The checkpoints go to the URL, `RUN/checkpoint/step-N`, written and read by torch DCP's fsspec
storage and torchtitan's fsspec support (`torchtitan.tools.filesystem`); everything else the ranks
write (logs, reports, the MLflow spool) stays in a local folder named for the URL
(`local_folder`), so one host's tools read it as usual. `RemotePath` gives the launcher's
checkpoint checks (`launcher.resume`) the few `Path` methods they use, over fsspec.

Credentials come from the standard AWS chain (environment, profile, instance role) through s3fs
and botocore, which also honour `$AWS_ENDPOINT_URL` (and `$AWS_ENDPOINT_URL_S3`).
"""

from __future__ import annotations

import os
import re
from collections.abc import Iterator
from pathlib import Path
from typing import IO, Any, NamedTuple

from qwentitan.launch.base.errors import LaunchError

__all__ = ["RemotePath", "is_remote", "local_folder", "require_backend"]


def is_remote(path: str | os.PathLike[str] | RemotePath) -> bool:
    """A URL rather than a local path: torch DCP's and torchtitan's own test (`://`)."""
    return "://" in str(path)


def local_folder(url: str, base: str | Path = "outputs") -> Path:
    """The local folder of a remote run: `outputs/s3/bucket/prefix` (absolute)."""
    scheme, rest = url.split("://", 1)
    parts = [re.sub(r"[^\w.-]", "_", part) for part in rest.strip("/").split("/") if part]
    return Path(base, scheme, *parts).resolve()


def require_backend(url: str) -> None:
    """Refuse in one sentence a URL whose fsspec backend (s3fs for s3://) is not installed."""
    from fsspec.registry import known_implementations

    scheme = url.split("://", 1)[0]
    try:
        import fsspec

        fsspec.get_filesystem_class(scheme)
    except (ImportError, ValueError):
        needs = known_implementations.get(scheme, {}).get("class", scheme).split(".")[0]
        extra = " (install qwentitan-launch[s3])" if scheme in ("s3", "s3a") else ""
        raise LaunchError(
            f"A {scheme}:// {{run_dir}} needs the Python package {needs}{extra}; install it, or "
            "pass a local {run_dir}.",
            field="run_dir",
        ) from None


class RemoteStat(NamedTuple):
    """What `Path.stat()` gives that the launcher reads of an object on S3."""

    st_size: int


class RemotePath:
    """A file or folder at a URL, with the `Path` methods the checkpoint checks use."""

    def __init__(self, url: str, fs: Any = None) -> None:
        self.url = url.rstrip("/")
        if fs is None:
            from fsspec.core import url_to_fs

            fs, _ = url_to_fs(self.url)
        self.fs = fs

    def __str__(self) -> str:
        return self.url

    def __repr__(self) -> str:
        return f"RemotePath({self.url!r})"

    def __eq__(self, other: object) -> bool:
        return isinstance(other, RemotePath) and other.url == self.url

    def __hash__(self) -> int:
        return hash(self.url)

    def __truediv__(self, name: str) -> RemotePath:
        return RemotePath(f"{self.url}/{name}", self.fs)

    @property
    def name(self) -> str:
        return self.url.rsplit("/", 1)[-1]

    @property
    def parent(self) -> RemotePath:
        return RemotePath(self.url.rsplit("/", 1)[0], self.fs)

    def is_dir(self) -> bool:
        return self.fs.isdir(self.url)

    def is_file(self) -> bool:
        return self.fs.isfile(self.url)

    def exists(self) -> bool:
        return self.fs.exists(self.url)

    def iterdir(self) -> Iterator[RemotePath]:
        for entry in self.fs.ls(self.url, detail=False):
            name = entry.rstrip("/").rsplit("/", 1)[-1]
            if entry.rstrip("/") != self.fs._strip_protocol(self.url):  # an S3 folder marker
                yield self / name

    def stat(self) -> RemoteStat:
        return RemoteStat(st_size=int(self.fs.size(self.url)))

    def open(self, mode: str = "rb") -> IO[bytes]:
        return self.fs.open(self.url, mode)
