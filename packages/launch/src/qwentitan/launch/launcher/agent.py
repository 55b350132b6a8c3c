"""The torchrun agent that `train` and `run` start: `torch.distributed.run`, ending a failed job
in one line instead of a traceback.

torchrun's own `main` ends a job whose rank failed by raising `ChildFailedError`, whose message
is a table of the failed ranks printed as a traceback, after the rank has already said what went
wrong (a failed save: one sentence, exit code 2). This agent runs torchrun's own `parse_args` and
`run` (same flags, rendezvous, restarts) and ends such a job with one line naming the rank and
with that rank's exit code, so the launcher's exit code is the rank's (2 for a fault the rank
explained, 1 for a crash; 128 + the signal for a rank a signal killed, which said nothing, so
the line names the signal instead of pointing at the rank's message). torchrun's own line for that failure ("failed
(exitcode: N) ...") is dropped, since this one replaces it. A SIGTERM to the agent itself (SLURM
signalling every process, or the launcher dying: its PR_SET_PDEATHSIG) makes torchrun pass it
to the ranks, which checkpoint, and then raise `SignalException`: that too ends in one line
(exit code 128 + the signal) instead of its traceback. The ranks' lines it shows (torchrun's
`--tee`) pass `runtime.console.ConsoleFilter` unless `--verbose`; torchrun's `--log-dir` keeps
them all. `$QWENTITAN_RDZV_ID`, when set, is the
rendezvous id instead of the plan's (the sbatch script sets its job's: two jobs never share one).
"""

from __future__ import annotations

import logging
import sys
from collections.abc import Sequence
from typing import Any

# torchrun's lines that this agent's own one line replaces: (logger, message start).
_REPLACED = (
    ("torch.distributed.elastic.multiprocessing.api", "failed (exitcode"),
    ("torch.distributed.elastic.agent.server.api", "Received %s death signal"),
)


class _Replaced(logging.Filter):
    def __init__(self, start: str) -> None:
        super().__init__()
        self.start = start

    def filter(self, record: logging.LogRecord) -> bool:
        return not str(record.msg).startswith(self.start)


def main(argv: Sequence[str] | None = None) -> int:
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.run import parse_args, run

    from qwentitan.launch.base.env_defaults import RDZV_ID, shell
    from qwentitan.launch.runtime import console

    if not console.verbose():  # before `run`: torchrun's tails write to these streams
        sys.stdout = console.ConsoleFilter(sys.stdout)
        sys.stderr = console.ConsoleFilter(sys.stderr)
    for name, start in _REPLACED:
        logging.getLogger(name).addFilter(_Replaced(start))
    args = parse_args(list(sys.argv[1:] if argv is None else argv))
    args.rdzv_id = shell().get(RDZV_ID) or args.rdzv_id
    try:
        run(args)
    except SignalException as stopped:
        print(
            f"qwentitan-launch: the torchrun agent got {stopped.sigval.name} and stopped the "
            "ranks; --resume continues from their last checkpoint.",
            file=sys.stderr,
            flush=True,
        )
        return 128 + int(stopped.sigval)
    except ChildFailedError as failed:
        rank, failure = _cause(failed)
        print(f"qwentitan-launch: {_ended(rank, failure.exitcode)}", file=sys.stderr, flush=True)
        return 128 - failure.exitcode if failure.exitcode < 0 else failure.exitcode or 1
    return 0


def _cause(failed: Any) -> tuple[int, Any]:
    """The failed rank to name: one a signal other than SIGTERM killed (its peers then fail on
    the lost connection, and torchrun SIGTERMs the rest), else the first that exited with an
    error, else the first killed by SIGTERM. torchrun's own `get_first_failure` goes by
    timestamps in whole seconds, which tie in such a cascade."""
    import signal

    def rank_of(item: tuple[int, Any]) -> tuple[int, int, int]:
        rank, failure = item
        code = failure.exitcode
        kind = 0 if code < 0 and -code != signal.SIGTERM else 1 if code > 0 else 2
        return kind, failure.timestamp, rank

    return min(failed.failures.items(), key=rank_of)


def _ended(rank: int, exitcode: int) -> str:
    """How rank `rank` ended, said once; a rank a signal killed said nothing of its own."""
    if exitcode >= 0:
        return f"rank {rank} ended with exit code {exitcode}; its own message is above."
    import signal

    name = signal.Signals(-exitcode).name if -exitcode in signal.valid_signals() else -exitcode
    return (
        f"rank {rank} was killed by {name}, so it said nothing itself; --resume continues from "
        "the last checkpoint."
    )


if __name__ == "__main__":
    sys.exit(main())
