"""Run folders behind a URL (`--run-dir s3://bucket/prefix`): where each part of the run lives.

The checkpoints go to the URL, `RUN/checkpoint/step-N`, written and read by torch DCP's fsspec
storage and torchtitan's fsspec support (`torchtitan.tools.filesystem`); everything else the ranks
write (logs, reports, the MLflow spool) stays in a local folder named for the URL
(`local_folder`), so one host's tools read it as usual. `RemotePath` gives the launcher's
checkpoint checks (`launcher.resume`) the few `Path` methods they use, over fsspec.

Credentials come from the standard AWS chain (environment, profile, instance role) through s3fs
and botocore, which also honour `$AWS_ENDPOINT_URL` (and `$AWS_ENDPOINT_URL_S3`).

Only `s3://` is a run folder's URL (`canonical_url`): any other scheme fsspec knows (`memory://`,
`file://`, `http://`, `zip://`) would lose or never write the checkpoints. The local folder's
name and the host-wide lock (`lock_file`) are derived from the canonical URL, hashed, so that no
two URLs share either and no `..` leaves `outputs/`.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import re
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import IO, Any, NamedTuple

from qwentitan.launch.base import env_defaults
from qwentitan.launch.base.errors import LaunchError

__all__ = [
    "RemotePath",
    "canonical_url",
    "check_bucket",
    "is_remote",
    "local_folder",
    "lock_file",
    "require_backend",
]

SCHEMES = ("s3",)
_BUCKET = re.compile(r"[a-z0-9][a-z0-9.-]{1,61}[a-z0-9]")
# Where `lock_file` keeps one lock per remote run folder, for every working folder of this host.
LOCK_DIR = "QWENTITAN_LOCK_DIR"


def is_remote(path: str | os.PathLike[str] | RemotePath) -> bool:
    """A URL rather than a local path: torch DCP's and torchtitan's own test (`://`)."""
    return "://" in str(path)


def canonical_url(text: str) -> str:
    """`s3://bucket/prefix` spelled one way (no empty parts, no trailing `/`); LaunchError for
    another scheme, a bucket S3 cannot name, or a `.` / `..` part."""
    scheme, _, rest = text.partition("://")
    if scheme.lower() not in SCHEMES:
        raise LaunchError(
            f"The run folder {text} is refused: a {scheme}:// folder would not keep the "
            "checkpoints; pass {run_dir} as a local path or s3://BUCKET/PREFIX.",
            field="run_dir",
        )
    bucket, *parts = [part for part in rest.split("/") if part] or [""]
    if not _BUCKET.fullmatch(bucket) or any(part in (".", "..") for part in parts):
        raise LaunchError(
            f"The run folder {text} is refused: it needs an S3 bucket name (3 to 63 lower-case "
            "letters, digits, dots and dashes) and a prefix without . or .. parts; pass "
            "{run_dir} as s3://BUCKET/PREFIX.",
            field="run_dir",
        )
    if any(ord(c) < 32 or ord(c) == 127 for c in rest):
        raise LaunchError(
            f"The run folder {text!r} holds a control character; pass another {{run_dir}}.",
            field="run_dir",
        )
    return "/".join([f"{scheme.lower()}://{bucket}", *parts])


def _digest(text: str, size: int) -> str:
    return hashlib.sha256(text.encode()).hexdigest()[:size]


def local_folder(url: str, base: str | Path = "outputs") -> Path:
    """The local folder of a remote run (absolute): `outputs/s3/bucket/prefix-HASH`, readable
    parts of the URL and a hash of it all, so that two URLs never share one (`a b`, `a_b`)."""
    url = canonical_url(url)
    scheme, rest = url.split("://", 1)
    parts = [re.sub(r"[^\w.-]", "_", part) for part in rest.split("/")]
    parts[-1] += f"-{_digest(url, 12)}"
    return Path(base, scheme, *parts).resolve()


def lock_file(url: str) -> Path:
    """The one lock of the remote run folder `url` on this host, whatever the working folder:
    named by a hash of the endpoint and the canonical URL (another endpoint, another bucket)."""
    endpoint = env_defaults.s3_endpoint() or ""
    folder = Path(env_defaults.lock_dir() or Path(tempfile.gettempdir(), "qwentitan-run-locks"))
    if not folder.is_dir():
        folder.mkdir(parents=True, exist_ok=True)
        with contextlib.suppress(OSError):  # every user's runs lock here (sticky, as /tmp)
            folder.chmod(0o1777)
    return folder / f"{_digest(f'{endpoint} {canonical_url(url)}', 32)}.lock"


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


def check_bucket(url: str) -> None:
    """Refuse in one sentence, before any rank, a remote run folder this host cannot use: its
    backend missing, no AWS credentials, an endpoint that does not answer, or a bucket that does
    not exist (the first save would create it: a typo would become a bucket)."""
    from qwentitan.launch.base import s3

    require_backend(url)
    url = canonical_url(url)
    bucket = url.split("://", 1)[1].split("/", 1)[0]
    try:
        RemotePath(url).fs.info(bucket)
    except FileNotFoundError:
        raise LaunchError(
            f"The S3 bucket {bucket} of {url} does not exist; create it first, or pass a "
            "{run_dir} in a bucket that does.",
            field="run_dir",
        ) from None
    except Exception as error:
        said = s3.failure(url, error)
        if said is None:
            first = str(error).splitlines()[0] if str(error) else ""
            said = f"Could not read {url} ({type(error).__name__}: {first:.200}); check it."
        raise LaunchError(said, field="run_dir") from None


class RemoteStat(NamedTuple):
    """What `Path.stat()` gives that the launcher reads of an object on S3."""

    st_size: int


class RemotePath:
    """A file or folder at a URL, with the `Path` methods the checkpoint checks use."""

    def __init__(self, url: str, fs: Any = None) -> None:
        self.url = url.rstrip("/")
        if fs is None:
            from fsspec.core import url_to_fs

            from qwentitan.launch.base.s3 import apply_deadlines

            apply_deadlines()
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
