"""A resolved plan on disk: what `slurm` writes once and every node runs (`run --plan FILE`).

The file is the plan's own JSON (`LaunchPlan.to_json`): the recipe, the placement, the exact
torchtitan overrides every rank gets, the ranks' environment with where each value came from,
the resume mode and restarts. A node reads it back through `LaunchPlan.from_json`, which checks
every field before any value reaches torchtitan's parser, torchrun or a rank; then the plan's
checks run again (`check_plan`) against this node's software. The environment is the file's,
never re-derived from the node's shell. Written to a temporary sibling and renamed.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

from qwentitan.launch.base.errors import LaunchError
from qwentitan.launch.launcher.launch_plan import LaunchPlan
from qwentitan.launch.launcher.plan import check_plan

__all__ = ["load_plan", "save_plan"]

_FIX = "write it again with `slurm`"


def save_plan(plan: LaunchPlan, path: str | Path) -> Path:
    """Write `plan` to `path` (JSON), atomically."""
    path = Path(path)
    record = plan.to_json()
    # the nodes' own check, here first: a plan no node would accept is never written
    LaunchPlan.from_json(json.loads(json.dumps(record)), f"The plan file {path}")
    path.parent.mkdir(parents=True, exist_ok=True)
    from qwentitan.checkpoint.files import atomic_file  # its package imports torch, for now

    with atomic_file(path) as tmp:
        Path(tmp).write_text(json.dumps(record, indent=2) + "\n", encoding="utf-8")
    return path


def load_plan(
    path: str | Path, *, rdzv_endpoint: str | None = None, max_restarts: int | None = None
) -> LaunchPlan:
    """The plan `save_plan` wrote, checked again on this node; `rdzv_endpoint` is this job's."""
    path = Path(path)
    try:
        record = json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise LaunchError(f"There is no plan file {path}; write one with `slurm`.") from None
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as error:
        raise LaunchError(f"The plan file {path} cannot be read ({error}); {_FIX}.") from None
    plan = LaunchPlan.from_json(record, f"The plan file {path}")
    changes = {"rdzv_endpoint": rdzv_endpoint, "max_restarts": max_restarts}
    plan = dataclasses.replace(plan, **{k: v for k, v in changes.items() if v is not None})
    check_plan(plan)
    return plan
