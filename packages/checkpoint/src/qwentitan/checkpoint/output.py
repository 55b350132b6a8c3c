"""Where results go: a temporary sibling renamed into place, and a progress bar in bytes."""

from __future__ import annotations

import ctypes
import ctypes.util
import os
import shutil
import time
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from rich.console import Console
from rich.progress import (
    BarColumn,
    DownloadColumn,
    Progress,
    TextColumn,
    TimeRemainingColumn,
    TransferSpeedColumn,
)

from qwentitan.checkpoint.errors import CheckpointError


def check_destination(src: Path, dst: Path, overwrite: bool) -> None:
    """Refuse a destination that would clobber work or the source, before anything is written."""
    src_r, dst_r = src.resolve(), dst.resolve()
    if dst_r == src_r or src_r in dst_r.parents:
        raise CheckpointError(
            f"destination {dst} is inside the source {src}; choose a destination outside it."
        )
    if dst_r in src_r.parents:
        raise CheckpointError(
            f"destination {dst} contains the source {src}; choose a destination outside it."
        )
    if dst.exists() and not overwrite:
        raise CheckpointError(
            f"destination {dst} already exists; pass --overwrite (overwrite=True) to replace it "
            "or choose another path."
        )


@contextmanager
def staged_folder(dst: Path) -> Iterator[Path]:
    """Yield an empty temporary sibling of `dst`; on success it replaces `dst`, else it is removed.

    An interrupted run leaves only a hidden `.{name}.partial-*` folder that is removed on the
    way out, never something that looks like a complete checkpoint.
    """
    dst.parent.mkdir(parents=True, exist_ok=True)
    tmp = dst.parent / f".{dst.name}.partial-{uuid.uuid4().hex[:8]}"
    tmp.mkdir()
    try:
        yield tmp
        _sync_tree(tmp)
        if dst.exists():
            old = dst.parent / f".{dst.name}.old-{uuid.uuid4().hex[:8]}"
            os.rename(dst, old)
            os.rename(tmp, dst)
            shutil.rmtree(old) if old.is_dir() else old.unlink()
        else:
            os.rename(tmp, dst)
        _fsync_dir(dst.parent)
    finally:
        # A writer thread that was still starting when the run failed may create one more
        # (empty) file; retry briefly so nothing is left behind.
        for _ in range(50):
            if not tmp.exists():
                break
            shutil.rmtree(tmp, ignore_errors=True)
            time.sleep(0.02)


def _sync_tree(folder: Path) -> None:
    """Make everything under `folder` durable before it is renamed into place.

    One syncfs for the whole file system (what `cp` + `sync` pays) instead of an fsync, and a
    journal commit, per file: a DCP folder holds one file per tensor.
    """
    fd = os.open(folder, os.O_RDONLY)
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
        if libc.syncfs(fd) == 0:
            return
    except (OSError, AttributeError):
        pass
    finally:
        os.close(fd)
    for path in sorted(folder.rglob("*")):
        if path.is_file():
            file_fd = os.open(path, os.O_RDONLY)
            try:
                os.fsync(file_fd)
            finally:
                os.close(file_fd)


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


@contextmanager
def byte_progress(description: str, total: int) -> Iterator[callable]:
    """A rich progress bar in bytes on stderr (quiet when stderr is not a terminal)."""
    console = Console(stderr=True)
    progress = Progress(
        TextColumn("[bold]{task.description}"),
        BarColumn(),
        DownloadColumn(),
        TransferSpeedColumn(),
        TimeRemainingColumn(),
        console=console,
        disable=not console.is_terminal,
        transient=False,
    )
    with progress:
        task = progress.add_task(description, total=total)
        yield lambda nbytes: progress.advance(task, nbytes)
