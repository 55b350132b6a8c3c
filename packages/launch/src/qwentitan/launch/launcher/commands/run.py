"""`qwentitan-launch run`: start this node's torchrun agent for a planned run (any scheduler)."""

from __future__ import annotations

import argparse
import re

from qwentitan.launch.base.errors import LaunchError
from qwentitan.launch.launcher.commands.train import add_verbose_flag, verbose_for
from qwentitan.launch.launcher.plan_cli import (
    SHARED,
    add_request_flags,
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
    add_request_flags(
        parser, (*SHARED, "rdzv_endpoint", "max_restarts"), defaults={"resume": "auto"}
    )
    parser.add_argument(
        "--plan",
        help="run exactly the plan in this file (written by `slurm`) instead of resolving one "
        "from --recipe and the flags",
    )
    parser.add_argument("--dry-run", action="store_true", help="print the plan and stop")
    add_verbose_flag(parser)


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
    with verbose_for(args):
        return _run(args)


def _run(args: argparse.Namespace) -> int:
    if args.rdzv_endpoint is not None:
        check_endpoint(args.rdzv_endpoint)
    plan = plan_from_args(args, rdzv_endpoint=args.rdzv_endpoint, max_restarts=args.max_restarts)
    if plan.nodes > 1 and not args.rdzv_endpoint:
        raise LaunchError(
            f"A {plan.nodes}-node run needs the rendezvous address; pass {{rdzv_endpoint}} "
            "HOST:PORT naming the first node.",
            field="rdzv_endpoint",
        )
    print(describe(plan), flush=True)
    if args.dry_run:
        return 0
    from qwentitan.launch.launcher.start import check_before_start, launch
    from qwentitan.launch.launcher.supervisor import STOPPED_EXIT

    # a plan file's run folder and inputs are named in it; they are checked here, on the node
    # that reads them, as `train` checks its own
    check_before_start(plan, folder_given=True)
    # A stop on a signal (checkpoint saved) is not success: the scheduler may start it again.
    return launch(plan, stopped_exit=STOPPED_EXIT)
