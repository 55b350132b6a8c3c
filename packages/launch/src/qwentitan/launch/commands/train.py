"""`qwentitan-launch train`: train a recipe on this machine, one torchrun process per rank.

Everything a user can get wrong is checked here, before any process starts, and refused in
one sentence (exit 2): the numbers (by argparse), the recipe, the ranks this host holds, the
sequence length, every line of a local dataset, the tokenizer folder, and under `--resume` the
checkpoint torchtitan would load (whole, and of this recipe's model). The ranks then run
torchtitan's own entry point, `torchtitan.train --module qwentitan.launch.recipes --config R`,
with the choices made here passed as torchtitan overrides.
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
from pathlib import Path
from typing import TYPE_CHECKING

from qwentitan.launch.errors import LaunchError
from qwentitan.launch.flags import positive
from qwentitan.launch.recipes import get_recipe, recipe_names

if TYPE_CHECKING:
    from qwentitan.launch.platforms import Platform

NAME = "train"
HELP = (
    "Train a recipe on this machine (default: tiny_dense on 2 ranks, offline corpus, Qwen3 "
    "tokenizer, no download); --resume continues from the last checkpoint."
)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--recipe", default="tiny_dense", help=f"one of {', '.join(recipe_names())}"
    )
    parser.add_argument(
        "--steps", type=positive, help="total steps to reach (default: the recipe's)"
    )
    parser.add_argument(
        "--ranks", type=positive, help="processes (default: 2, or fewer if the host holds fewer)"
    )
    parser.add_argument(
        "--resume", action="store_true", help="continue from the run folder's last checkpoint"
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
        "--run-dir", type=Path, help="where checkpoints and logs go (default: ./outputs/RECIPE)"
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
    from qwentitan.launch.data import (
        OFFLINE,
        check_dataset,
        check_tokenizer_folder,
        resolve_dataset,
    )
    from qwentitan.launch.platforms import current_platform

    platform = current_platform()
    recipe = get_recipe(args.recipe)
    ranks = args.ranks if args.ranks is not None else min(2, platform.max_ranks)
    platform.check_ranks(ranks)
    config = recipe()  # builds the cached offline assets once, before the ranks need them
    if args.overrides:
        from qwentitan.launch.plan import load_config

        load_config(args.recipe, args.overrides)  # torchtitan's parser refuses a bad one here

    steps = args.steps if args.steps is not None else config.training.steps
    seq_len = args.seq_len if args.seq_len is not None else config.training.seq_len
    if args.stop_after is not None and args.stop_after >= steps:
        raise LaunchError(
            f"--stop-after {args.stop_after} is not before the last step {steps}; pass "
            f"--stop-after {steps - 1} or less, or raise --steps."
        )
    platform.check_seq_len(seq_len, _max_positions(config.model_spec.model))
    if args.dataset not in (None, OFFLINE):
        check_dataset(resolve_dataset(args.dataset))
    if args.tokenizer is not None:
        check_tokenizer_folder(args.tokenizer)

    run_dir = (args.run_dir or Path("outputs") / args.recipe).resolve()
    _prepare_checkpoints(
        run_dir / config.checkpoint.folder,
        resume=args.resume,
        steps=steps,
        recipe=args.recipe,
        config=config,
    )

    overrides = {
        "--dump_folder": str(run_dir),
        "--training.steps": steps,
        "--training.seq_len": seq_len,
        "--training.local_batch_size": args.local_batch_size,
        "--dataloader.dataset": args.dataset,
        "--validator.dataloader.dataset": args.dataset,
        "--hf_assets_path": str(Path(args.tokenizer).resolve()) if args.tokenizer else None,
        "--stop_after": args.stop_after,
        "--validator.freq": args.validate_every,
    }
    command = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        f"--nproc-per-node={ranks}",
        "--local-ranks-filter=0",  # every rank logs the same global figures; show one
        "-m",
        "torchtitan.train",
        "--module",
        "qwentitan.launch.recipes",
        "--config",
        args.recipe,
    ]
    for flag, value in overrides.items():
        if value is not None:
            command += [flag, str(value)]
    command += args.overrides  # last, so a user's own override wins
    print(
        f"qwentitan-launch train: {args.recipe} on {ranks} {platform.name} rank(s), {steps} steps, "
        f"seq len {seq_len}, run folder {run_dir}",
        flush=True,
    )
    return subprocess.run(command, env=_rank_environment(platform, ranks)).returncode


def _max_positions(model: object) -> int:
    """The longest sequence the model's RoPE table holds (native: `max_seq_len`; hf: the flavor's)."""
    flavor = getattr(model, "flavor", None)
    if flavor is not None:
        return flavor.max_position_embeddings
    return model.max_seq_len


def _prepare_checkpoints(
    folder: Path, *, resume: bool, steps: int, recipe: str, config: object
) -> None:
    if resume:
        from qwentitan.launch.resume import check_resumable, state_shapes

        step = check_resumable(folder, state_shapes(config), recipe)
        if step >= steps:
            raise LaunchError(
                f"The checkpoint in {folder} is already at step {step}; pass --steps "
                f"{step + 1} or more to continue."
            )
    elif folder.exists():
        # A fresh run: torchtitan would otherwise load the newest checkpoint it finds there.
        print(
            f"qwentitan-launch train: starting fresh, removing the earlier checkpoints in {folder} "
            "(pass --resume to continue them)",
            flush=True,
        )
        shutil.rmtree(folder)


def _rank_environment(platform: Platform, ranks: int) -> dict[str, str]:
    from qwentitan.launch.platforms import PLATFORM_ENV

    env = dict(os.environ)
    env[PLATFORM_ENV] = platform.name  # every rank trains on what was checked here
    if platform.device_type == "cpu":
        env.setdefault("OMP_NUM_THREADS", str(max(1, platform.max_ranks // ranks)))
    return env
