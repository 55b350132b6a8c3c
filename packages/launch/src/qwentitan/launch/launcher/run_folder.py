"""Run folders: where a run's checkpoints go, which earlier run `--resume` continues, and whether
the disk holds what the run will save. Checked by the launcher before any rank starts.

No command deletes checkpoints: a fresh `train` gets a new folder under `outputs/RECIPE/`
(named by its start time) and `outputs/RECIPE/latest` is a symlink to the newest one, which
`train --resume` continues. A folder that already holds checkpoints is only ever resumed
(`LaunchPlan.resume` "latest" or "auto"); a fresh plan pointing at one is refused.
"""

from __future__ import annotations

import os
import time
from pathlib import Path

from qwentitan.checkpoint.files import disk_room
from qwentitan.launch.base.errors import LaunchError
from qwentitan.launch.launcher.plan import LaunchPlan

__all__ = [
    "LATEST",
    "check_checkpoints",
    "check_free_disk",
    "latest_run_folder",
    "new_run_folder",
    "planned_checkpoint_bytes",
    "point_latest",
]

LATEST = "latest"


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


def latest_run_folder(base: Path) -> Path | None:
    """The run folder `base/latest` points at, or None when there is none."""
    latest = base / LATEST
    return latest.resolve() if latest.is_symlink() and latest.resolve().is_dir() else None


def check_checkpoints(
    plan: LaunchPlan, *, folder_flag: str, resume_flag: str, fresh: str | None = None
) -> int | None:
    """The step the ranks resume from (None: they start at step 1), checked against
    `plan.resume`; LaunchError naming `folder_flag` / `resume_flag` when the folder disagrees.
    `fresh` is how to start from scratch instead (default: another `folder_flag`)."""
    from qwentitan.launch.launcher.resume import check_resumable, saved_steps, state_shapes

    folder = plan.checkpoint_folder
    if not plan.config.checkpoint.enable:
        return None
    steps = saved_steps(folder)
    if plan.resume == "fresh" and steps:
        raise LaunchError(
            f"{folder} already holds checkpoints (newest step-{steps[-1]}); pass {resume_flag} to "
            f"continue them, or another {folder_flag} to start a fresh run."
        )
    if plan.resume == "fresh" or (plan.resume == "auto" and not steps):
        return None
    step = check_resumable(
        folder,
        state_shapes(plan.config),
        plan.recipe,
        folder_flag=folder_flag,
        fresh=fresh or f"pass another {folder_flag} to start fresh",
    )
    if step >= plan.steps:
        raise LaunchError(
            f"The checkpoint in {folder} is already at step {step}; pass --steps {step + 1} or "
            "more to continue."
        )
    return step


def planned_checkpoint_bytes(plan: LaunchPlan) -> int:
    """Bytes the run's checkpoints take at most: the kept interval saves plus the final one."""
    params = plan.model_shape.params if plan.model_shape else 0
    ckpt = plan.config.checkpoint
    if not getattr(ckpt, "enable", False):
        return 0
    interval = max(int(getattr(ckpt, "interval", plan.steps) or plan.steps), 1)
    # Interval saves before the last step; the last step's save is the final one.
    before_last = (plan.steps - 1) // interval
    keep = getattr(ckpt, "keep_latest_k", 0) or before_last
    training = 4 if plan.config.training.dtype == "float32" else 2
    full_state = params * training * 3  # model + AdamW's two moments
    export = {"float16": 2, "bfloat16": 2}.get(getattr(ckpt, "export_dtype", "float32"), 4)
    if getattr(ckpt, "last_save_in_hf", False):
        final = params * export
    elif getattr(ckpt, "last_save_model_only", True):
        final = params * training
    else:
        final = full_state
    return min(keep, before_last) * full_state + final


def check_free_disk(plan: LaunchPlan, *, folder_flag: str) -> None:
    """Refuse a run whose planned checkpoints do not fit on the disk of its run folder (the
    workspace's one free-disk rule, `qwentitan.checkpoint.files.disk_room`)."""
    room = disk_room(plan.checkpoint_folder, planned_checkpoint_bytes(plan))
    if not room.enough:
        raise LaunchError(room.shortage(f"free space there or pass another {folder_flag}"))
