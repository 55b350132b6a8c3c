"""The pilot: the three implementation paths at tiny scale, as child runs of one MLflow parent.

`uv run nox -s pilot [-- --steps 20 --ranks 2]` trains `tiny_hf` (hf), `tiny_dense` (native)
and `tiny_moe_kernels` (moe-kernels) with `qwentitan-launch train`, each a child of one parent
run in the `qwentitan-pilot` experiment, with the same metric names, so the MLflow UI
(`uv run nox -s mlflow_ui`) compares them side by side. A path whose recipe is missing is
skipped and named on the parent run (tag `pilot.skipped`).
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
from qwentitan.launch.tracking.logger import resolve_tracking_uri
from qwentitan.launch.tracking.store import PARENT_TAG, MlflowTarget, now_ms

# Implementation path -> the tiny recipe that trains it.
PILOT_RECIPES = {"hf": "tiny_hf", "native": "tiny_dense", "moe-kernels": "tiny_moe_kernels"}
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
    skipped: dict[str, str]  # path -> why (no such recipe)
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
    recipes = _available_recipes()
    skipped = {
        path: f"recipe {recipe} does not exist on this branch"
        for path, recipe in PILOT_RECIPES.items()
        if recipe not in recipes
    }
    target.log(
        parent,
        params={"steps": str(steps), "ranks": str(ranks)},
        tags={"pilot.paths": ",".join(PILOT_RECIPES), "pilot.skipped": ",".join(skipped) or "none"},
    )
    failed = []
    for path, recipe in PILOT_RECIPES.items():
        if path in skipped:
            print(f"pilot: skipping {path}: {skipped[path]}", flush=True)
            continue
        env = dict(os.environ)
        env.update(
            QWENTITAN_MLFLOW="on",  # the pilot exists to compare runs in MLflow
            MLFLOW_TRACKING_URI=uri,
            QWENTITAN_MLFLOW_EXPERIMENT=experiment,
            QWENTITAN_MLFLOW_PARENT_RUN_ID=parent,
            QWENTITAN_MLFLOW_RUN_NAME=path,
        )
        command = [sys.executable, "-m", "qwentitan.launch.cli", "train", "--recipe", recipe,
                   "--steps", str(steps), "--ranks", str(ranks), "--run-dir", str(folder / path)]  # fmt: skip
        print(f"pilot: {path} ({recipe})", flush=True)
        if subprocess.run(command, env=env).returncode != 0:
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
    missing = [
        p for p in PILOT_RECIPES if p not in skipped and p not in failed and p not in children
    ]
    if missing:
        raise LaunchError(
            f"The {', '.join(missing)} run(s) trained but logged no MLflow run under parent "
            f"{parent}; the recipes' metrics must be qwentitan.launch.tracking.tracked_metrics(...)."
        )
    _print_table(target, children)
    print(f"pilot: parent run {parent} in {uri}; compare with `uv run nox -s mlflow_ui`")
    return Pilot(parent, children, skipped, failed, uri)


def _available_recipes() -> list[str]:
    try:
        from qwentitan.launch.recipes import recipe_names
    except ImportError:
        return []
    return recipe_names()


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
