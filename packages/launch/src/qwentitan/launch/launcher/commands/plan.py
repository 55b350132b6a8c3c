"""`qwentitan-launch plan`: print the resolved launch plan of a recipe, checked, without running."""

from __future__ import annotations

import argparse
import json
import sys

from qwentitan.launch.launcher.plan_cli import SHARED, add_request_flags, describe, plan_from_args

NAME = "plan"
HELP = (
    "Resolve a recipe on an instance (world size, LNC, parallel degrees, env, torchrun line, "
    "memory per rank) and print it; refuses plans that cannot run. `train` runs the same torchrun "
    "line (with --run-dir set to its run folder)."
)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_request_flags(parser, SHARED, defaults={"resume": "auto"}, required=("recipe",))
    parser.add_argument("--json", action="store_true", help="print the plan as JSON")


def run(args: argparse.Namespace) -> int:
    plan = plan_from_args(args)
    if plan.note and args.json:
        print(f"qwentitan-launch plan: note: {plan.note}", file=sys.stderr)
    print(json.dumps(plan.facts(), indent=2) if args.json else describe(plan))
    return 0
