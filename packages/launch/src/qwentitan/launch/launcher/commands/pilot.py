"""`qwentitan-launch pilot`: the implementation paths trained side by side and compared."""

from __future__ import annotations

import argparse
import logging
import sys

from qwentitan.launch.launcher.flags import whole_number
from qwentitan.launch.launcher.pilot.compare import PAIRS, PILOT_LR
from qwentitan.launch.launcher.pilot.mesh import DENSE_LIMIT, MESH, MOE_LIMIT, MOE_TP_LIMIT
from qwentitan.launch.launcher.plan_cli import LAYOUT, add_request_flags, request_from_args

NAME = "pilot"
HELP = (
    "Train each pair of implementation paths from one seeded checkpoint (--mesh: each layout "
    "of the tiny recipes against its baseline) and compare their training and validation loss "
    "curves in MLflow; exit 1 when a pair differs by more than its limit."
)
# The request flags a pilot hands every child `train` (each child has its own recipe and folder).
FIELDS = ("ranks_per_node", *LAYOUT, "seq_len", "local_batch_size", "steps", "run_dir")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_request_flags(parser, FIELDS, defaults={"steps": 20, "ranks_per_node": 2})
    parser.add_argument(
        "--seed", type=whole_number(0), default=0, help="of the checkpoints (--mesh: of each child)"
    )
    parser.add_argument(
        "--lr", type=float, default=PILOT_LR, help=f"every child's (default {PILOT_LR:g})"
    )
    parser.add_argument(
        "--pair",
        action="append",
        choices=[*PAIRS, *MESH],
        help="train only this pair (repeatable); a mesh pair is named after its layout's child",
    )
    parser.add_argument(
        "--mesh",
        action="store_true",
        help="the mesh pilot: tiny_dense under 1 rank, FSDP 2, TP 2, FSDP 2 x TP 2, HSDP 2 x 2 "
        "(and an untied twin under 1 rank and PP 2), tiny_moe and tiny_moe_kernels under FSDP 2, "
        "EP 2 and FSDP 4 x EP 2, tiny_moe under FSDP 2 x TP 2, each from its recipe's seeded "
        f"initialisation on a global batch of 8, against 1 rank (dense, limit {DENSE_LIMIT:g}) or "
        f"tiny_moe's FSDP 2 (MoE, {MOE_LIMIT:g}; under TP {MOE_TP_LIMIT:g}); each child sets its "
        "own --ranks and degrees",
    )
    parser.add_argument("--tracking-uri", default=None)
    parser.add_argument(
        "--perturb",
        metavar="CHILD",
        default=None,
        help="start CHILD (e.g. native) from a copy of its checkpoint with one weight scaled by "
        "1.1 (a mesh child, e.g. tiny_dense.tp2: from the next seed): the pilot must then fail, "
        "which shows that its check can",
    )


def run(args: argparse.Namespace) -> int:
    from qwentitan.launch.launcher.pilot.run import pilot_request, run_pilot

    # MLflow's INFO lines (creating a new sqlite store's tables, migrating it) say nothing a
    # user acts on; its warnings and errors still show.
    logging.getLogger("mlflow").setLevel(logging.WARNING)
    request = request_from_args(args, recipe=pilot_request().recipe)
    try:
        pilot = run_pilot(
            request, args.tracking_uri, pairs=_pairs(args), seed=args.seed, lr=args.lr,
            perturb=args.perturb,
        )  # fmt: skip
    except OSError as error:  # a full disk or a read-only folder, writing checkpoints or the plot
        where = f" ({error.filename})" if error.filename else ""
        print(
            f"pilot: could not write{where}: {error.strerror or error}; free some space or pass "
            "--run-dir on another disk.",
            file=sys.stderr,
        )
        return 2
    except KeyboardInterrupt:
        print("pilot: interrupted; the children that finished are in MLflow.", file=sys.stderr)
        return 130
    return 0 if pilot.passed else 1


def _pairs(args: argparse.Namespace) -> tuple[str, ...]:
    """The pairs asked for: --pair's and, with --mesh, every mesh pair; neither: the paths'."""
    asked = [*(args.pair or ()), *(MESH if args.mesh else ())]
    return tuple(dict.fromkeys(asked)) or tuple(PAIRS)
