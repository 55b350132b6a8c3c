"""`qwentitan-launch sync-mlflow RUN_DIR`: replay a run's MLflow spool, adding only what is missing."""

from __future__ import annotations

import argparse
import sys

NAME = "sync-mlflow"
HELP = (
    "Replay the MLflow spool of a training run folder into MLflow (after the server was slow or "
    "down); running it twice adds nothing. A run whose spool has no end record is ended FAILED; "
    "exit 2 if damaged spool lines (bad JSON, bad values, a file outside the run folder, a "
    "torn last line) were skipped."
)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "run_dir", metavar="RUN_DIR", help="the run's dump_folder, or one spool .jsonl file in it"
    )
    parser.add_argument(
        "--tracking-uri",
        default=None,
        help="MLflow store (default: $MLFLOW_TRACKING_URI, else the one the run was logging to)",
    )


def run(args: argparse.Namespace) -> int:
    import logging

    import mlflow  # noqa: F401  (importing it configures its loggers, so the level is set after)

    from qwentitan.launch.tracking.store import sync_run_dir

    # MLflow's INFO lines (creating a new sqlite store's tables) say nothing a user acts on and
    # would come before this command's own lines; its warnings and errors still show.
    logging.getLogger("mlflow").setLevel(logging.WARNING)

    try:
        results = sync_run_dir(args.run_dir, args.tracking_uri)
    except OSError as error:
        from qwentitan.launch.base.errors import LaunchError

        raise LaunchError(
            f"Could not read {args.run_dir} ({error.strerror or error}); check the path and "
            "its permissions."
        ) from None
    damaged = 0
    for result in results:
        ended = f"; run ended {result.status}" if result.status else ""
        print(
            f"run {result.run_id}: {result.points_added} metric points added, "
            f"{result.points_present} already there; {result.params_added} params and "
            f"{result.artifacts_added} artifacts added{ended}"
        )
        if result.damaged_lines:
            damaged += 1
            lines = ", ".join(map(str, result.damaged_lines))
            print(
                f"qwentitan-launch sync-mlflow: skipped damaged spool line(s) {lines} of run "
                f"{result.run_id} (not JSON, a value MLflow cannot hold, a file outside the run "
                "folder, or torn); what they held is not in MLflow, everything else is.",
                file=sys.stderr,
            )
    return 2 if damaged else 0
