"""Surviving signals: a signal becomes a checkpoint at the next step boundary and a clean exit.

Spot interruptions (via a SIGTERM from whatever watches the instance metadata), SLURM
(SIGTERM on preemption or `scancel`, `--signal=USR1@<seconds>` before the time limit) and a
user's Ctrl-C (SIGINT) all give a job a short grace period. Two halves:

- in every training rank, `PreemptionWatch` records SIGTERM / SIGUSR1 / SIGINT instead of
  dying; at the next step boundary the trainer asks `stop_requested()`, which all-reduces the
  flag so every rank stops at the same step even when only some received the signal, then
  saves a full checkpoint and returns normally (exit code 0). A second SIGINT stops the rank
  at once with one line and exit code 130, as a user pressing Ctrl-C twice expects (no
  checkpoint of this step: `--resume` continues from the previous one);
- in `qwentitan-launch train` and `run`, the launcher's supervisor
  (`launcher.supervisor`) passes every signal it receives on to the ranks.

Two causes that are not signals take the same path: a `--stop-by` deadline
(`runtime.stop_clock`) and a spot interruption notice (`runtime.spot`) call
`PreemptionWatch.request(DEADLINE / SPOT_NOTICE)`, agreed by the same all-reduce.

A later run with the same dump folder resumes from that checkpoint; torchrun's
`--max-restarts` does the same after a crash, from the last interval checkpoint.
"""

from __future__ import annotations

import os
import signal
import time
from collections.abc import Sequence
from types import FrameType
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

PREEMPTION_SIGNALS = (signal.SIGTERM, signal.SIGUSR1, signal.SIGINT)
# A signal still pending this long in a loop between two step boundaries means the rank is stuck
# there (reading data, validating); `stop_if_overdue` then ends it at once. A step of the
# tiny recipes takes about a second on a CPU; torchrun's agent SIGKILLs 30 s after a SIGTERM.
OVERDUE_SECONDS = 20.0
# Stop causes that are not signals, all-reduced with the signal numbers (MAX, so above them):
# the `--stop-by` budget (`runtime.stop_clock`) and a spot notice (`runtime.spot`).
DEADLINE = 100
SPOT_NOTICE = 101
CAUSES = {
    DEADLINE: ("deadline", "--stop-by deadline: no time for another step and a save"),
    SPOT_NOTICE: ("spot", "spot interruption notice from the instance metadata service"),
}
_active: PreemptionWatch | None = None


class PreemptionWatch:
    """Records preemption signals in this process; `stop_requested()` agrees on them across ranks."""

    def __init__(self, signals: Sequence[signal.Signals] = PREEMPTION_SIGNALS) -> None:
        self.signals = tuple(signals)
        self.received: signal.Signals | None = None
        self.requested: int | None = None  # a cause that is not a signal (`request`)
        self.agreed: int | None = None  # the cause the last `stop_requested` agreed on
        self.overdue_from: float | None = None  # see stop_if_overdue
        self._previous: dict[signal.Signals, object] = {}

    def install(self) -> PreemptionWatch:
        global _active
        for sig in self.signals:
            self._previous[sig] = signal.signal(sig, self._on_signal)
        _active = self
        return self

    def uninstall(self) -> None:
        global _active
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)  # type: ignore[arg-type]
        self._previous.clear()
        if _active is self:
            _active = None

    def _on_signal(self, signum: int, frame: FrameType | None) -> None:
        if signum == signal.SIGINT and self.received is not None:
            # Ctrl-C twice: stop now, without the checkpoint, and without a traceback per rank
            # (a KeyboardInterrupt would unwind through torchtitan and print one on every rank).
            os.write(
                2,
                b"Stopped at once by a second Ctrl-C, without saving this step; "
                b"--resume continues from the last checkpoint.\n",
            )
            os._exit(128 + signal.SIGINT)
        # Only a flag: the step in flight finishes, collectives stay matched across ranks.
        self.received = signal.Signals(signum)
        if signum == signal.SIGUSR1:
            # One is enough. Python resets its handlers to the default as it exits, so a later
            # USR1 (the sbatch script passes the time limit's on every 2 s) would kill the rank
            # after its checkpoint, and torchrun would restart it.
            signal.signal(signal.SIGUSR1, signal.SIG_IGN)

    def request(self, cause: int) -> None:
        """Ask for a stop at the next step boundary for a cause that is not a signal (DEADLINE,
        SPOT_NOTICE); safe from another thread: one attribute, as a signal handler sets one."""
        self.requested = max(self.requested or 0, cause)

    def stop_requested(self, device: torch.device | str = "cpu") -> str | None:
        """The reason to stop now, agreed by every rank (one tiny all-reduce), or None."""
        local = max(0 if self.received is None else int(self.received), self.requested or 0)
        agreed = local
        # torch only here: the launcher's supervising side (and the CLI's --help) imports this
        # module for its signals and exit code, and must not pay torch's import.
        import torch
        import torch.distributed as dist

        if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
            flag = torch.tensor([local], dtype=torch.int32, device=device)
            dist.all_reduce(flag, op=dist.ReduceOp.MAX)
            agreed = int(flag.item())
        if agreed == 0:
            return None
        self.agreed = agreed
        return f"{describe_cause(agreed)}: checkpointing and exiting"


def describe_cause(cause: int) -> str:
    """A stop cause (a signal number, DEADLINE or SPOT_NOTICE) in words."""
    if cause in CAUSES:
        return CAUSES[cause][1]
    return f"{signal.Signals(cause).name} received"


def cause_kind(cause: int) -> str:
    """`deadline`, `spot` or `signal`: the word the stop report and MLflow tag carry."""
    return CAUSES[cause][0] if cause in CAUSES else "signal"


def stop_if_overdue(where: str, *, seconds: float = OVERDUE_SECONDS) -> None:
    """Called from loops between step boundaries: end this rank at once (one line, exit code
    128 + signal) if the installed watch's signal has waited `seconds` for a boundary.

    The wait counts from the first such call after the signal: one that came while the rank was
    still starting (a SLURM time limit at the start of a short job) is honoured after step 1."""
    watch = _active
    if watch is None or watch.received is None:
        return
    now = time.monotonic()
    if watch.overdue_from is None:
        watch.overdue_from = now
    if now - watch.overdue_from < seconds:
        return
    name = watch.received.name
    os.write(
        2,
        f"Stopped by {name} while {where}: no step boundary came within {seconds:g} s, so this "
        "step was not saved; --resume continues from the last checkpoint.\n".encode(),
    )
    os._exit(128 + int(watch.received))
