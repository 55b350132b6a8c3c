"""`qwentitan-launch train`: train a recipe on this machine, one torchrun process per rank.

`train` is the local preset of the launch plan: the same flags and `RunRequest` as `plan` and
`run`, with this host as the instance, one node, "fresh" as the resume default and a run folder
of its own: each fresh run without `--run-dir` gets `outputs/RECIPE/<start time>`, and
`outputs/RECIPE/latest` points at the newest one, which `--resume` continues (nothing is ever
deleted). It runs the plan's torchrun line under the same checks and supervisor as `run`
(`launcher.start`), so `plan --json` shows exactly the line `train` runs. When the ranks end,
it prints one summary block (`tracking.summary.format_summary`) from
RUN_DIR/reports/summary.json, which the metrics rank wrote at close.

The plan is resolved and checked in a short-lived child process (`launcher.child`), so the
process that then supervises the ranks for the whole run keeps none of torch, torchtitan or the
model stack that building the config imports. The pilot, which has imported them already,
plans and trains each of its children here in its own process (`plan_training`, `train_plan`).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

from qwentitan.launch.base.errors import LaunchError
from qwentitan.launch.launcher.plan_cli import SHARED, add_request_flags
from qwentitan.launch.launcher.request import RunRequest

if TYPE_CHECKING:
    from qwentitan.launch.launcher.launch_plan import LaunchPlan

NAME = "train"
HELP = (
    "Train a recipe on this machine (default: tiny_dense on 2 ranks, offline corpus, Qwen3 "
    "tokenizer, no download), each run in a new folder outputs/RECIPE/<time>; --resume "
    "continues the latest one."
)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_request_flags(
        parser,
        SHARED,
        defaults={"recipe": "tiny_dense", "resume": "fresh"},
        helps={
            "instance": "the Target to train as (default: this host: Neuron, else CUDA, else CPU)",
            "nodes": "1: train runs on this machine (`run` starts each node of several)",
        },
    )
    add_verbose_flag(parser)


def add_verbose_flag(parser: argparse.ArgumentParser) -> None:
    """`--verbose` of `train` and `run`: every line of the ranks (see `runtime.console`)."""
    parser.add_argument(
        "--verbose",
        action="store_true",
        help="show every line of the ranks (warnings, torchtitan's set-up); without it they "
        "are in RUN_DIR/logs only",
    )


def run(args: argparse.Namespace) -> int:
    from qwentitan.launch.launcher import child

    with verbose_for(args):
        plan, said = child.in_child(prepare, args)
        return train_plan(plan, said)


def verbose_for(args: argparse.Namespace) -> contextlib.AbstractContextManager[None]:
    """`--verbose` for the command (the plan block) and its torchrun agent (the ranks' lines),
    which read it as QWENTITAN_VERBOSE: set for the command's block, restored after."""
    from qwentitan.launch.base import scoped_env
    from qwentitan.launch.runtime.console import VERBOSE

    return scoped_env.lacking_set({VERBOSE: "1"} if getattr(args, "verbose", False) else {})


def prepare(args: argparse.Namespace) -> tuple[LaunchPlan, list[str]]:
    """The plan of this `train` and what to print before its ranks start: every check before a
    start passed, its run folder made."""
    from qwentitan.launch.launcher.run_folder import point_latest

    request, new_folder = _request(args)
    plan, said = plan_training(request, folder_given=args.run_dir is not None)
    if new_folder:
        point_latest(plan.run_folder)  # only now: a refused run leaves no folder behind
    return plan, said


def plan_training(request: RunRequest, *, folder_given: bool) -> tuple[LaunchPlan, list[str]]:
    """The checked plan of `request` on this host, and what to print before its ranks start."""
    from qwentitan.launch.launcher.plan import resolve_plan
    from qwentitan.launch.launcher.plan_cli import describe
    from qwentitan.launch.launcher.start import check_before_start

    plan = resolve_plan(request)
    check_before_start(plan, folder_given=folder_given)
    said = [f"qwentitan-launch train: note: {plan.note}"] if plan.note else []
    said += [
        describe(plan),
        f"qwentitan-launch train: {plan.recipe} on {plan.ranks_per_node} "
        f"{plan.topology.device_type} rank(s), {plan.steps} steps, run folder {request.run_dir}",
    ]
    return plan, said


def train_plan(
    plan: LaunchPlan,
    said: list[str],
    *,
    supervise: Callable[[list[str], dict[str, str]], int] | None = None,
) -> int:
    """Start the plan's ranks under `supervise` (default: `supervisor.supervise`), its run
    folder held; then the summary block. Reads only the plan's plain facts: no torch here."""
    from qwentitan.launch.launcher import supervisor
    from qwentitan.launch.launcher.launch_plan import LOGS_FOLDER
    from qwentitan.launch.launcher.run_folder import hold_run_folder
    from qwentitan.launch.runtime.console import for_console
    from qwentitan.launch.tracking.store import end_abandoned_runs

    logs = plan.run_folder / LOGS_FOLDER
    logs.mkdir(parents=True, exist_ok=True)
    (logs / "plan.txt").write_text("".join(f"{line}\n" for line in said), encoding="utf-8")
    for line in said:
        print(for_console(line), flush=True)
    # A start of this folder killed with SIGKILL left its MLflow run RUNNING; end it first.
    ended = end_abandoned_runs(plan.run_folder)
    print(
        "qwentitan-launch train: starting the ranks; each loads torch and torchtitan and builds "
        f"the model before its first line (every line of every rank: {logs}; --verbose shows "
        "them here).",
        flush=True,
    )
    started = time.time()
    remote = plan.checkpoints if plan.checkpoints and "://" in plan.checkpoints else None
    with hold_run_folder(plan.run_folder, remote):
        code = (supervise or supervisor.supervise)(plan.launch_argv(), plan.rank_env())
    checkpoints = plan.checkpoints
    if code != 0 and checkpoints:  # a failed save's step is not there: vouch for none of them
        checkpoints = (
            f"not confirmed, the run failed (--resume takes the newest whole one in {checkpoints})"
        )
    block = _summary_block(plan.summary_file, plan.hf_export_file, checkpoints, started, ended)
    if block is not None:
        print(block, flush=True)
    else:
        for line in ended:
            print(f"qwentitan-launch train: {line}", flush=True)
    return code


def _request(args: argparse.Namespace) -> tuple[RunRequest, bool]:
    """The request of this `train` (this host, one node, its run folder), and whether the run
    folder is a new one of its own."""
    from qwentitan.launch.launcher.plan_cli import request_from_args
    from qwentitan.launch.launcher.remote import (
        canonical_url,
        is_remote,
        local_folder,
        require_backend,
    )
    from qwentitan.launch.launcher.run_folder import check_run_folder, resolved
    from qwentitan.launch.recipes import get_recipe
    from qwentitan.launch.runtime.platforms import host_target

    get_recipe(args.recipe)  # an unknown name is refused before anything slower
    if (args.nodes or 1) > 1:
        raise LaunchError(
            "train runs on this machine only; drop {nodes}, or start each node with "
            "`qwentitan-launch run`.",
            field="nodes",
        )
    instance = args.instance or host_target()
    if args.run_dir is not None and is_remote(args.run_dir):
        url = canonical_url(args.run_dir)  # s3:// only
        require_backend(url)
        check_run_folder(local_folder(url), f"{url}/checkpoint")  # logs and reports stay local
        return request_from_args(args, instance=instance, run_dir=url), False
    folder, new = _run_folder(args.recipe, args.run_dir, args.resume)
    folder = resolved(folder)
    check_run_folder(folder)
    return request_from_args(args, instance=instance, run_dir=str(folder)), new


def _run_folder(recipe: str, given: str | None, resume: str) -> tuple[Path, bool]:
    """`given`, else the latest run of `recipe` when resuming, else a new folder."""
    from qwentitan.launch.launcher.run_folder import new_run_folder, resumable_run_folder

    base = Path("outputs") / recipe
    if given is not None:
        return Path(given), False
    # The newest run that saved a checkpoint: `latest` may be a newer start that saved none.
    found = resumable_run_folder(base) if resume != "fresh" else None
    if found is not None:
        return found, False
    if resume == "latest":
        raise LaunchError(
            f"There is no run of {recipe} with a checkpoint to resume in {base.resolve()}; run "
            "once without {resume} first, or pass the {run_dir} of an earlier run.",
            field="resume",
        )
    return new_run_folder(base), True


def _summary_block(
    path: Path, export: Path, checkpoint_folder: str | None, started: float, ended: list[str]
) -> str | None:
    """The block the metrics rank left for this run (None if it wrote none: a failed start),
    with rank 0's last export of this run (`export`, --hf-every) and the earlier starts whose
    MLflow run this command ended (`ended`)."""
    from qwentitan.launch.tracking.summary import format_summary

    # An earlier run's file (a run folder continued with --resume) is not this run's summary.
    if not path.is_file() or path.stat().st_mtime < started:
        return None
    report = json.loads(path.read_text(encoding="utf-8"))
    if export.is_file() and export.stat().st_mtime >= started:
        report["hf_export"] = json.loads(export.read_text(encoding="utf-8"))
    return format_summary(report, checkpoint_folder, ended)
