"""The launcher's half of surviving signals: the torchrun agent supervised, every signal passed on.

In `qwentitan-launch train` and `run`, `supervise` owns the process tree: it starts the
torchrun agent in a session of its own (so a terminal's Ctrl-C reaches the launcher only, not
the agent, whose own SIGINT handling would pass SIGINT on to the ranks a second time), forwards
every signal it receives to the ranks (torchrun starts each rank in its own session too, so
nothing else reaches them), and has the kernel send the agent SIGTERM if the launcher dies
(`PR_SET_PDEATHSIG`): the agent then SIGTERMs the ranks, which checkpoint
(`runtime.preemption.PreemptionWatch`). The agent runs with SIGUSR1 ignored: it has no handler
and would die of it. A SIGTERM that reaches the agent itself (SLURM signals every process of a
step) makes it send SIGTERM to the ranks and wait 30 s before SIGKILL: a step plus a checkpoint
must fit in that. The pilot runs each of its children through the same `SignalForwarder`,
passing signals on and stopping after it.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from types import FrameType
from typing import Any

from qwentitan.launch.runtime.preemption import PREEMPTION_SIGNALS

__all__ = [
    "FORWARDED",
    "STOPPED_EXIT",
    "TRAIN_ENTRY",
    "SignalForwarder",
    "ignore_sigusr1",
    "ranks_of",
    "supervise",
]

# torchtitan's own entry point on every rank (`python -m torchtitan.train`); the recipe's
# Trainer.Config builds our Trainer there.
TRAIN_ENTRY = "torchtitan.train"
# What the launcher passes on to the ranks; SIGHUP (terminal closed) becomes SIGTERM there.
FORWARDED = {**{sig: sig for sig in PREEMPTION_SIGNALS}, signal.SIGHUP: signal.SIGTERM}
_PR_SET_PDEATHSIG = 1  # linux/prctl.h
# `supervise(..., stopped_exit=STOPPED_EXIT)`: the ranks stopped on a signal with a checkpoint
# (not at their last step, unless the signal came during it). sysexits' EX_TEMPFAIL: try again.
STOPPED_EXIT = 75
# How often `SignalForwarder` looks up its targets while no signal waits, so that a child dying
# without passing a signal on (a killed torchrun agent) leaves a recent list of them.
_TARGETS_EVERY_S = 1.0
# A terminal's Ctrl-C reaches every process of its foreground group, and `uv run` and nox relay
# it to their child again within a fraction of a second: one keypress can arrive two or three
# times. Signals of one kind this close together are one request; a person's second Ctrl-C,
# which stops at once, comes later.
SAME_REQUEST_S = 1.0


def ignore_sigusr1() -> None:
    """Part of the torchrun agent's preexec_fn: it has no SIGUSR1 handler (see module doc).

    SIGTERM keeps its default: ranks inherit dispositions, and one ignoring SIGTERM before its
    PreemptionWatch is installed could not be stopped by torchrun after a failure.
    """
    signal.signal(signal.SIGUSR1, signal.SIG_IGN)


def _start_agent() -> None:
    """preexec_fn of the torchrun agent: SIGUSR1 ignored, SIGTERM when the launcher dies."""
    ignore_sigusr1()
    if sys.platform == "linux":
        ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, int(signal.SIGTERM), 0, 0, 0)


def ranks_of(agent_pid: int) -> list[int]:
    """Process ids of the training ranks of a torchrun agent: its direct children.

    Not their own children (data-loader workers, compiler processes), which have no handler.
    """
    import psutil

    try:
        return [p.pid for p in psutil.Process(agent_pid).children(recursive=False)]
    except psutil.NoSuchProcess:
        return []


class SignalForwarder:
    """Every FORWARDED signal this process gets, passed on to the processes of the child it runs.

    `targets(child_pid)` names who gets them: a torchrun agent's ranks (`ranks_of`: `supervise`,
    in `train` and `run`), or the child itself (the pilot's child `train`, which passes them on
    to its own ranks). Signals are delivered from `run`'s polling loop rather than the handler,
    so one that arrives before the targets exist (or across a torchrun restart) still reaches
    each of them once. With `interrupting`, a signal means "stop after this child": `run`
    raises KeyboardInterrupt when its child ends, and a signal while no child runs raises it at
    once. Installed on purpose, also where this process started with SIGINT ignored (a
    background job, nox).
    """

    def __init__(
        self,
        targets: Callable[[int], list[int]] = ranks_of,
        *,
        interrupting: bool = False,
        poll_seconds: float = 0.2,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.targets = targets
        self.interrupting = interrupting
        self.poll_seconds = poll_seconds
        self.received: list[signal.Signals] = []
        self.last_targets: list[int] = []  # as last seen, for when the child dies without them
        self._running = False
        self._previous: dict[signal.Signals, Any] = {}
        self._first_of_request: dict[signal.Signals, float] = {}
        self._clock = clock

    def __enter__(self) -> SignalForwarder:
        self._previous = {sig: signal.signal(sig, self._on_signal) for sig in FORWARDED}
        return self

    def __exit__(self, *exc: object) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
        self._previous = {}

    def _on_signal(self, signum: int, _frame: FrameType | None) -> None:
        sig, now = signal.Signals(signum), self._clock()
        if now - self._first_of_request.get(sig, -SAME_REQUEST_S) < SAME_REQUEST_S:
            return  # the same request, relayed once more
        self._first_of_request[sig] = now
        self.received.append(sig)
        if self.interrupting and not self._running:
            raise KeyboardInterrupt

    def run(self, argv: Sequence[str], env: dict[str, str] | None = None) -> int:
        """Run `argv` as this process's only child, forwarding signals, until it exits; its
        exit code (see the module doc)."""
        if self.interrupting and self.received:
            raise KeyboardInterrupt
        delivered: dict[int, int] = {}  # target pid -> how many of `received` it has been sent
        seen_at = -_TARGETS_EVERY_S
        self._running = True
        try:
            child = subprocess.Popen(
                list(argv), env=env, preexec_fn=_start_agent, start_new_session=True
            )
            while True:
                with contextlib.suppress(subprocess.TimeoutExpired):
                    code = child.wait(timeout=self.poll_seconds)
                    break
                # Who the targets are is read at once when a signal waits, and every few
                # seconds else (reading the process table costs where thousands run).
                if self.received or time.monotonic() >= seen_at + _TARGETS_EVERY_S:
                    self.last_targets = self.targets(child.pid) or self.last_targets
                    seen_at = time.monotonic()
                for pid in self.last_targets if self.received else ():
                    for sig in self.received[delivered.get(pid, 0) :]:
                        with contextlib.suppress(ProcessLookupError):
                            os.kill(pid, FORWARDED[sig])
                    delivered[pid] = len(self.received)
        finally:
            self._running = False
        if self.interrupting and self.received:
            raise KeyboardInterrupt
        return code


def supervise(
    argv: Sequence[str],
    env: dict[str, str],
    *,
    poll_seconds: float = 0.2,
    stopped_exit: int = 0,
) -> int:
    """Run torchrun (`argv`) as this process's only child, passing every signal this process
    gets on to the ranks, until the agent exits; its exit code (see the module doc), or
    `stopped_exit` when it ended well after a signal was passed on (the ranks checkpointed and
    stopped: `run` tells that apart from a finished run, so a scheduler can start it again)."""
    with SignalForwarder(ranks_of, poll_seconds=poll_seconds) as forwarder:
        code = forwarder.run(argv, env)
    if code < 0:
        return _agent_killed(signal.Signals(-code), forwarder.last_targets)
    return stopped_exit if code == 0 and forwarder.received else code


def _agent_killed(sig: signal.Signals, ranks: list[int]) -> int:
    """The torchrun agent died of `sig` and could say nothing: its ranks, which would otherwise
    train on as orphans, get the SIGTERM the agent would have sent (they checkpoint at the next
    step boundary); one line; exit code 128 + the signal, as a shell reports it."""
    for pid in ranks:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGTERM)
    os.write(
        2,
        f"qwentitan-launch: the torchrun agent was killed by {sig.name}; its ranks were sent "
        "SIGTERM to stop, and --resume continues from their last checkpoint.\n".encode(),
    )
    return 128 + int(sig)
