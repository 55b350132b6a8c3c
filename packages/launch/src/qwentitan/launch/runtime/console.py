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
from typing import Any

from qwentitan.launch.base import env_defaults

__all__ = [
    "LOG_ONLY",
    "NOISE",
    "QUIET_LOGGERS",
    "VERBOSE",
    "ConsoleFilter",
    "for_console",
    "quiet_console",
]

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
    # A run folder on S3: "Found credentials in environment variables.", "Found endpoint for s3
    # via: environment_global." (missing credentials or endpoint are one sentence of ours).
    "aiobotocore.credentials": "where the credentials came from is no news",
    "botocore.credentials": "where the credentials came from is no news",
    "botocore.configprovider": "where the endpoint came from is no news",
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


# -- the console of `train` and `run`: lines written to the run's log only ---------------------
#
# torchrun writes every rank's whole output to RUN_DIR/logs (`--log-dir`); what the console shows
# of the console rank (`--tee`) passes `ConsoleFilter` in the torchrun agent, and the plan block
# passes `for_console` in the launcher. `--verbose` (this variable set) shows every line.
VERBOSE = "QWENTITAN_VERBOSE"

# Lines (searched, colour stripped) that stay in the log only, and why.
LOG_ONLY: dict[str, str] = {
    # the plan's own environment defaults (`plan` and `--verbose` list them; a shell's or a
    # flag's setting still shows)
    r"^env\s+\S+=\S*\s+\(plan\)$": "the plan's defaults: `qwentitan-launch plan` lists them",
    # runtime/data: once per dataset a rank builds (training, then each validation)
    r" - INFO - Preparing qwentitan-\S+ dataset from ": "the corpus is the recipe's",
    # torchtitan's set-up, said by the plan block already (batch, checkpoint folder) or nothing
    # to act on; the mesh, the model's size, a checkpoint loaded and the first step still show
    r" - INFO - (torchtitan version: |Building (?!device mesh)\S+ \S+$|Structured logging -> |Successfully created meshes |"
    r"CPU capacity: |Total parameter count: |Applied \S+ (activation checkpointing )?to the "
    r"model|CPU memory usage for model: |Optimizer \S+ \(model_part|Loading tokenizer from |"
    r"Checkpointing active\. |Trainer is initialized with |No checkpoint was provided|"
    r"Process group destroyed)": "torchtitan's set-up and tear-down",
    # torchtitan's garbage-collection and process-group bookkeeping
    r" - INFO - \[GC\] ": "bookkeeping of torchtitan",
    r" - INFO - Synchronizing and adjusting timeout": "bookkeeping of torchtitan",
    # torch's DTensor redistribution under TP: a note for kernel authors, ~400 characters
    r"_redistribute\.py.*suboptimal": "a note for torch's developers",
    # any Python warning of torch, torchtitan or another library (DTensor on a CPU mesh, the
    # FutureWarnings of selective activation checkpointing, the lr_scheduler's on a resume);
    # the indented lines after it (its source line) go with it
    r"^\S*[/\\](site|dist)-packages[/\\]\S+\.py:\d+: \w*Warning: ": "a library's own warning",
}
# After the rank said why it stops early ("Stopping after step N: ..."), torchtitan's lines for
# the end of a finished run: the stop line says what happened (checkpoint saved, --resume).
_AFTER_A_STOP = (
    " - INFO - Saving a full checkpoint at last step",
    " - INFO - Last step checkpoint completed",
    " - INFO - Training completed",
)
_STOPPED = " - INFO - Stopping after step "
_LOG_ONLY = re.compile("|".join(f"(?:{pattern})" for pattern in LOG_ONLY))
_RANK_PREFIX = re.compile(r"^\[[a-z]*\d+\]:")  # torchrun's `[rank0]:` before each line


def verbose() -> bool:
    return env_defaults.verbose()


class ConsoleFilter:
    """A text stream that passes on the lines `LOG_ONLY` does not name (whole lines only: a
    partial one waits for its end). One per stream: a dropped warning takes the indented lines
    after it along, and a rank's early stop the finished-run lines after it."""

    def __init__(self, out: Any) -> None:  # any text stream
        self.out = out
        self._pending = ""
        self._in_warning = False
        self._stopped = False

    def keep(self, line: str) -> bool:
        plain = _RANK_PREFIX.sub("", _COLOUR.sub("", line.rstrip("\n")), count=1)
        if self._in_warning and plain.startswith((" ", "\t")):
            return False
        self._in_warning = False
        if _LOG_ONLY.search(plain):
            self._in_warning = "Warning: " in plain
            return False
        if _STOPPED in plain:
            self._stopped = True
        return not (self._stopped and any(end in plain for end in _AFTER_A_STOP))

    def write(self, text: str) -> int:
        lines = (self._pending + text).split("\n")
        self._pending = lines.pop()
        kept = [line + "\n" for line in lines if self.keep(line)]
        if kept:
            self.out.write("".join(kept))
        return len(text)

    def flush(self) -> None:
        if self._pending and self.keep(self._pending):  # a part line flushed on purpose: say it
            self.out.write(self._pending)
        self._pending = ""
        self.out.flush()

    def __getattr__(self, name: str) -> Any:  # fileno, encoding, isatty, ...
        return getattr(self.out, name)


def for_console(text: str) -> str:
    """`text` (the plan block, say) without the lines `LOG_ONLY` names, unless `--verbose`."""
    if verbose():
        return text
    console = ConsoleFilter(None)
    return "\n".join(line for line in text.split("\n") if console.keep(line))
