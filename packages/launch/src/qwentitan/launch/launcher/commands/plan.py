"""`qwentitan-launch plan`: print the resolved launch plan of a recipe, checked, without running."""

from __future__ import annotations

import argparse
import json

from qwentitan.launch.launcher.plan_cli import (
    add_plan_arguments,
    add_resume_argument,
    describe,
    plan_from_args,
)

NAME = "plan"
HELP = (
    "Resolve a recipe on an instance (world size, LNC, parallel degrees, env, torchrun line, "
    "memory per rank) and print it; refuses plans that cannot run. `train` runs the same torchrun "
    "line (with --dump-folder set to its run folder)."
)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_plan_arguments(parser)
    add_resume_argument(parser)
    parser.add_argument("--json", action="store_true", help="print the plan as JSON")


def run(args: argparse.Namespace) -> int:
    plan = plan_from_args(args)
    print(json.dumps(plan.to_dict(), indent=2) if args.json else describe(plan))
    return 0
