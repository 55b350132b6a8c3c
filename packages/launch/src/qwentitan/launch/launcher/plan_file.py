"""A resolved plan on disk: what `slurm` writes once and every node runs (`run --plan FILE`).

The file holds the plan's inputs as resolved, not the flags that produced them: the recipe, the
placement (instance, LNC, ranks per node, nodes), the exact torchtitan overrides every rank gets,
the ranks' environment with where each value came from, the resume mode and restarts. A node
loads it through `plan_from_overrides`, so torchtitan's parser builds the very config the file
names and the plan's checks run again against this node's software; the environment is the
file's, never re-derived from the node's shell. The plan as printed (`to_dict`) is kept beside
them for the reader. JSON, written to a temporary sibling and renamed; read back only after it
passes the one schema of `plan_schema` (types, ranges, the variables a plan may set).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from qwentitan.launch.base import env_defaults
from qwentitan.launch.base.errors import LaunchError
from qwentitan.launch.base.target import get_topology
from qwentitan.launch.launcher.plan import LaunchPlan, plan_from_overrides
from qwentitan.launch.launcher.plan_schema import check_record
from qwentitan.launch.launcher.request import TRAINER_FIELDS, RunRequest

__all__ = ["FORMAT", "load_plan", "planned_inputs", "save_plan"]

FORMAT = "qwentitan-plan/1"


def save_plan(plan: LaunchPlan, path: str | Path) -> Path:
    """Write `plan` to `path` (JSON), atomically."""
    path = Path(path)
    record = {
        "format": FORMAT,
        "recipe": plan.recipe,
        "instance": plan.topology.name,
        "lnc": plan.lnc,
        "ranks_per_node": plan.ranks_per_node,
        "nodes": plan.nodes,
        "overrides": plan.overrides,
        "env": plan.env,
        "env_sources": plan.env_sources,
        "resume": plan.resume,
        "max_restarts": plan.max_restarts,
        "plan": plan.to_dict(),
    }
    # the nodes' own check, here first: a plan no node would accept is never written
    check_record(json.loads(json.dumps(record)), path)
    path.parent.mkdir(parents=True, exist_ok=True)
    from qwentitan.checkpoint.files import atomic_file  # its package imports torch, for now

    with atomic_file(path) as tmp:
        Path(tmp).write_text(json.dumps(record, indent=2) + "\n", encoding="utf-8")
    return path


def load_plan(
    path: str | Path, *, rdzv_endpoint: str | None = None, max_restarts: int | None = None
) -> LaunchPlan:
    """The plan `save_plan` wrote, checked again on this node; `rdzv_endpoint` is this job's."""
    record = _read(Path(path))
    overrides = list(record["overrides"])
    # As resolved: a batch scaled with the nodes is pinned in the overrides, not scaled again.
    pinned = "--training.global-batch-size" in overrides
    request = RunRequest(
        recipe=record["recipe"],
        instance=record["instance"],
        lnc=record["lnc"],
        ranks_per_node=record["ranks_per_node"],
        nodes=record["nodes"],
        global_batch_size=record["plan"]["global_batch"] if pinned else None,
        rdzv_endpoint=rdzv_endpoint,
        max_restarts=record["max_restarts"] if max_restarts is None else max_restarts,
        resume=record["resume"],
    )
    topology = get_topology(
        request.instance, lnc=request.lnc, ranks_per_node=request.ranks_per_node
    )
    return plan_from_overrides(
        request,
        topology,
        overrides,
        shell=env_defaults.shell(),
        env=(dict(record["env"]), dict(record["env_sources"])),
    )


def planned_inputs(plan: LaunchPlan) -> dict[str, str]:
    """The local inputs a plan's overrides name (`dataset`, `tokenizer`, as request fields), so a
    node checks them as `train` checks its flags before the ranks start: the last value of each
    field's first override (`--flag VALUE` or `--flag=VALUE`), as torchtitan's parser takes it."""
    found: dict[str, str] = {}
    words = plan.overrides
    for name in ("dataset", "tokenizer"):
        flag = TRAINER_FIELDS[name][0]
        for i, word in enumerate(words):
            if word == flag and i + 1 < len(words):
                found[name] = words[i + 1]
            elif word.startswith(flag + "="):
                found[name] = word.split("=", 1)[1]
    return found


def _read(path: Path) -> dict[str, Any]:
    try:
        record = json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise LaunchError(f"There is no plan file {path}; write one with `slurm`.") from None
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as error:
        raise LaunchError(
            f"The plan file {path} cannot be read ({error}); write it again with `slurm`."
        ) from None
    if not isinstance(record, dict) or record.get("format") != FORMAT:
        raise LaunchError(
            f"{path} is not a plan file of this qwentitan ({FORMAT}); write it again with `slurm`."
        )
    check_record(record, path)  # before any value reaches torchtitan, torchrun or a rank
    return record
