"""The pilot: the three implementation paths at tiny scale, as child runs of one MLflow parent.

`uv run nox -s pilot [-- --steps 20 --ranks 2]` trains the tiny recipe of each path that the
recipe registry marks for the pilot (`tiny_hf`, `tiny_dense`, `tiny_moe_kernels`) with
`qwentitan-launch train`, each a child of one parent run in the `qwentitan-pilot` experiment,
with the same metric names, so the MLflow UI (`uv run nox -s mlflow_ui`) compares them side by
side. The parent, experiment and run name reach each training as torchtitan overrides
(`train ... -- --metrics.mlflow.parent_run_id ID ...`), not through the environment.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time
import uuid
from dataclasses import dataclass
from pathlib import Path

from qwentitan.launch.errors import LaunchError
from qwentitan.launch.recipes import pilot_recipes
from qwentitan.launch.tracking.logger import resolve_tracking_uri
from qwentitan.launch.tracking.store import PARENT_TAG, MlflowTarget, now_ms

PILOT_EXPERIMENT = "qwentitan-pilot"
_COLUMNS = (
    "summary/final_loss",
    "summary/warmup_time_s",
    "summary/sustained_step_time_s",
    "summary/sustained_tokens_per_second",
)


@dataclass(frozen=True, slots=True)
class Pilot:
    parent_run_id: str
    children: dict[str, str]  # path -> run id
    failed: list[str]  # paths whose training exited with an error
    tracking_uri: str


def run_pilot(
    steps: int = 20,
    ranks: int = 2,
    run_dir: str | os.PathLike[str] | None = None,
    tracking_uri: str | None = None,
    experiment: str = PILOT_EXPERIMENT,
) -> Pilot:
    uri = resolve_tracking_uri(tracking_uri)
    stamp = time.strftime("%Y%m%d-%H%M%S")
    folder = Path(run_dir) if run_dir else Path("outputs") / "pilot" / stamp
    target = MlflowTarget(uri)
    parent = target.open_run(
        {"run_key": uuid.uuid4().hex, "experiment": experiment, "run_name": f"pilot-{stamp}",
         "start_ms": now_ms()}
    )  # fmt: skip
    recipes = pilot_recipes()
    target.log(
        parent,
        params={"steps": str(steps), "ranks": str(ranks)},
        tags={"pilot.paths": ",".join(recipes)},
    )
    failed = []
    for path, recipe in recipes.items():
        command = [sys.executable, "-m", "qwentitan.launch.cli", "train", "--recipe", recipe,
                   "--steps", str(steps), "--ranks", str(ranks), "--run-dir", str(folder / path),
                   "--", *child_overrides(uri, experiment, parent, path)]  # fmt: skip
        print(f"pilot: {path} ({recipe})", flush=True)
        if subprocess.run(command).returncode != 0:
            failed.append(path)
    children = {
        run.info.run_name: run.info.run_id
        for run in target.client.search_runs(
            [target.client.get_run(parent).info.experiment_id],
            filter_string=f"tags.`{PARENT_TAG}` = '{parent}'",
        )
    }
    target.log(parent, tags={"pilot.failed": ",".join(failed) or "none"})
    target.end(parent, "FAILED" if failed else "FINISHED", now_ms())
    missing = [p for p in recipes if p not in failed and p not in children]
    if missing:
        raise LaunchError(
            f"The {', '.join(missing)} run(s) trained but logged no MLflow run under parent "
            f"{parent}; the recipes' metrics must be qwentitan.launch.tracking.tracked_metrics(...)."
        )
    _print_table(target, children)
    print(f"pilot: parent run {parent} in {uri}; compare with `uv run nox -s mlflow_ui`")
    return Pilot(parent, children, failed, uri)


def child_overrides(uri: str, experiment: str, parent_run_id: str, run_name: str) -> list[str]:
    """The torchtitan overrides that log one training as a child of the pilot's parent run."""
    return [
        "--metrics.mlflow.enable",  # the pilot exists to compare runs in MLflow
        "--metrics.mlflow.tracking_uri", uri,
        "--metrics.mlflow.experiment", experiment,
        "--metrics.mlflow.parent_run_id", parent_run_id,
        "--metrics.mlflow.run_name", run_name,
    ]  # fmt: skip


def _print_table(target: MlflowTarget, children: dict[str, str]) -> None:
    print(f"{'path':<12}" + "".join(f"{c.removeprefix('summary/'):>30}" for c in _COLUMNS))
    for path, run_id in children.items():
        metrics = target.client.get_run(run_id).data.metrics
        cells = "".join(f"{metrics[c]:>30.4g}" if c in metrics else f"{'-':>30}" for c in _COLUMNS)
        print(f"{path:<12}{cells}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="pilot", description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--ranks", type=int, default=2)
    parser.add_argument("--run-dir", type=Path, default=None)
    parser.add_argument("--tracking-uri", default=None)
    args = parser.parse_args(argv)
    try:
        pilot = run_pilot(args.steps, args.ranks, args.run_dir, args.tracking_uri)
    except LaunchError as error:
        print(f"pilot: {error}", file=sys.stderr)
        return 2
    if pilot.failed:
        print(
            f"pilot: the {', '.join(pilot.failed)} run(s) failed to train (see the log above); "
            "the others are in MLflow.",
            file=sys.stderr,
        )
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
