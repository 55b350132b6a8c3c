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
- in `qwentitan-launch train` and `run`, `supervise` owns the process tree: it starts the
  torchrun agent in a session of its own (so a terminal's Ctrl-C reaches the launcher only,
  not the agent, whose own SIGINT handling would pass SIGINT on to the ranks a second time),
  forwards every signal it receives to the ranks (torchrun starts each rank in its own session
  too, so nothing else reaches them), and has the kernel send the agent SIGTERM if the launcher
  dies (`PR_SET_PDEATHSIG`): the agent then SIGTERMs the ranks, which checkpoint. The agent runs
  with SIGUSR1 ignored: it has no handler and would die of it. A SIGTERM that reaches the agent
  itself (SLURM signals every process of a step) makes it send SIGTERM to the ranks and wait
  30 s before SIGKILL: a step plus a checkpoint must fit in that. The pilot runs each of its
  child `train`s through the same `SignalForwarder`, passing signals to the child and stopping
  after it.

Two causes that are not signals take the same path: a `--stop-by` deadline
(`runtime.stop_clock`) and a spot interruption notice (`runtime.spot`) call
`PreemptionWatch.request(DEADLINE / SPOT_NOTICE)`, agreed by the same all-reduce.

A later run with the same dump folder resumes from that checkpoint; torchrun's
`--max-restarts` does the same after a crash, from the last interval checkpoint.
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
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch

PREEMPTION_SIGNALS = (signal.SIGTERM, signal.SIGUSR1, signal.SIGINT)
# What the launcher passes on to the ranks; SIGHUP (terminal closed) becomes SIGTERM there.
FORWARDED = {**{sig: sig for sig in PREEMPTION_SIGNALS}, signal.SIGHUP: signal.SIGTERM}
_PR_SET_PDEATHSIG = 1  # linux/prctl.h
# `supervise(..., stopped_exit=STOPPED_EXIT)`: the ranks stopped on a signal with a checkpoint
# (not at their last step, unless the signal came during it). sysexits' EX_TEMPFAIL: try again.
STOPPED_EXIT = 75
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
# How often `SignalForwarder` looks up its targets while no signal waits, so that a child dying
# without passing a signal on (a killed torchrun agent) leaves a recent list of them.
_TARGETS_EVERY_S = 1.0


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
    ) -> None:
        self.targets = targets
        self.interrupting = interrupting
        self.poll_seconds = poll_seconds
        self.received: list[signal.Signals] = []
        self.last_targets: list[int] = []  # as last seen, for when the child dies without them
        self._running = False
        self._previous: dict[signal.Signals, Any] = {}

    def __enter__(self) -> SignalForwarder:
        self._previous = {sig: signal.signal(sig, self._on_signal) for sig in FORWARDED}
        return self

    def __exit__(self, *exc: object) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
        self._previous = {}

    def _on_signal(self, signum: int, _frame: FrameType | None) -> None:
        self.received.append(signal.Signals(signum))
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
