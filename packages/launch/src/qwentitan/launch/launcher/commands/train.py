"""`qwentitan-launch train`: train a recipe on this machine, one torchrun process per rank.

`train` is the local preset of the launch plan: the same flags and `RunRequest` as `plan` and
`run`, with this host as the instance, one node, "fresh" as the resume default and a run folder
of its own: each fresh run without `--run-dir` gets `outputs/RECIPE/<start time>`, and
`outputs/RECIPE/latest` points at the newest one, which `--resume` continues (nothing is ever
deleted). It runs the plan's torchrun line under the same checks and supervisor as `run`
(`launcher.start`), so `plan --json` shows exactly the line `train` runs. When the ranks end,
it prints one summary block (`tracking.summary.format_summary`) from
RUN_DIR/reports/summary.json, which the metrics rank wrote at close.

The pilot plans and checks each child `train` in its own process, which has imported torchtitan
already, and hands it over in a file (`--prepared FILE`, not shown in `--help`): the child then
starts its ranks without importing torch and torchtitan again to plan (6-7 CPU-seconds each).
"""

from __future__ import annotations

import argparse
import json
import time
from dataclasses import dataclass, fields
from pathlib import Path

from qwentitan.launch.base import env_defaults
from qwentitan.launch.base.errors import LaunchError
from qwentitan.launch.launcher.plan_cli import SHARED, add_request_flags
from qwentitan.launch.launcher.request import RunRequest

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
    # The pilot's hand-over (see the module): a run it resolved and checked for this process.
    parser.add_argument("--prepared", help=argparse.SUPPRESS)


@dataclass(frozen=True, slots=True)
class Prepared:
    """A checked plan as the supervising process needs it: plain data, no torch object."""

    argv: list[str]
    env: dict[str, str]
    said: list[str]  # printed before the ranks start
    run_dir: str
    checkpoints: str | None
    summary: str  # RUN_DIR/reports/summary.json, which the metrics rank writes at close

    def save(self, path: Path) -> None:
        """For a `train --prepared PATH` this process starts, which inherits its environment:
        the ranks' environment is written as what it adds to this process's, so no variable of
        the shell (a token, a key) lands on disk. Written whole or not at all."""
        from qwentitan.checkpoint.files import atomic_file

        shell = env_defaults.shell()
        record = {field.name: getattr(self, field.name) for field in fields(self)}
        record["env"] = {key: value for key, value in self.env.items() if shell.get(key) != value}
        with atomic_file(path) as tmp:
            tmp.write_text(json.dumps(record), encoding="utf-8")

    @classmethod
    def load(cls, path: str | Path) -> Prepared:
        record = json.loads(Path(path).read_text(encoding="utf-8"))
        return cls(**{**record, "env": {**env_defaults.shell(), **record["env"]}})


def run(args: argparse.Namespace) -> int:
    from qwentitan.launch.launcher.child import in_child
    from qwentitan.launch.launcher.run_folder import hold_run_folder
    from qwentitan.launch.runtime import preemption

    # Resolved and checked in a child process (or by the pilot that started this one): this one
    # supervises the ranks for the whole run and keeps none of torch, torchtitan or the model
    # stack that building the config imports.
    prepared = Prepared.load(args.prepared) if args.prepared else in_child(prepare, args)
    for line in prepared.said:
        print(line, flush=True)
    print(
        "qwentitan-launch train: starting the ranks; each loads torch and torchtitan and builds "
        "the model before its first line.",
        flush=True,
    )
    started = time.time()
    with hold_run_folder(Path(prepared.run_dir)):
        code = preemption.supervise(prepared.argv, prepared.env)
    summary = _summary_block(Path(prepared.summary), prepared.checkpoints, started)
    if summary is not None:
        print(summary, flush=True)
    return code


def prepare(args: argparse.Namespace) -> Prepared:
    """The plan of this `train`, every check before a start passed, its run folder made."""
    from qwentitan.launch.launcher.plan import resolve_plan
    from qwentitan.launch.launcher.plan_cli import describe
    from qwentitan.launch.launcher.run_folder import point_latest
    from qwentitan.launch.launcher.start import check_before_start
    from qwentitan.launch.tracking.logger import REPORTS_FOLDER, SUMMARY

    request, new_folder = _request(args)
    plan = resolve_plan(request)
    check_before_start(plan, request, folder_given=args.run_dir is not None)
    run_dir = plan.run_folder  # local; on S3 (`--run-dir s3://...`) all but the checkpoints
    if new_folder:
        point_latest(run_dir)  # only now: a refused run leaves no folder behind
    said = [f"qwentitan-launch train: note: {plan.note}"] if plan.note else []
    said += [
        describe(plan),
        f"qwentitan-launch train: {plan.recipe} on {plan.ranks_per_node} "
        f"{plan.topology.device_type} rank(s), {plan.steps} steps, run folder {request.run_dir}",
    ]
    checkpoints = plan.checkpoint_folder if plan.config.checkpoint.enable else None
    return Prepared(
        argv=plan.launch_argv(),
        env=plan.rank_env(),
        said=said,
        run_dir=str(run_dir),
        checkpoints=str(checkpoints) if checkpoints else None,
        summary=str(run_dir / REPORTS_FOLDER / f"{SUMMARY}.json"),
    )


def _request(args: argparse.Namespace) -> tuple[RunRequest, bool]:
    """The request of this `train` (this host, one node, its run folder), and whether the run
    folder is a new one of its own."""
    from qwentitan.launch.launcher.plan_cli import request_from_args
    from qwentitan.launch.launcher.remote import is_remote, local_folder, require_backend
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
        require_backend(args.run_dir)
        check_run_folder(local_folder(args.run_dir))  # logs, reports and the lock stay here
        return request_from_args(args, instance=instance, run_dir=args.run_dir.rstrip("/")), False
    folder, new = _run_folder(args.recipe, args.run_dir, args.resume)
    folder = resolved(folder)
    check_run_folder(folder)
    return request_from_args(args, instance=instance, run_dir=str(folder)), new


def _run_folder(recipe: str, given: str | None, resume: str) -> tuple[Path, bool]:
    """`given`, else the latest run of `recipe` when resuming, else a new folder."""
    from qwentitan.launch.launcher.run_folder import latest_run_folder, new_run_folder

    base = Path("outputs") / recipe
    if given is not None:
        return Path(given), False
    latest = latest_run_folder(base) if resume != "fresh" else None
    if latest is not None:
        return latest, False
    if resume == "latest":
        raise LaunchError(
            f"There is no run of {recipe} to resume in {base.resolve()}; run once without "
            "{resume} first, or pass the {run_dir} of an earlier run.",
            field="resume",
        )
    return new_run_folder(base), True


def _summary_block(path: Path, checkpoint_folder: str | None, started: float) -> str | None:
    """The block the metrics rank left for this run (None if it wrote none: a failed start)."""
    from qwentitan.launch.tracking.summary import format_summary

    # An earlier run's file (a run folder continued with --resume) is not this run's summary.
    if not path.is_file() or path.stat().st_mtime < started:
        return None
    return format_summary(json.loads(path.read_text(encoding="utf-8")), checkpoint_folder)
