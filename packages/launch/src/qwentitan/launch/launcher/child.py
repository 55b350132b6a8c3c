"""A function run in a short-lived child process, so its imports die with it.

`train` resolves and checks its plan this way: building torchtitan's config imports torch,
torchtitan and the modeling stack (about 0.9 GB and most of a start-up), which the process that
then supervises the ranks for the whole run would otherwise keep.
"""

from __future__ import annotations

import os
import pickle
import sys
import traceback
from collections.abc import Callable
from typing import Any, TypeVar

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
    pid = os.fork()
    if pid == 0:  # the child: never returns
        os.close(read)
        _answer(write, function, args)
    os.close(write)
    with os.fdopen(read, "rb") as pipe:
        data = pipe.read()
    os.waitpid(pid, 0)
    if not data:  # the child died before it answered (killed, out of memory)
        raise RuntimeError("the process that resolves the plan ended without an answer")
    ok, value = pickle.loads(data)
    if not ok:
        raise value
    return value


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
