"""Run folders: where a run's checkpoints go, which earlier run `--resume` continues, and whether
the disk holds what the run will save. Checked by the launcher before any rank starts.

While `train` runs, it holds an exclusive lock (`flock`) on `RUN_DIR/run.lock`, which names its
process and start time: a second run into the same folder is refused in one sentence instead
of overwriting the first one's checkpoints and reports. The kernel drops the lock when the
process ends, however it ends, so a killed run never leaves a stale one.

No command deletes checkpoints: a fresh `train` gets a new folder under `outputs/RECIPE/`
(named by its start time) and `outputs/RECIPE/latest` is a symlink to the newest one, which
`train --resume` continues. A folder that already holds checkpoints is only ever resumed
(`LaunchPlan.resume` "latest" or "auto"); a fresh plan pointing at one is refused.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import math
import os
import time
from collections.abc import Iterator
from pathlib import Path

from qwentitan.launch.base.errors import LaunchError
from qwentitan.launch.launcher.plan import LaunchPlan
from qwentitan.launch.launcher.remote import check_bucket, is_remote, lock_file

__all__ = [
    "LATEST",
    "check_checkpoints",
    "check_free_disk",
    "check_run_folder",
    "checkpoint_bytes",
    "hold_run_folder",
    "new_run_folder",
    "planned_checkpoint_bytes",
    "point_latest",
    "resolved",
    "resumable_run_folder",
]

LATEST = "latest"
LOCK_FILE = "run.lock"


def _take_lock(folder: Path | str, lock: Path | None = None) -> int:
    """An open descriptor holding `lock` (default `folder/run.lock`) exclusively; LaunchError
    naming `folder` and the holder."""
    lock = lock or Path(folder, LOCK_FILE)
    fd = os.open(lock, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        holder = os.pread(fd, 200, 0).decode(errors="replace").strip() or "another process"
        os.close(fd)
        raise LaunchError(
            f"Run folder {folder} is in use by another run ({holder}); wait for it to end, or "
            "pass another {run_dir}.",
            field="run_dir",
        ) from None
    except BaseException:
        os.close(fd)
        raise
    return fd


def check_run_folder(folder: Path, checkpoints: str | None = None) -> None:
    """Refuse, before any other check, a run folder that is not a writable folder (or cannot be
    created as one) or that another run is training in right now; `checkpoints`: their URL when
    they are remote, which one run of this host at a time may write (`remote.lock_file`)."""
    probe = folder
    while not (probe.exists() or probe.is_symlink()):
        probe = probe.parent
    if not probe.is_dir():
        what = "is" if probe == folder else f"is inside {probe}, which is"
        raise LaunchError(
            f"Run folder {folder} {what} not a folder; pass another {{run_dir}}.", field="run_dir"
        )
    if not os.access(probe, os.W_OK | os.X_OK):
        raise LaunchError(
            f"Run folder {folder} cannot be written ({probe} is read-only for this user); pass "
            "another {run_dir}.",
            field="run_dir",
        )
    if (folder / LOCK_FILE).is_file():
        with contextlib.suppress(OSError):
            os.close(_take_lock(folder))
    if checkpoints is not None:
        with contextlib.suppress(OSError):
            os.close(_take_lock(checkpoints, lock_file(checkpoints)))


@contextlib.contextmanager
def hold_run_folder(folder: Path, checkpoints: str | None = None) -> Iterator[None]:
    """Hold `folder`'s lock (creating the folder), and for remote `checkpoints` their host-wide
    lock, while the block runs; each lock file names this process and its start, for the
    sentence a second run gets."""
    fds: list[int] = []
    try:
        try:
            if checkpoints is not None:
                fds.append(_take_lock(checkpoints, lock_file(checkpoints)))
            folder.mkdir(parents=True, exist_ok=True)
            fds.append(_take_lock(folder))
        except OSError as error:
            raise LaunchError(
                f"Run folder {folder} cannot be written ({error.strerror}); pass another "
                "{run_dir}.",
                field="run_dir",
            ) from None
        started = time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime())
        for fd in fds:
            os.ftruncate(fd, 0)
            os.pwrite(fd, f"pid {os.getpid()}, started {started}\n".encode(), 0)
        yield
    finally:
        for fd in fds:
            os.close(fd)  # releases the lock; the file stays, naming the last run


def new_run_folder(base: Path) -> Path:
    """A folder under `base` no run has used, named by the time (not created yet)."""
    stamp = time.strftime("%Y%m%d-%H%M%S")
    folder, n = base / stamp, 1
    while folder.exists() or folder.is_symlink():
        n += 1
        folder = base / f"{stamp}-{n}"
    return folder


def point_latest(folder: Path) -> None:
    """Create `folder` and make `folder.parent/latest` point at it (atomically: a temporary
    symlink renamed over the old one, so `latest` always names a whole run folder)."""
    folder.mkdir(parents=True, exist_ok=False)
    temporary = folder.parent / f".{LATEST}.{os.getpid()}"
    temporary.unlink(missing_ok=True)
    temporary.symlink_to(folder.name)  # relative: the outputs folder can move
    temporary.replace(folder.parent / LATEST)


# torchtitan's default `checkpoint.folder`, which every recipe keeps.
CHECKPOINT_FOLDER = "checkpoint"


def resumable_run_folder(base: Path) -> Path | None:
    """The newest run folder under `base` that holds a checkpoint, or None: what `--resume`
    continues. `latest` may name a newer run stopped before its first save, whose folder has
    nothing to resume."""
    from qwentitan.launch.launcher.resume import saved_steps

    def started(folder: Path) -> tuple[str, int]:  # `<time>` or `<time>-<n>` (new_run_folder)
        stamp, n = folder.name[:15], folder.name[16:]
        return stamp, int(n) if n.isdigit() else 1

    runs = [f for f in base.iterdir() if f.is_dir() and not f.is_symlink()] if base.is_dir() else []
    for folder in sorted(runs, key=started, reverse=True):
        if saved_steps(folder / CHECKPOINT_FOLDER):
            return resolved(folder)
    return None


def resolved(folder: Path) -> Path:
    """`folder` made absolute with its links followed; LaunchError for a link loop."""
    folder = folder.expanduser()
    try:
        try:
            # strict: from Python 3.13 a non-strict resolve() returns a loop's path unresolved.
            return folder.resolve(strict=True)
        except OSError as error:
            if error.errno == errno.ELOOP:
                raise
            # not there yet, or under a file: resolved as far as it goes, named by its checks
            return folder.resolve()
    except (OSError, RuntimeError) as error:  # RuntimeError: Python 3.11's "Symlink loop"
        raise LaunchError(
            f"{folder} is a symbolic link that never reaches a folder ({error}); point it at a "
            "run folder or remove it, or pass another {run_dir}.",
            field="run_dir",
        ) from None


def check_checkpoints(plan: LaunchPlan, *, folder_given: bool = True) -> int | None:
    """The step the ranks resume from (None: they start at step 1), checked against
    `plan.resume`. `folder_given`: the user named the run folder; otherwise (`train` picks
    one) a fresh start means leaving resume out rather than another folder."""
    from qwentitan.launch.launcher.resume import check_resumable, saved_steps, state_shapes

    folder = plan.checkpoint_folder
    if not plan.config.checkpoint.enable:
        return None
    if is_remote(folder):
        check_bucket(str(folder))
    steps = saved_steps(folder)
    if plan.resume == "fresh" and steps:
        raise LaunchError(
            f"{folder} already holds checkpoints (newest step-{steps[-1]}); pass {{resume}} to "
            "continue them, or another {run_dir} to start a fresh run.",
            field="resume",
        )
    if plan.resume == "fresh" or (plan.resume == "auto" and not steps):
        return None
    step = check_resumable(
        folder,
        state_shapes(plan.config),
        plan.recipe,
        fresh="pass another {run_dir} to start fresh" if folder_given else None,
    )
    if step >= plan.steps:
        raise LaunchError(
            f"The checkpoint in {folder} is already at step {step}; pass {{steps}} {step + 1} "
            "or more to continue.",
            field="steps",
        )
    return step


# Measured on tiny_dense's step-N (torch 2.14 DCP): each saved tensor costs about 1.6 kB of zip
# record in its .distcp file and 0.3 kB of .metadata besides its bytes.
_BYTES_PER_TENSOR = 2048
# A rank's data position (three token buffers of up to seq_len ints, pickled) and the small
# states every checkpoint also holds (step, lr schedule).
_BYTES_PER_BUFFERED_TOKEN = 3 * 10
_SMALL_STATES = 64 * 1024


def checkpoint_bytes(plan: LaunchPlan, *, full: bool = True) -> int:
    """Bytes of one saved step: with `full`, model, AdamW's two moments (and step) per
    parameter, and every rank's data position; else the model only (the final model-only or
    HF save, in the export dtype). The model is counted by its state dict, as torchtitan saves
    it: a tied embedding is saved under both of its names."""
    from qwentitan.launch.launcher.resume import state_shapes

    shapes = state_shapes(plan.config)
    elements = sum(math.prod(shape) for shape in shapes.values())
    params = plan.model_shape.params if plan.model_shape else elements
    ckpt = plan.config.checkpoint
    training = 4 if plan.config.training.dtype == "float32" else 2
    if not full:
        export = {"float16": 2, "bfloat16": 2}.get(getattr(ckpt, "export_dtype", ""), training)
        return elements * export + len(shapes) * _BYTES_PER_TENSOR
    data = plan.world_size * (plan.seq_len * _BYTES_PER_BUFFERED_TOKEN + _BYTES_PER_TENSOR)
    return (
        elements * training
        + 2 * params * training
        + 4 * len(shapes) * _BYTES_PER_TENSOR  # the model's tensors, and AdamW's three per one
        + data
        + _SMALL_STATES
    )


def planned_checkpoint_bytes(plan: LaunchPlan) -> int:
    """Bytes the run's checkpoints take at most at once: the kept interval saves plus the one
    being written (torchtitan purges beyond `keep_latest_k` only after a save)."""
    ckpt = plan.config.checkpoint
    if not getattr(ckpt, "enable", False):
        return 0
    interval = max(int(getattr(ckpt, "interval", plan.steps) or plan.steps), 1)
    # Interval saves before the last step; the last step's save is the final one.
    before_last = (plan.steps - 1) // interval
    keep = min(getattr(ckpt, "keep_latest_k", 0) or before_last, before_last)
    full_state = checkpoint_bytes(plan)
    model_only = getattr(ckpt, "last_save_in_hf", False) or getattr(
        ckpt, "last_save_model_only", True
    )
    final = checkpoint_bytes(plan, full=False) if model_only else full_state
    at_an_interval = min(keep + 1, before_last) * full_state
    return max(at_an_interval, keep * full_state + final)


def check_free_disk(plan: LaunchPlan) -> None:
    """Refuse a run whose planned checkpoints (`planned_checkpoint_bytes`: measured against real
    saves) do not fit on the disk of its run folder, before step 1."""
    from qwentitan.checkpoint.files import disk_room  # its package imports torch, for now

    if is_remote(plan.checkpoint_folder):
        print(
            f"qwentitan-launch: note: no free-space check for {plan.checkpoint_folder}: an "
            "object store has no disk to fill.",
            flush=True,
        )
        return
    room = disk_room(plan.checkpoint_folder, planned_checkpoint_bytes(plan))
    if not room.enough:
        raise LaunchError(
            room.shortage("free space there or pass another {run_dir}"), field="run_dir"
        )
