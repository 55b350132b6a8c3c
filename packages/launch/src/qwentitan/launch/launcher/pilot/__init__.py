"""The pilot: the implementation paths trained from the same weights and compared in MLflow
(`uv run nox -s pilot`, or `python -m qwentitan.launch.launcher.pilot --help`)."""

from qwentitan.launch.launcher.pilot.compare import PAIRS, Pair, PairResult, compare
from qwentitan.launch.launcher.pilot.run import (
    PILOT_EXPERIMENT,
    Pilot,
    child_overrides,
    compare_url,
    loss_url,
    run_pilot,
    runs_url,
    start_overrides,
)

__all__ = [
    "PAIRS",
    "PILOT_EXPERIMENT",
    "Pair",
    "PairResult",
    "Pilot",
    "child_overrides",
    "compare",
    "compare_url",
    "loss_url",
    "run_pilot",
    "runs_url",
    "start_overrides",
]
