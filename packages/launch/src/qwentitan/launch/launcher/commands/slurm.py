"""`qwentitan-launch slurm`: write an sbatch script for a multi-node run of a recipe."""

from __future__ import annotations

import argparse
import sys

from qwentitan.launch.base.errors import LaunchError
from qwentitan.launch.launcher.flags import MAX_SIGNAL_SECONDS, port, whole_number
from qwentitan.launch.launcher.plan_cli import SHARED, add_request_flags, plan_from_args
from qwentitan.launch.launcher.slurm import (
    DEFAULT_PORT,
    LOG_FILE_OVERRIDES,
    PORT_SPAN,
    SlurmOptions,
    shared_folder_warnings,
    write_sbatch,
)

NAME = "slurm"
HELP = (
    "Resolve the plan once and write it (<script>.plan.json) with an sbatch script: one torchrun "
    "agent per node through srun running exactly that plan, c10d rendezvous on the first node, "
    "USR1 before the time limit for a checkpoint and a requeue. "
    "Not run on a Trainium cluster."
)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_request_flags(
        parser,
        (*SHARED, "max_restarts"),
        defaults={"resume": "auto", "max_restarts": 3},
        required=("recipe",),
    )
    parser.add_argument(
        "--output", "-o", default=None, help="script path (default <recipe>.sbatch)"
    )
    parser.add_argument(
        "--overwrite",
        action="store_true",
        help="replace an existing script and its plan file (refused without it)",
    )
    parser.add_argument("--partition", help="SLURM partition")
    parser.add_argument("--time", help="SLURM time limit, e.g. 04:00:00")
    parser.add_argument(
        "--port",
        type=port,
        default=DEFAULT_PORT,
        help=f"first rendezvous port: a job uses this plus its job id modulo {PORT_SPAN}",
    )
    parser.add_argument(
        "--grace-seconds",
        type=whole_number(0, MAX_SIGNAL_SECONDS),
        default=120,
        help="USR1 this long before the time limit: checkpoint, then requeue",
    )


def run(args: argparse.Namespace) -> int:
    if (args.stop_by or "").strip().startswith("+"):
        # The script runs when SLURM starts it, not now: a duration from now would drift.
        raise LaunchError(
            "slurm writes a script that starts later, so {stop_by} needs an absolute UTC time "
            "such as 2026-12-03T18:00:00Z (or use --time for a limit from the job's start).",
            field="stop_by",
        )
    if args.run_dir is not None and "://" in args.run_dir:
        # The script's requeue finds the saved steps on a disk every node shares.
        raise LaunchError(
            "slurm takes a local {run_dir} on a file system every node shares (its requeue "
            "looks for the saved steps there); pass one, or train into S3 with `train` or `run`.",
            field="run_dir",
        )
    # the ranks' output goes to a log file, not a terminal
    plan = plan_from_args(args, overrides=(*(args.overrides or ()), *LOG_FILE_OVERRIDES))
    options = SlurmOptions(
        partition=args.partition,
        time=args.time,
        port=args.port,
        grace_seconds=args.grace_seconds,
    )
    path = write_sbatch(
        plan, args.output or f"{plan.recipe}.sbatch", options, overwrite=args.overwrite
    )
    for warning in shared_folder_warnings(plan):
        print(f"qwentitan-launch slurm: warning: {warning}", file=sys.stderr)
    print(
        f"wrote {path} and its plan {path.with_name(path.stem + '.plan.json')}: {plan.nodes} "
        f"nodes x {plan.ranks_per_node} ranks; submit with sbatch {path}"
    )
    return 0
