"""A function run in a short-lived child process, so its imports die with it.

`train` resolves and checks its plan this way: building torchtitan's config imports torch,
torchtitan and the modeling stack (about 0.9 GB and most of a start-up), which the process that
then supervises the ranks for the whole run would otherwise keep.

The child never outlives the call: a signal or an error in the parent while it waits ends the
child (SIGKILL) before it goes on, and the kernel ends it if the parent dies
(`PR_SET_PDEATHSIG`). A child that dies without answering (the out-of-memory killer's SIGKILL)
is one sentence, `LaunchError`.
"""

from __future__ import annotations

import contextlib
import os
import pickle
import signal
import sys
import traceback
from collections.abc import Callable
from typing import Any, TypeVar

from qwentitan.launch.base.errors import LaunchError

T = TypeVar("T")

__all__ = ["in_child"]


def in_child(function: Callable[..., T], *args: Any) -> T:
    """`function(*args)` in a forked child: its result, or its exception raised here. The
    child prints nothing of its own: its result says what to print. Without `fork` (not POSIX)
    it runs in this process."""
    if not hasattr(os, "fork"):
        return function(*args)
    sys.stdout.flush()  # else the child would print this process's buffered lines again
    sys.stderr.flush()
    read, write = os.pipe()
    parent = os.getpid()
    pid = os.fork()
    if pid == 0:  # the child: never returns
        os.close(read)
        _die_with(parent)
        _answer(write, function, args)
    os.close(write)
    try:
        with os.fdopen(read, "rb") as pipe:
            data = pipe.read()
        _, status = os.waitpid(pid, 0)
    except BaseException:  # a signal's exception, Ctrl-C: the child goes with this call
        with contextlib.suppress(OSError):
            os.kill(pid, signal.SIGKILL)
            os.waitpid(pid, 0)
        raise
    if not data:  # the child died before it answered (killed, out of memory)
        how = f"ended with exit code {os.waitstatus_to_exitcode(status)}"
        if os.WIFSIGNALED(status):
            how = f"was killed by {signal.Signals(os.WTERMSIG(status)).name}"
            if os.WTERMSIG(status) == signal.SIGKILL:
                how += " (what the out-of-memory killer sends)"
        raise LaunchError(
            f"The process that resolves the plan {how} before it answered; free memory on this "
            "host, then try again."
        )
    ok, value = pickle.loads(data)
    if not ok:
        raise value
    return value


def _die_with(parent: int) -> None:
    """Have the kernel SIGKILL this (child) process when its parent dies (Linux; elsewhere a
    no-op), and end now if the parent is already gone."""
    with contextlib.suppress(OSError, AttributeError):
        import ctypes

        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    if os.getppid() != parent:
        os._exit(1)


def _answer(write: int, function: Callable[..., Any], args: tuple[Any, ...]) -> None:
    code = 0
    try:
        try:
            payload = pickle.dumps((True, function(*args)))
        except BaseException as error:  # every outcome goes back to the parent, which raises it
            error.add_note("in the plan's process:\n" + traceback.format_exc().rstrip())
            payload = pickle.dumps((False, error))
        with os.fdopen(write, "wb") as pipe:
            pipe.write(payload)
    except BaseException:
        code = 1  # the parent says so: it got no answer
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)
