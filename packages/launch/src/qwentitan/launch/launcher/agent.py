"""The torchrun agent that `train` and `run` start: `torch.distributed.run`, ending a failed job
in one line instead of a traceback.

torchrun's own `main` ends a job whose rank failed by raising `ChildFailedError`, whose message
is a table of the failed ranks printed as a traceback, after the rank has already said what went
wrong (a failed save: one sentence, exit code 2). This agent runs torchrun's own `parse_args` and
`run` (same flags, rendezvous, restarts) and ends such a job with one line naming the rank and
with that rank's exit code, so the launcher's exit code is the rank's (2 for a fault the rank
explained, 1 for a crash or a signal).
"""

from __future__ import annotations

import sys
from collections.abc import Sequence


def main(argv: Sequence[str] | None = None) -> int:
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.run import parse_args, run

    try:
        run(parse_args(list(sys.argv[1:] if argv is None else argv)))
    except ChildFailedError as failed:
        rank, failure = failed.get_first_failure()
        code = failure.exitcode if failure.exitcode > 0 else 1
        how = f"exit code {failure.exitcode}" if failure.exitcode >= 0 else "a signal"
        print(
            f"qwentitan-launch: rank {rank} ended with {how}; its own message is above.",
            file=sys.stderr,
            flush=True,
        )
        return code
    return 0


if __name__ == "__main__":
    sys.exit(main())
