"""Argument types every command shares: a number is range-checked where argparse reads it.

`whole_number(low, high)` is the `type=` of every numeric flag, so `--seq-len 0`, `--port 99999`
or `--grace-seconds -5` are refused by argparse itself, before a plan is resolved or a rank
starts. The CLI's parsers are `OneLineErrorParser`s: such a refusal is one line on stderr with
exit code 2, the same shape as a `LaunchError`.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable
from typing import NoReturn

# SLURM's `--signal=SIG@TIME` takes TIME in 0..65535 seconds (`get_signal_opts` in
# SchedMD/slurm, src/common/proc_args.c, refuses more); a TCP port is 1..65535.
MAX_PORT = 65535
MAX_SIGNAL_SECONDS = 65535


def whole_number(low: int, high: int | None = None) -> Callable[[str], int]:
    """An argparse `type=` accepting integers in low..high (no upper bound when `high` is None)."""
    wanted = (
        f"a whole number from {low} to {high}"
        if high is not None
        else f"a whole number of {low} or more"
    )

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(
                f"{text!r} is not a whole number; pass {wanted}."
            ) from None
        if value < low or (high is not None and value > high):
            raise argparse.ArgumentTypeError(f"{value} is out of range; pass {wanted}.")
        return value

    return parse


positive = whole_number(1)
non_negative = whole_number(0)
port = whole_number(1, MAX_PORT)


class OneLineErrorParser(argparse.ArgumentParser):
    """An ArgumentParser whose usage errors are one line on stderr and exit code 2.

    argparse would print the whole usage block first; this gives the same shape as a
    `LaunchError`. `error` is the method argparse documents for overriding.
    """

    def error(self, message: str) -> NoReturn:
        hint = self.hint(message)
        if hint:
            message += f"; {hint}."
        elif not message.endswith("."):
            message += f"; see {self.prog} --help."
        self.exit(2, f"{self.prog}: {message}\n")

    def hint(self, message: str) -> str:
        """What to add to a usage error instead of `see --help` ("": nothing)."""
        return ""
