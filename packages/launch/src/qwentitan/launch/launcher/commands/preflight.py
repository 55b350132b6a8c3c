"""`qwentitan-launch preflight`: check a recipe's run before paying for it."""

from __future__ import annotations

import argparse

from qwentitan.launch.base import env_defaults
from qwentitan.launch.launcher.plan_cli import SHARED, add_request_flags, plan_from_args

NAME = "preflight"
HELP = (
    "Check versions, devices, LNC, the sequence-length rule, the weights folder, an HF -> DCP -> "
    "HF round trip, kernel numerics, the initialisation loss and free disk; print a pass/fail "
    "report (checks that need the target device are skipped elsewhere). Exit 1 if any fails."
)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_request_flags(parser, SHARED, defaults={"resume": "auto"}, required=("recipe",))
    parser.add_argument("--weights", help="HF model folder (default: the recipe's)")
    parser.add_argument("--json", action="store_true", help="print the report as JSON")
    parser.add_argument(
        "--compile-smoke",
        action="store_true",
        help="also train one step on this host (the target): reports the first step's time, "
        "compilation included, and fails if it fails (minutes on Neuron)",
    )
    parser.add_argument(
        "--allow-fallback",
        action="store_true",
        help="let the compile smoke pass when TorchNeuron ran some ops on the CPU",
    )
    parser.add_argument(
        "--mlflow",
        nargs="?",
        const=env_defaults.tracking_uri(),  # the store training logs to
        help="attach the report to an MLflow run (tracking URI; default $MLFLOW_TRACKING_URI or "
        "sqlite:///mlflow.db; $MLFLOW_RUN_ID picks the run)",
    )


def run(args: argparse.Namespace) -> int:
    from qwentitan.launch.launcher.preflight import run_preflight

    plan = plan_from_args(args)
    report = run_preflight(
        plan,
        weights_dir=args.weights,
        compile_smoke=args.compile_smoke,
        allow_fallback=args.allow_fallback,
    )
    print(report.to_json() if args.json else report.render())
    if args.mlflow:
        run_id = report.log_to_mlflow(args.mlflow, env_defaults.mlflow_run_id())
        print(f"report attached to MLflow run {run_id}")
    return 0 if report.passed else 1
