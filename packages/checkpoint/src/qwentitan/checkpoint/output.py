"""Where results go: a temporary sibling renamed into place, and a progress bar in bytes."""

from __future__ import annotations

import ctypes
import errno
import fnmatch
import os
import re
import shutil
import signal
import tempfile
import threading
import time
import uuid
import warnings
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

from qwentitan.checkpoint.dcp_metadata import METADATA
from qwentitan.checkpoint.disk import libc
from qwentitan.checkpoint.errors import CheckpointError
from qwentitan.checkpoint.files import disk_room
from qwentitan.checkpoint.safetensors_io import INDEX, SHARD_PLAN, SINGLE

# What a folder of each kind may hold and still be replaced by --overwrite: its own files only.
_KIND_FILES = {
    "dcp": (".metadata", "*.distcp", "config.json", "generation_config.json", SHARD_PLAN),
    "hf": ("*.safetensors", INDEX, "config.json", "generation_config.json"),
}
_KIND_NAMES = {"dcp": "DCP checkpoint folder", "hf": "Hugging Face safetensors folder"}
_KIND_MARKS = {"dcp": (METADATA,), "hf": (SINGLE, INDEX)}


def check_destination(src: Path, dst: Path, overwrite: bool, *, kind: str, needs: int) -> None:
    """Refuse, before anything is written, a destination that would clobber work or the
    source, that cannot be written, or whose file system lacks the `needs` bytes; remove the
    partial outputs that killed runs to `dst` left behind."""
    for path in (src, dst):
        try:
            path.resolve()
        except (RuntimeError, OSError):  # RuntimeError before Python 3.13, ELOOP after
            raise CheckpointError(
                f"{path} is a symbolic link loop (or passes through one); remove the link or "
                "choose another path."
            ) from None
    src_r, dst_r = src.resolve(), dst.resolve()
    if dst_r == src_r or src_r in dst_r.parents:
        raise CheckpointError(
            f"destination {dst} is inside the source {src}; choose a destination outside it."
        )
    if dst_r in src_r.parents:
        raise CheckpointError(
            f"destination {dst} contains the source {src}; choose a destination outside it."
        )
    if dst.exists() or dst.is_symlink():
        if not overwrite:
            raise CheckpointError(
                f"destination {dst} already exists; pass --overwrite to replace it, or choose "
                "another path."
            )
        _check_replaceable(dst, kind)
    folder = dst.parent
    while not folder.exists():  # the folders still to create go where their first ancestor is
        folder = folder.parent
    if not folder.is_dir():
        raise CheckpointError(
            f"cannot create {dst}: {folder} is a file, not a folder; choose a destination "
            "inside a folder."
        )
    if not os.access(folder, os.W_OK | os.X_OK):
        raise CheckpointError(f"cannot write {dst}: {_unwritable(folder)}; {_WRITABLE_FIX}.")
    _remove_stale_partials(dst)  # before counting free space: they may hold much of it
    if not disk_room(dst, needs).enough:
        _check_takes_files(dst, folder)  # /proc and /sys report no room, but take no files
        raise CheckpointError(_no_space(dst, needs))


def _check_takes_files(dst: Path, folder: Path) -> None:
    """Refuse a folder that cannot hold new files (a pseudo file system such as /proc or
    /sys, whose permission bits say writable to root) by making and removing an empty one."""
    try:
        os.rmdir(tempfile.mkdtemp(prefix=".qwentitan-probe-", dir=folder))
    except OSError as e:
        raise CheckpointError(
            f"cannot write {dst}: {folder} does not take new files "
            f"({os.strerror(e.errno).lower() if e.errno else e}); {_WRITABLE_FIX}."
        ) from None


_WRITABLE_FIX = "choose a destination you can write to"


def _unwritable(folder: Path) -> str:
    if os.statvfs(folder).f_flag & os.ST_RDONLY:
        return f"{folder} is on a read-only file system"
    return f"permission denied on {folder}"


def _no_space(dst: Path, needs: int) -> str:
    # The workspace's one free-disk rule and sentence (qwentitan.checkpoint.files).
    room = disk_room(dst, needs)
    return f"no space left on device for {dst}: " + room.shortage(
        "free some space or choose a destination on another disk"
    )


def _check_replaceable(dst: Path, kind: str) -> None:
    """--overwrite replaces a checkpoint of the same kind holding nothing but its own files."""
    what = _KIND_NAMES[kind]
    if dst.is_symlink() or not dst.is_dir():
        link = "symbolic link" if dst.is_symlink() else "file"
        raise CheckpointError(
            f"destination {dst} is a {link}, not a {what}; --overwrite replaces only a {what}, "
            f"remove the {link} yourself or choose another path."
        )
    entries = sorted(dst.iterdir())
    if not entries:
        return
    if not any((dst / mark).is_file() for mark in _KIND_MARKS[kind]):
        raise CheckpointError(
            f"destination {dst} is not a {what} (it has no {' or '.join(_KIND_MARKS[kind])}); "
            f"--overwrite replaces only a {what}, move its contents away or choose another path."
        )
    for entry in entries:
        if entry.is_symlink() or not entry.is_file() or not _is_kind_file(entry.name, kind):
            raise CheckpointError(
                f"destination {dst} holds {entry.name}, which is not part of a {what}; "
                "--overwrite would delete it, move it away or choose another path."
            )


def _is_kind_file(name: str, kind: str) -> bool:
    return any(fnmatch.fnmatchcase(name, pattern) for pattern in _KIND_FILES[kind])


@contextmanager
def staged_folder(dst: Path, needs: int, *, overwrite: bool, kind: str) -> Iterator[Path]:
    """Yield an empty temporary sibling of `dst`; on success it replaces `dst`, else it is removed.

    An interrupted or failed run leaves nothing that looks like a complete checkpoint: its
    hidden `.{name}.partial-{pid}-{8 hex}` folder is removed on the way out, on SIGINT and
    SIGTERM too (both become a CheckpointError); one that a killed run left behind is removed
    by the next run's `check_destination`. A full disk or an unwritable folder mid-write
    becomes one CheckpointError naming the path and the cause. The destination is checked
    again at the rename: without `overwrite` it is claimed atomically (a `dst` another writer
    finished meanwhile is kept and this run fails); with it, only a folder of `kind` is replaced.
    """
    try:
        dst.parent.mkdir(parents=True, exist_ok=True)
        tmp = dst.parent / f"{_partial_prefix(dst)}{os.getpid()}-{uuid.uuid4().hex[:8]}"
        tmp.mkdir()
    except OSError as e:
        raise CheckpointError(f"cannot create {dst}: {_cause(e)}; {_WRITABLE_FIX}.") from None
    received: list[str] = []
    old = None
    with _signals_interrupt(received):
        try:
            yield tmp
            _sync_tree(tmp)
            if not overwrite:
                _rename_noreplace(tmp, dst)
            else:
                if dst.exists() or dst.is_symlink():
                    _check_replaceable(dst, kind)  # another writer may have put it there since
                    old = dst.parent / f".{dst.name}.old-{uuid.uuid4().hex[:8]}"
                    os.rename(dst, old)
                os.rename(tmp, dst)
            if old is not None:
                shutil.rmtree(old) if old.is_dir() and not old.is_symlink() else old.unlink()
            _fsync_dir(dst.parent)
        except BaseException as e:
            if old is not None and old.exists() and not (dst.exists() or dst.is_symlink()):
                os.rename(old, dst)  # stopped between the two renames: put the old one back
            error = _environment_error(e, dst, tmp, needs, received)
            if error is None:
                raise
            _remove(tmp)
            raise error from None
        finally:
            _remove(tmp)


_AT_FDCWD = -100
_RENAME_NOREPLACE = 1  # <linux/fs.h>: fail with EEXIST rather than replace the target


def _rename_noreplace(tmp: Path, dst: Path) -> None:
    """Rename `tmp` to `dst` only if nothing is at `dst`, in one step (renameat2), so of two
    writers into one new folder the second fails instead of replacing the first's output."""
    renameat2 = getattr(libc(), "renameat2", None)
    if renameat2 is not None:
        if renameat2(_AT_FDCWD, os.fsencode(tmp), _AT_FDCWD, os.fsencode(dst), _RENAME_NOREPLACE):
            err = ctypes.get_errno()
            if err == errno.EEXIST:
                raise CheckpointError(_taken(dst))
            if err not in (errno.EINVAL, errno.ENOSYS):  # EINVAL: a file system without it
                raise OSError(err, os.strerror(err), str(dst))
        else:
            return
    # Without renameat2, rename(2) still refuses a non-empty folder, a file or a link at `dst`
    # (it would replace only an empty folder).
    try:
        os.rename(tmp, dst)
    except OSError as e:
        if e.errno in (errno.EEXIST, errno.ENOTEMPTY, errno.ENOTDIR, errno.EISDIR):
            raise CheckpointError(_taken(dst)) from None
        raise


def _taken(dst: Path) -> str:
    return (
        f"destination {dst} was created by another writer while this one ran; kept it and "
        "removed this run's output, choose another path or pass --overwrite to replace it."
    )


def _remove(tmp: Path) -> None:
    # A writer thread that was still starting when the run failed may create one more
    # (empty) file; retry briefly so nothing is left behind.
    for _ in range(50):
        if not tmp.exists():
            break
        shutil.rmtree(tmp, ignore_errors=True)
        time.sleep(0.02)


def _partial_prefix(dst: Path) -> str:
    return f".{dst.name}.partial-"


def _remove_stale_partials(dst: Path) -> None:
    """Remove the partial outputs of runs to `dst` that were killed (SIGKILL, power loss):
    folders named exactly as `staged_folder` names them, whose writer's pid is gone. A run
    still going is left alone, and so is anything else (a user's `.out.partial-backup`)."""
    if not dst.parent.is_dir():
        return
    own = re.compile(re.escape(_partial_prefix(dst)) + r"(\d+)-[0-9a-f]{8}")
    stale = []
    for path in sorted(dst.parent.iterdir()):
        match = own.fullmatch(path.name)
        if match is None or path.is_symlink() or not path.is_dir() or _alive(int(match[1])):
            continue
        shutil.rmtree(path, ignore_errors=True)
        stale.append(path.name)
    if stale:
        warnings.warn(
            f"removed {len(stale)} partial output(s) that an interrupted earlier run to {dst} "
            f"left behind: {', '.join(stale)}",
            stacklevel=1,  # here, in the package: the CLI shows the package's warnings
        )


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


@contextmanager
def _signals_interrupt(received: list[str]) -> Iterator[None]:
    """SIGINT and SIGTERM raise KeyboardInterrupt in the main thread (the first one only, so
    cleanup is not interrupted) and are recorded in `received`. SIGTERM's default would end
    the process at once and leave the partial folder behind."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def handler(signum: int, frame) -> None:
        received.append(signal.Signals(signum).name)
        if len(received) == 1:
            raise KeyboardInterrupt(received[0])

    previous = {s: signal.signal(s, handler) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        yield
    finally:
        for s, h in previous.items():
            signal.signal(s, h)


def _environment_error(
    e: BaseException, dst: Path, tmp: Path, needs: int, received: list[str]
) -> CheckpointError | None:
    """The one sentence for a failure the user's environment caused, else None."""
    if received or isinstance(e, KeyboardInterrupt):
        name = received[0] if received else "SIGINT"
        state = "is unchanged" if dst.exists() else "was not created"
        return CheckpointError(
            f"interrupted by {name}: removed the partial output, {dst} {state}; run the "
            "command again."
        )
    if isinstance(e, CheckpointError):
        return None
    os_errors = [c for c in _causes(e) if isinstance(c, OSError) and c.errno is not None]
    full = [c for c in os_errors if c.errno in (errno.ENOSPC, errno.EDQUOT)]
    # torch.save's zip writer reports a full disk as "unexpected pos", not as ENOSPC: a disk
    # without room left for what remains to be written tells the two apart.
    try:
        # Blocks, not sizes: to-hf lays its shards out at full (sparse) size up front.
        written = sum(p.stat().st_blocks * 512 for p in tmp.rglob("*") if p.is_file())
        free = shutil.disk_usage(dst.parent).free
    except OSError:
        written, free = 0, None
    if full or (free is not None and free < needs - written):
        _remove(tmp)
        return CheckpointError(_no_space(dst, needs))
    for c in os_errors:
        if c.errno in (errno.EROFS, errno.EACCES, errno.EPERM, errno.ENOTDIR):
            return CheckpointError(f"cannot write {dst}: {_cause(c)}; {_WRITABLE_FIX}.")
    return None


def _causes(e: BaseException | None) -> Iterator[BaseException]:
    """`e` and everything it wraps: causes, contexts and DCP's per-rank failures."""
    seen: set[int] = set()
    todo = [e]
    while todo:
        c = todo.pop()
        if c is None or id(c) in seen:
            continue
        seen.add(id(c))
        yield c
        todo += [c.__cause__, c.__context__]
        failures = getattr(c, "failures", None)
        if isinstance(failures, dict):
            todo += [f for f in failures.values() if isinstance(f, BaseException)]


def _cause(e: OSError) -> str:
    where = f" ({e.filename})" if e.filename else ""
    return f"{os.strerror(e.errno).lower() if e.errno else e}{where}"


def _sync_tree(folder: Path) -> None:
    """Make everything under `folder` durable before it is renamed into place.

    One syncfs for the whole file system (what `cp` + `sync` pays) instead of an fsync, and a
    journal commit, per file: a DCP folder holds one file per tensor. The writers started each
    range's writeback as they wrote it (`disk.start_writeback`), so most is on disk already.
    """
    syncfs = getattr(libc(), "syncfs", None)
    fd = os.open(folder, os.O_RDONLY)
    try:
        if syncfs is not None and syncfs(fd) == 0:
            return
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
