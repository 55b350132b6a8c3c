"""How a rank ends: without torchtitan's closing sleep, and before the native teardown, which
can abort it.

torchtitan 0.3.0's `Trainer.train()` ends with `time.sleep(2)` on rank 0 "for other ranks to
complete". On one node nothing waits on it: every collective of the run, the last checkpoint
included, has completed on every rank when `train()` returns, and torchrun's agent waits for all
its ranks. So `Trainer.train` runs torchtitan's loop with `without_the_closing_sleep()`: 2 s off
the end of every one-node run. Across nodes the pause stays: there one node's agent holds the
rendezvous store the other agents still use to leave it, and a two-node SLURM run on the
development machine without the pause logged that the other agent could not reach it to shut
the rendezvous down (a warning; the job completed).

Rarely, a rank that had trained, saved its checkpoint, closed the trainer and destroyed its
process group then died of SIGABRT while the interpreter tore down: "terminate called without an
active exception", no Python frame (a C++ thread object destroyed while still joinable; seen once
in the 857 rank logs torchrun left on the development machine, torch 2.14.1 over gloo, rank 1
of 2 while rank 0 was in torchtitan's 2 s end-of-training sleep). torchrun then reports the rank
as failed and the run as failed, after everything was written. So a rank torchrun started whose
training ended well runs Python's exit handlers (logging's flush, torch's compile-worker
shutdown, ...) and then leaves with exit code 0 without the native teardown. Where training or
the teardown in torchtitan's `main` raised, nothing changes: Python reports it and exits 1 as
before.
"""

from __future__ import annotations

import atexit
import contextlib
import os
import sys
import time
from collections.abc import Iterator

from qwentitan.launch.base import env_defaults


def leave_cleanly_after_training() -> None:
    """Called when `Trainer.train()` returned: at exit, skip the native teardown if the rank
    ended well (see the module doc). Only in a process torchrun's agent started, whose exit code
    it reports as the rank's: a program that trains in its own process (a notebook, a script)
    keeps its own exit."""
    import torch.distributed

    if torch.distributed.is_torchelastic_launched():
        atexit.register(_leave)


def _leave() -> None:
    # An exception that ended torchtitan's main was printed before exit handlers run.
    if getattr(sys, "last_value", None) is not None or getattr(sys, "last_exc", None) is not None:
        return
    # Still initialized: torchtitan's main did not reach its destroy_process_group.
    dist = sys.modules.get("torch.distributed")
    if dist is not None and dist.is_available() and dist.is_initialized():
        return
    atexit.unregister(_leave)
    # The handlers registered before this one, newest first, as the interpreter would run them:
    # Python has no public call for that, and os._exit below skips them otherwise.
    atexit._run_exitfuncs()
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(Exception):
            stream.flush()
    os._exit(0)


class _TimeWithoutSleep:
    """The time module, but `sleep` returns at once."""

    def __getattr__(self, name: str) -> object:
        return getattr(time, name)

    @staticmethod
    def sleep(seconds: float) -> None:
        del seconds


@contextlib.contextmanager
def without_the_closing_sleep() -> Iterator[None]:
    """While torchtitan's `Trainer.train()` runs on ranks that are all on one node (torchrun's
    WORLD_SIZE equal to its LOCAL_WORLD_SIZE), its module's `time` sleeps no more (see the
    module doc); `train()` has no other sleep and its timers are the time module's.

    Besides `platforms.use_platform`, the one place qwentitan rebinds a torchtitan global, for
    the length of `train()`: torchtitan has no seam for this sleep (it is inline at the end of
    `train()`, after the loop), and the alternative, a copy of `train()`'s loop, would drift from
    torchtitan's."""
    from torchtitan import trainer

    if env_defaults.world_size() != env_defaults.local_world_size():
        yield
        return
    trainer.time = _TimeWithoutSleep()
    try:
        yield
    finally:
        trainer.time = time
