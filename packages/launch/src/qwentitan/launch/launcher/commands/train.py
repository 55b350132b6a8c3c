"""`qwentitan-launch train`: train a recipe on this machine, one torchrun process per rank.

`train` is the local preset of the launch plan: it resolves the same `LaunchPlan` as `plan` and
`run` (instance: this host; resume: "fresh", or "latest" with `--resume`), and runs its torchrun
line (`LaunchPlan.launch_argv`) with its rank environment under the same supervisor as `run`,
so `plan --json` shows exactly the line `train` runs.

Everything a user can get wrong is checked before any process starts, and refused in one
sentence (exit 2): the numbers (by argparse), then the plan's own checks (`resolve_plan`: the
recipe, the ranks this host holds, the sequence length, `--stop-after`, every override), every
line of a local dataset, the tokenizer folder, the checkpoints already
in the run folder (under `--resume`: whole, and of this recipe's model; without it: none), and
the free disk the planned checkpoints need. Each fresh run without `--run-dir` gets its own
folder `outputs/RECIPE/<start time>`, and `outputs/RECIPE/latest` points at the newest one,
which `--resume` continues: nothing is ever deleted. When the ranks end, `train` prints one
summary block (`tracking.summary.format_summary`) from RUN_DIR/reports/summary.json, which the
metrics rank wrote at close.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

from qwentitan.launch.base.errors import LaunchError
from qwentitan.launch.launcher.flags import positive
from qwentitan.launch.recipes import get_recipe, recipe_names

NAME = "train"
HELP = (
    "Train a recipe on this machine (default: tiny_dense on 2 ranks, offline corpus, Qwen3 "
    "tokenizer, no download), each run in a new folder outputs/RECIPE/<time>; --resume "
    "continues the latest one."
)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--recipe", default="tiny_dense", help=f"one of {', '.join(recipe_names())}"
    )
    parser.add_argument(
        "--steps", type=positive, help="total steps to reach (default: the recipe's)"
    )
    parser.add_argument(
        "--ranks",
        type=positive,
        help="processes (default: 2 on CPU, or fewer if the host holds fewer; every GPU)",
    )
    parser.add_argument(
        "--resume",
        action="store_true",
        help="continue the newest checkpoint of --run-dir (default: of outputs/RECIPE/latest)",
    )
    parser.add_argument(
        "--seq-len", type=positive, help="tokens per sample (default: the recipe's)"
    )
    parser.add_argument("--local-batch-size", type=positive, help="samples per rank per step")
    parser.add_argument(
        "--dataset", help="`offline`, a c4-style JSON-lines file or folder, or a Hub dataset name"
    )
    parser.add_argument(
        "--tokenizer", help="Hugging Face model folder holding tokenizer.json (default: Qwen3's)"
    )
    parser.add_argument(
        "--run-dir",
        type=Path,
        help="where checkpoints and logs go (default: a new folder under ./outputs/RECIPE/); "
        "one that already holds checkpoints needs --resume",
    )
    parser.add_argument(
        "--stop-after", type=positive, help="stop after this step with a checkpoint (resume later)"
    )
    parser.add_argument(
        "--validate-every",
        type=positive,
        help="validation loss every N steps (default: the recipe's)",
    )
    parser.add_argument(
        "overrides",
        nargs="*",
        metavar="-- OVERRIDE",
        help="after `--`: torchtitan config overrides for every rank, checked before they start, "
        "e.g. `-- --metrics.mlflow.run_name try-1 --metrics.mlflow.experiment mine`",
    )


def run(args: argparse.Namespace) -> int:
    from qwentitan.launch.launcher.plan import resolve_plan
    from qwentitan.launch.launcher.plan_cli import describe
    from qwentitan.launch.launcher.run_folder import (
        check_checkpoints,
        check_free_disk,
        check_run_folder,
        hold_run_folder,
        latest_run_folder,
        new_run_folder,
        point_latest,
        resolved,
    )
    from qwentitan.launch.runtime.data import (
        OFFLINE,
        check_dataset,
        check_tokenizer_folder,
        resolve_dataset,
    )
    from qwentitan.launch.runtime.platforms import host_target
    from qwentitan.launch.runtime.preemption import supervise

    get_recipe(args.recipe)  # an unknown name is refused before anything slower
    if args.tokenizer is not None:
        check_tokenizer_folder(args.tokenizer)

    base = Path("outputs") / args.recipe
    if args.run_dir is not None:
        run_dir = args.run_dir
    elif args.resume:
        run_dir = latest_run_folder(base)
        if run_dir is None:
            raise LaunchError(
                f"There is no run of {args.recipe} to resume in {base.resolve()}; run once "
                "without --resume first, or pass the --run-dir of an earlier run."
            )
    else:
        run_dir = new_run_folder(base)
    run_dir = resolved(run_dir, folder_flag="--run-dir")
    check_run_folder(run_dir, folder_flag="--run-dir")

    plan = resolve_plan(
        args.recipe,
        instance=host_target(),
        ranks_per_node=args.ranks,
        ranks_flag="--ranks",
        seq_len=args.seq_len,
        local_batch=args.local_batch_size,
        steps=args.steps,
        stop_after=args.stop_after,
        dump_folder=str(run_dir),
        # the user's own overrides last, so they win; resolve_plan has torchtitan's parser
        # check them all before any rank starts
        extra_overrides=[*_train_overrides(args), *args.overrides],
        resume="latest" if args.resume else "fresh",
    )
    if args.dataset not in (None, OFFLINE):
        validator = plan.config.validator
        check_dataset(
            resolve_dataset(args.dataset),
            holdout_every=getattr(plan.config.dataloader, "holdout_every", 20),
            validating=bool(validator.enable),
        )
    check_checkpoints(
        plan,
        folder_flag="--run-dir",
        resume_flag="--resume",
        # without --run-dir, a run without --resume gets a new folder
        fresh=None if args.run_dir is not None else "start fresh without --resume",
    )
    check_free_disk(plan, folder_flag="--run-dir")
    if args.run_dir is None and not args.resume:
        point_latest(run_dir)  # only now: a refused run leaves no folder behind

    print(describe(plan), flush=True)
    print(
        f"qwentitan-launch train: {args.recipe} on {plan.ranks_per_node} "
        f"{plan.topology.device_type} rank(s), "
        f"{plan.steps} steps, run folder {run_dir}",
        flush=True,
    )
    started = time.time()
    with hold_run_folder(run_dir, folder_flag="--run-dir"):
        code = supervise(plan.launch_argv(), plan.rank_env())
    summary = _summary_block(
        run_dir, plan.checkpoint_folder if plan.config.checkpoint.enable else None, started
    )
    if summary is not None:
        print(summary, flush=True)
    return code


def _summary_block(run_dir: Path, checkpoint_folder: Path | None, started: float) -> str | None:
    """The block the metrics rank left for this run (None if it wrote none: a failed start)."""
    from qwentitan.launch.tracking.logger import REPORTS_FOLDER
    from qwentitan.launch.tracking.reports import SUMMARY
    from qwentitan.launch.tracking.summary import format_summary

    path = run_dir / REPORTS_FOLDER / f"{SUMMARY}.json"
    # An earlier run's file (a run folder continued with --resume) is not this run's summary.
    if not path.is_file() or path.stat().st_mtime < started:
        return None
    return format_summary(json.loads(path.read_text(encoding="utf-8")), checkpoint_folder)


def _train_overrides(args: argparse.Namespace) -> list[str]:
    """train's own flags as torchtitan overrides (the plan adds the shared ones)."""
    overrides = {
        "--dataloader.dataset": args.dataset,
        "--validator.dataloader.dataset": args.dataset,
        "--hf-assets-path": str(Path(args.tokenizer).resolve()) if args.tokenizer else None,
        "--validator.freq": args.validate_every,
    }
    given = {flag: value for flag, value in overrides.items() if value is not None}
    return [word for flag, value in given.items() for word in (flag, str(value))]
