"""`qwentitan-launch run`: start this node's torchrun agent for a planned run (any scheduler)."""

from __future__ import annotations

import argparse
import re

from qwentitan.launch.base.errors import LaunchError
from qwentitan.launch.launcher.flags import non_negative
from qwentitan.launch.launcher.plan import LaunchPlan
from qwentitan.launch.launcher.plan_cli import (
    add_plan_arguments,
    add_resume_argument,
    describe,
    plan_from_args,
)

NAME = "run"
HELP = (
    "Plan, check and launch a recipe on this node with torchrun (c10d rendezvous). For several "
    "nodes, run it once per node with --nnodes N --rdzv-endpoint HOST:PORT (c10d numbers the "
    "nodes as they join), or with --plan FILE as `slurm` writes it; --dry-run only prints the "
    "plan. Trainium launches are untested: nothing here has run on Trainium."
)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_plan_arguments(parser, recipe_required=False)
    add_resume_argument(parser)
    parser.add_argument(
        "--plan",
        help="run exactly the plan in this file (written by `slurm`) instead of resolving one "
        "from --recipe and the flags",
    )
    parser.add_argument(
        "--rdzv-endpoint",
        help="HOST:PORT of the c10d rendezvous, on the first node (default localhost:0, one node)",
    )
    parser.add_argument(
        "--max-restarts",
        type=non_negative,
        default=None,
        help="torchrun restarts of the whole group after a rank fails; each resumes from the "
        "last checkpoint (default 0, or the plan file's)",
    )
    parser.add_argument("--dry-run", action="store_true", help="print the plan and stop")


# What torchrun's c10d rendezvous takes: a host name, an IPv4 address or a bracketed IPv6 one,
# and an optional port.
_ENDPOINT = re.compile(
    r"(\[[0-9A-Fa-f:.]+\]|[A-Za-z0-9]([A-Za-z0-9.-]*[A-Za-z0-9])?)(:(?P<port>\d{1,5}))?"
)


def check_endpoint(endpoint: str) -> None:
    """Refuse an --rdzv-endpoint torchrun could not parse, before anything starts."""
    match = _ENDPOINT.fullmatch(endpoint)
    if match is None or int(match.group("port") or 0) > 65535:
        raise LaunchError(
            f"--rdzv-endpoint {endpoint!r} is not HOST:PORT; pass the first node's host name or "
            "address and a free port, e.g. node-1:29500."
        )


def run(args: argparse.Namespace) -> int:
    if args.rdzv_endpoint is not None:
        check_endpoint(args.rdzv_endpoint)
    plan = plan_from_args(
        args,
        rdzv_endpoint=args.rdzv_endpoint,
        max_restarts=args.max_restarts,
    )
    if plan.nodes > 1 and not args.rdzv_endpoint:
        raise LaunchError(
            f"A {plan.nodes}-node run needs the rendezvous address; pass --rdzv-endpoint "
            "HOST:PORT naming the first node."
        )
    print(describe(plan), flush=True)
    if args.dry_run:
        return 0
    from qwentitan.launch.launcher.run_folder import check_checkpoints, check_free_disk
    from qwentitan.launch.runtime.preemption import STOPPED_EXIT, supervise

    check_host(plan)
    check_checkpoints(plan, folder_flag="--dump-folder", resume_flag="--resume latest")
    check_free_disk(plan, folder_flag="--dump-folder")
    # A stop on a signal (checkpoint saved) is not success: the scheduler may start it again.
    return supervise(plan.launch_argv(), plan.rank_env(), stopped_exit=STOPPED_EXIT)


def check_host(plan: LaunchPlan) -> None:
    """Refuse to launch where the planned devices are not, after the plan has been printed."""
    from qwentitan.launch.runtime.platforms import get_platform

    device = plan.topology.device_type
    if device == "cpu":
        return
    count = get_platform(device).max_ranks
    if device == "neuron" and count == 0:
        raise LaunchError(
            f"This host has no Neuron devices (torch-neuronx is not loaded), so the "
            f"{plan.topology.name} plan above cannot run here; launch it on a "
            f"{plan.topology.name} or add --dry-run."
        )
    if count < plan.ranks_per_node:
        unit = "Neuron cores" if device == "neuron" else "CUDA devices"
        raise LaunchError(
            f"This host shows {count} {unit} but the plan needs {plan.ranks_per_node} per node; "
            f"check --lnc / NEURON_LOGICAL_NC_CONFIG or pass --ranks-per-node {count}."
        )
