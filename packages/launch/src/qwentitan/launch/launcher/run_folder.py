"""Run folders: where a run's checkpoints go, which earlier run `--resume` continues, and whether
the disk holds what the run will save. Checked by the launcher before any rank starts.

No command deletes checkpoints: a fresh `train` gets a new folder under `outputs/RECIPE/`
(named by its start time) and `outputs/RECIPE/latest` is a symlink to the newest one, which
`train --resume` continues. A folder that already holds checkpoints is only ever resumed
(`LaunchPlan.resume` "latest" or "auto"); a fresh plan pointing at one is refused.
"""

from __future__ import annotations

import os
import shutil
import time
from pathlib import Path

from qwentitan.launch.base.errors import LaunchError
from qwentitan.launch.launcher.plan import LaunchPlan

__all__ = [
    "LATEST",
    "check_checkpoints",
    "check_free_disk",
    "latest_run_folder",
    "new_run_folder",
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


def check_free_disk(plan: LaunchPlan, *, folder_flag: str) -> None:
    """Refuse a run whose planned checkpoints do not fit on the disk of its run folder."""
    from qwentitan.launch.launcher.preflight.checks import planned_checkpoint_bytes

    probe = plan.checkpoint_folder.expanduser().resolve()
    while not probe.exists():
        probe = probe.parent
    free = shutil.disk_usage(probe).free
    need = planned_checkpoint_bytes(plan)
    if free < need:
        raise LaunchError(
            f"{probe} has {_size(free)} free but this run's checkpoints need about {_size(need)}; "
            f"free space there or pass another {folder_flag}."
        )


def _size(count: int) -> str:
    for unit, scale in (("GiB", 2**30), ("MiB", 2**20)):
        if count >= scale:
            return f"{count / scale:.1f} {unit}"
    return f"{count / 2**10:.1f} KiB"
