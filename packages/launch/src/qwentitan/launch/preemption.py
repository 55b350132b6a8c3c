"""Surviving preemption: a signal becomes a checkpoint at the next step boundary and a clean exit.

Spot interruptions (via a SIGTERM from whatever watches the instance metadata) and SLURM
(SIGTERM on preemption or `scancel`, `--signal=USR1@<seconds>` before the time limit) give a
job a short grace period. Two halves:

- in every training rank, `PreemptionWatch` records SIGTERM / SIGUSR1 instead of dying; at the
  next step boundary the trainer asks `stop_requested()`, which all-reduces the flag so every
  rank stops at the same step even when only some received the signal, then saves a full
  checkpoint and returns normally (exit code 0);
- in `qwentitan-launch run`, a supervisor forwards both signals to the ranks, and starts the
  torchrun agent with SIGUSR1 ignored: the agent does not handle it and would die of it. A
  SIGTERM that reaches the agent itself (SLURM signals every process of a step) makes it send
  SIGTERM to the ranks and wait 30 s before SIGKILL: a step plus a checkpoint must fit in that.

A later run with the same dump folder resumes from that checkpoint; torchrun's
`--max-restarts` does the same after a crash, from the last interval checkpoint.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
from collections.abc import Sequence
from types import FrameType

import torch
import torch.distributed as dist

PREEMPTION_SIGNALS = (signal.SIGTERM, signal.SIGUSR1)


class PreemptionWatch:
    """Records preemption signals in this process; `stop_requested()` agrees on them across ranks."""

    def __init__(self, signals: Sequence[signal.Signals] = PREEMPTION_SIGNALS) -> None:
        self.signals = tuple(signals)
        self.received: signal.Signals | None = None
        self._previous: dict[signal.Signals, object] = {}

    def install(self) -> PreemptionWatch:
        for sig in self.signals:
            self._previous[sig] = signal.signal(sig, self._on_signal)
        return self

    def uninstall(self) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)  # type: ignore[arg-type]
        self._previous.clear()

    def _on_signal(self, signum: int, frame: FrameType | None) -> None:
        # Only a flag: the step in flight finishes, collectives stay matched across ranks.
        self.received = signal.Signals(signum)

    def stop_requested(self, device: torch.device | str = "cpu") -> str | None:
        """The reason to stop now, agreed by every rank (one tiny all-reduce), or None."""
        local = 0 if self.received is None else int(self.received)
        agreed = local
        if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
            flag = torch.tensor([local], dtype=torch.int32, device=device)
            dist.all_reduce(flag, op=dist.ReduceOp.MAX)
            agreed = int(flag.item())
        if agreed == 0:
            return None
        return f"{signal.Signals(agreed).name} received (preemption): checkpointing and exiting"


def ignore_sigusr1() -> None:
    """preexec_fn for the torchrun agent, which has no SIGUSR1 handler (see module doc).

    SIGTERM keeps its default: ranks inherit dispositions, and one ignoring SIGTERM before its
    PreemptionWatch is installed could not be stopped by torchrun after a failure.
    """
    signal.signal(signal.SIGUSR1, signal.SIG_IGN)


def ranks_of(agent_pid: int) -> list[int]:
    """Process ids of the training ranks of a torchrun agent: its direct children.

    Not their own children (data-loader workers, compiler processes), which have no handler.
    """
    import psutil

    try:
        return [p.pid for p in psutil.Process(agent_pid).children(recursive=False)]
    except psutil.NoSuchProcess:
        return []


def supervise(argv: Sequence[str], env: dict[str, str]) -> int:
    """Run torchrun (`argv`), forwarding preemption signals to its ranks; its exit code."""
    agent = subprocess.Popen(list(argv), env=env, preexec_fn=ignore_sigusr1)

    def forward(signum: int, frame: FrameType | None) -> None:
        for pid in ranks_of(agent.pid):
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signum)

    previous = {sig: signal.signal(sig, forward) for sig in PREEMPTION_SIGNALS}
    try:
        return agent.wait()
    except KeyboardInterrupt:
        agent.send_signal(signal.SIGINT)
        return agent.wait()
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
