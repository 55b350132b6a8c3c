"""Writing files so that nothing is ever left half written, the one free-disk rule, and
reading a file a user named without trusting it to be one (`open_regular`, `bounded_lines`).

The workspace's single home for these ideas: `qwentitan.launch` imports them from here (the
package arrows let launch use checkpoint, never the reverse). Imports nothing heavy: the
launcher's CLI reaches it before torch is loaded.
"""

from __future__ import annotations

import contextlib
import errno
import os
import shutil
import stat
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO

from qwentitan.checkpoint.errors import CheckpointError

__all__ = [
    "FREE_SPACE_MARGIN",
    "DiskRoom",
    "atomic_file",
    "atomic_folder",
    "bounded_lines",
    "disk_room",
    "file_kind",
    "format_size",
    "member",
    "open_regular",
]

# Room asked for beyond an estimate: file-system metadata and small files the estimate omits.
FREE_SPACE_MARGIN = 1.05


@contextlib.contextmanager
def atomic_file(path: Path) -> Iterator[Path]:
    """Yield a temporary sibling of `path` to write; it replaces `path` when the block succeeds
    and is removed when it fails, so `path` is always either the old file or the whole new one."""
    path = Path(path)
    fd, name = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    os.close(fd)
    tmp = Path(name)
    try:
        yield tmp
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)


@contextlib.contextmanager
def atomic_folder(target: Path) -> Iterator[Path]:
    """Yield a temporary sibling folder of `target`; rename it into place when the block succeeds.

    Several processes may build the same folder at once (ranks filling one cache): each writes
    its own temporary folder, the first rename wins, and later ones find the folder already there.
    """
    target = Path(target)
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}.", dir=target.parent))
    try:
        yield tmp
        try:
            os.rename(tmp, target)
        except OSError:
            if not target.is_dir():
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


@dataclass(frozen=True)
class DiskRoom:
    """Free space on the file system that will hold `path`, against what is to be written."""

    folder: Path  # the nearest existing folder at or above the path asked about
    free: int
    needed: int

    @property
    def enough(self) -> bool:
        return self.free >= self.needed * FREE_SPACE_MARGIN

    def shortage(self, fix: str) -> str:
        """The one sentence for a disk without room, ending in `fix`."""
        return (
            f"{self.folder} has {format_size(self.free)} free but this needs about "
            f"{format_size(int(self.needed * FREE_SPACE_MARGIN))}; {fix}."
        )


def disk_room(path: Path, needed: int) -> DiskRoom:
    """The room for `needed` bytes at `path` (which need not exist yet)."""
    folder = Path(path).expanduser().absolute()
    while not folder.exists():
        folder = folder.parent
    return DiskRoom(folder, shutil.disk_usage(folder).free, needed)


def format_size(nbytes: int) -> str:
    """Bytes for a message, in decimal units like `df -H`: '3.4 GB', '5 MB', '512 B'."""
    for unit, scale in (("TB", 10**12), ("GB", 10**9), ("MB", 10**6), ("kB", 10**3)):
        if nbytes >= scale:
            return f"{nbytes / scale:.3g} {unit}"
    return f"{nbytes} B"


def member(folder: Path, name: object, named_in: Path) -> Path:
    """The file `name` of `folder`, as an index (`named_in`) names it: a plain file name, so
    a hostile index cannot make a reader open files outside the folder. A member that is a
    symbolic link (the Hub cache links each shard to its blob) is followed as usual."""
    plain = (
        isinstance(name, str)
        and name not in ("", ".", "..")
        and "/" not in name
        and "\\" not in name
        and "\0" not in name
    )
    if not plain:
        raise CheckpointError(
            f"{named_in} names {name!r}, which is not a plain file name inside {folder}; "
            "restore the index from the model's original files."
        )
    return Path(folder) / name


_KINDS = (
    (stat.S_ISDIR, "a folder"),
    (stat.S_ISFIFO, "a FIFO (named pipe)"),
    (stat.S_ISCHR, "a character device"),
    (stat.S_ISBLK, "a block device"),
    (stat.S_ISSOCK, "a socket"),
)


def file_kind(mode: int) -> str | None:
    """None for a regular file, else what the `st_mode` says it is ("a FIFO (named pipe)")."""
    if stat.S_ISREG(mode):
        return None
    return next((kind for test, kind in _KINDS if test(mode)), "not a regular file")


def open_regular(path: str | os.PathLike[str]) -> BinaryIO:
    """`path` (links followed) opened for reading in binary, if it is a regular file; else an
    OSError whose `strerror` says what it is ("a FIFO (named pipe), not a regular file").

    Opened without blocking first: opening a FIFO waits for a writer, for ever; reading a
    device such as /dev/zero never ends.
    """
    fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
    try:
        kind = file_kind(os.fstat(fd).st_mode)
        if kind is not None:
            raise OSError(errno.EINVAL, f"{kind}, not a regular file", os.fspath(path))
        os.set_blocking(fd, True)
        return os.fdopen(fd, "rb")
    except BaseException:
        os.close(fd)
        raise


def bounded_lines(stream: BinaryIO, limit: int) -> Iterator[bytes | None]:
    """Each line of `stream` (its newline kept), holding at most `limit` bytes in memory: a
    longer line is read through and given as None, so one endless line cannot fill memory."""
    while line := stream.readline(limit + 1):
        if len(line) <= limit or line.endswith(b"\n"):
            yield line
            continue
        while (rest := stream.readline(1 << 20)) and not rest.endswith(b"\n"):
            pass
        yield None
