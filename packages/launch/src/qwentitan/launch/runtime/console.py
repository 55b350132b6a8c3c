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

__all__ = ["NOISE", "quiet_console"]

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
}

# Python warnings (message regex, category) that are dropped, and why.
_WARNINGS: tuple[tuple[str, type[Warning]], ...] = (
    # Not dropped: torch's "DTensor random operators / manual_seed() may not have complete
    # support on cpu device mesh", which torchtitan's seeding of 2+ CPU ranks prints. It is
    # true: DTensor cannot split a random init across CPU ranks, so qwentitan does not use it
    # for the initial weights there (runtime/whole_init.py).
    # torchdata's StatefulDataLoader calls torch.set_vital, deprecated by torch: not ours to fix.
    ("'set_vital' is deprecated", UserWarning),
)


# torchtitan colours some of its lines (ANSI escapes), which the starts above leave out.
_COLOUR = re.compile(r"\x1b\[[0-9;]*m")


class _DropNoise(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        message = _COLOUR.sub("", record.getMessage())
        return not any(message.startswith(start) for start in NOISE)


_FILTER = _DropNoise()


def quiet_console() -> None:
    """Drop the lines of `NOISE` and the warnings above; calling it again changes nothing.

    The filter sits on the root logger (where torchtitan logs), not on a handler, so it
    survives torchtitan's `init_logger`, which replaces the handlers.
    """
    root = logging.getLogger()
    if _FILTER not in root.filters:
        root.addFilter(_FILTER)
    for message, category in _WARNINGS:
        warnings.filterwarnings("ignore", message=message, category=category)
