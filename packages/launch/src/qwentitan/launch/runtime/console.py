"""The ranks' console, quiet about what a user cannot act on: every filter in one place.

Installed when `trainer` is imported, which the recipe module does on every rank before
torchtitan builds the config (where one of these lines is logged) and the Trainer (the rest),
and in the launcher, which builds the same configs. Each line dropped here is either said once
in plain words by qwentitan (the MFU line of `trainer.Trainer`) or carries nothing to act on.
"""

from __future__ import annotations

import logging
import re
import warnings

from qwentitan.launch.base import env_defaults

__all__ = ["NOISE", "QUIET_LOGGERS", "quiet_console"]

# Starts of torchtitan 0.3.0 log lines (all on the root logger) that are dropped, and why.
NOISE: dict[str, str] = {
    # tools/utils.py get_peak_flops: no `lspci` on most hosts and containers; the peak that
    # matters comes from qwentitan's Target, never from lspci.
    "Error running lspci": "qwentitan's Target sets the peak FLOPs",
    # tools/utils.py get_peak_flops: on CPU torchtitan guesses an A100; qwentitan drops MFU
    # there instead and says "MFU: n/a" once (trainer.Trainer).
    "Peak flops undefined for": "MFU: n/a said once by the Trainer",
    # trainer.py: the guessed (or replaced) peak; the Trainer logs the one it uses.
    "Peak FLOPS used for computing MFU": "the Trainer logs the peak it uses",
    # components/checkpointer/base.py: recipes set the flag for when an initial_load_path is
    # given (`--checkpoint.initial_load_path`); without one it is simply unused.
    "initial_load_model_only=True has no effect": "harmless default of the recipes",
    # components/metrics.py ensure_pp_loss_visible asks for the last stage's rank in LOG_RANK
    # (its run_train.sh); the launcher's torchrun line shows that rank (plan_rules.console_rank).
    "Pipeline Parallel loss is not visible": "the console shows the last stage's rank",
    # distributed/utils.py init_distributed: it sets NCCL's variable on every backend, gloo
    # included, and says so; nothing to act on.
    "ENV[TORCH_NCCL_ASYNC_ERROR_HANDLING]": "torchtitan sets it itself, NCCL or not",
    # components/checkpointer: the tokenizer's folder has no index; it only matters to an HF
    # save, which then writes one file, the right choice for a model that fits in one.
    "model.safetensors.index.json not found": "an HF save writes one file: fine",
    # train.py's close on rank 0 and its GC thread's end: bookkeeping of a finished run.
    "Sleeping 2 seconds for other ranks": "bookkeeping at the end",
    "Destroying the purge thread": "bookkeeping at the end",
}

# Loggers other than the root one whose INFO lines are dropped (WARNING and above still show).
QUIET_LOGGERS: dict[str, str] = {
    # MLflow's first write to a new sqlite store: "Creating initial MLflow database tables...".
    "mlflow.store.db.utils": "a new local store is no news",
}

# Python warnings (message regex, category) that are dropped, and why.
_WARNINGS: tuple[tuple[str, type[Warning]], ...] = (
    # Not dropped: torch's "DTensor random operators / manual_seed() may not have complete
    # support on cpu device mesh", which torchtitan's seeding of 2+ CPU ranks prints. It is
    # true: DTensor cannot split a random init across CPU ranks, so qwentitan does not use it
    # for the initial weights there (runtime/whole_init.py).
    # torchdata's StatefulDataLoader calls torch.set_vital, deprecated by torch: not ours to fix.
    ("'set_vital' is deprecated", UserWarning),
    # torchtitan's MoE router asks for float32 autocast, which CPU autocast does not take; the
    # router then simply runs in float32 (tiny_moe's experts run in float32 on CPU anyway).
    ("In CPU autocast, but the target dtype is not supported", UserWarning),
)


# torchtitan colours some of its lines (ANSI escapes), which the starts above leave out.
_COLOUR = re.compile(r"\x1b\[[0-9;]*m")


class _DropNoise(logging.Filter):
    """Drops the lines of `NOISE`; without colour (`env_defaults.colour`) strips the escapes
    from the rest, so files and pipes get plain text."""

    def __init__(self) -> None:
        super().__init__()
        self.colour = True

    def filter(self, record: logging.LogRecord) -> bool:
        message = record.getMessage()
        plain = _COLOUR.sub("", message)
        if any(plain.startswith(start) for start in NOISE):
            return False
        if not self.colour and plain != message:
            record.msg, record.args = plain, ()
        return True


_FILTER = _DropNoise()


def quiet_console() -> None:
    """Drop the lines of `NOISE`, the INFO lines of `QUIET_LOGGERS` and the warnings above;
    colour only where `env_defaults.colour()` says. Calling it again changes nothing.

    The filter sits on the root logger (where torchtitan logs), not on a handler, so it
    survives torchtitan's `init_logger`, which replaces the handlers.
    """
    root = logging.getLogger()
    _FILTER.colour = env_defaults.colour()
    if _FILTER not in root.filters:
        root.addFilter(_FILTER)
    for name in QUIET_LOGGERS:
        logging.getLogger(name).setLevel(logging.WARNING)
    for message, category in _WARNINGS:
        warnings.filterwarnings("ignore", message=message, category=category)
