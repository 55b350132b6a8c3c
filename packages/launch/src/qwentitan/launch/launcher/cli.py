"""`qwentitan-launch`: one subcommand per module of `qwentitan.launch.launcher.commands`.

A command module defines `NAME`, `HELP`, `add_arguments(parser)` and `run(args) -> int`.
Errors a user can cause become one sentence on stderr and exit code 2, never a traceback; a
sentence about a request field names it by the flag the user typed (`plan_cli.phrasing`).
A SIGTERM or SIGHUP before any rank runs (while the launcher plans and checks; once the ranks
run, `supervise` forwards them) unwinds the command like Ctrl-C, so its temporary files go, and
ends it in one line with exit code 128 + the signal.
"""

from __future__ import annotations

import argparse
import importlib
import pkgutil
import signal
import sys
from collections.abc import Sequence

from qwentitan.launch.base.errors import LaunchError
from qwentitan.launch.launcher import commands
from qwentitan.launch.launcher.plan_cli import HintingParser, phrasing


def user_errors() -> tuple[type[BaseException], ...]:
    """Exception types that carry a user-fixable message, from every qwentitan package that has
    been loaded: an error class whose module was never imported cannot have been raised, and
    importing one to find out would import its package (`qwentitan.modeling`: torch and
    torchtitan, seconds of start-up) before a one-line refusal."""
    found: list[type[BaseException]] = [LaunchError]
    for module, name in (
        ("qwentitan.modeling.errors", "ModelingError"),
        ("qwentitan.checkpoint.errors", "CheckpointError"),
        ("qwentitan.kernels.errors", "KernelError"),
    ):
        error = getattr(sys.modules.get(module), name, None)
        if isinstance(error, type):
            found.append(error)
    return tuple(found)


def error_sentence(args: argparse.Namespace, error: BaseException) -> str:
    """A user error as the command says it: a request field named by the flag the user typed."""
    return str(error.phrased(phrasing(args)) if isinstance(error, LaunchError) else error)


def build_parser() -> argparse.ArgumentParser:
    parser = HintingParser(
        prog="qwentitan-launch",
        description="Plan, check and run Qwen3 training with torchtitan (Trainium2, CUDA or CPU).",
    )
    sub = parser.add_subparsers(
        dest="command", required=True, metavar="COMMAND", parser_class=HintingParser
    )
    for info in sorted(pkgutil.iter_modules(commands.__path__), key=lambda m: m.name):
        module = importlib.import_module(f"{commands.__name__}.{info.name}")
        command = sub.add_parser(module.NAME, help=module.HELP, description=module.HELP)
        module.add_arguments(command)
        command.set_defaults(_run=module.run)
    return parser


class _Stopped(BaseException):
    """A SIGTERM / SIGHUP: a BaseException, as KeyboardInterrupt, so no `except Exception`
    (a preflight check's) takes it for a failure and carries on."""


def _stop(signum: int, _frame: object) -> None:
    raise _Stopped(signal.Signals(signum))


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    previous = {sig: signal.signal(sig, _stop) for sig in (signal.SIGTERM, signal.SIGHUP)}
    try:
        return _run(args)
    except _Stopped as stopped:
        sig = stopped.args[0]
        print(
            f"qwentitan-launch {args.command}: stopped by {sig.name}; run it again.",
            file=sys.stderr,
        )
        return 128 + int(sig)
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


def _run(args: argparse.Namespace) -> int:
    try:
        return int(args._run(args) or 0)
    except user_errors() as error:
        print(f"qwentitan-launch {args.command}: {error_sentence(args, error)}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        # Ctrl-C before any rank started (once they run, `train` / `run` forward it to them).
        print(
            f"qwentitan-launch {args.command}: interrupted (Ctrl-C); run it again.", file=sys.stderr
        )
        return 2


if __name__ == "__main__":
    sys.exit(main())
