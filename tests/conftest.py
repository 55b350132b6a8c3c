"""Every test runs hermetically: caches, MLflow stores and stray outputs land in pytest's temp
folder, never in the checkout or the user's home, and MLflow is off unless a test turns it on.

Environment variables are how these settings reach subprocesses (torchrun ranks inherit them),
so they are set for the whole session; a test about tracking sets its own.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import shutil
import subprocess
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path

import pytest

# Files whose tests share a session fixture's training: one worker runs them all, so it trains
# once. Every other file is a group of its own.
SAME_WORKER = {
    "tests/integration/test_mlflow_ui.py": "trained_tiny",
    "tests/integration/test_trn2_preflight.py": "trained_tiny",
}


@pytest.hookimpl(optionalhook=True)  # a hook of pytest-xdist, which a run may not load
def pytest_xdist_make_scheduler(config: pytest.Config, log: object) -> object:
    """Under pytest-xdist (`-n 2`, as CI runs) a file's tests stay on one worker, so a module
    fixture's training runs once, and the files of SAME_WORKER share one. xdist's own
    `--dist loadgroup` no longer groups on pytest >= 9.2 (it renames `item._nodeid`, which
    pytest's nodeid no longer reads), so the grouping is done here, by file, in one place."""
    from xdist.scheduler import LoadScopeScheduling

    class ByFile(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            path = nodeid.split("::", 1)[0]
            return SAME_WORKER.get(path, path)

    return ByFile(config, log)


@pytest.fixture(scope="session")
def training_slot(
    tmp_path_factory: pytest.TempPathFactory,
) -> Callable[..., contextlib.AbstractContextManager]:
    """`with training_slot(ranks):` a core of this machine per rank, shared by pytest-xdist's
    workers: a training on all the cores runs alone (two at once would only slow each other, and
    stretch the signal tests' waits), while two one-rank trainings on a 2-core machine run side by
    side instead of one leaving a core idle. A lock file per core in the folder all workers share;
    a training takes its cores all at once or waits, holding none. Without xdist, locks nobody
    else takes."""
    shared = tmp_path_factory.getbasetemp()
    if os.environ.get("PYTEST_XDIST_WORKER"):
        shared = shared.parent
    cores = [shared / f"core-{n}.lock" for n in range(os.cpu_count() or 1)]

    @contextlib.contextmanager
    def slot(ranks: int | None = None) -> Iterator[None]:
        wanted = len(cores) if ranks is None else max(1, min(ranks, len(cores)))
        held: list = []
        try:
            while True:
                for core in cores:
                    handle = core.open("w")
                    try:
                        fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
                    except BlockingIOError:
                        handle.close()
                        continue
                    held.append(handle)
                    if len(held) == wanted:
                        break
                if len(held) == wanted:
                    break
                for handle in held:  # not enough free: hold none while waiting
                    handle.close()
                held = []
                time.sleep(0.2)
            yield
        finally:
            for handle in held:
                handle.close()

    return slot


@pytest.fixture(scope="session")
def new_mlflow_store(tmp_path_factory: pytest.TempPathFactory) -> Callable[[Path], str]:
    """`new_mlflow_store(folder)`: the URI of a new, empty sqlite MLflow store, folder/mlflow.db.
    Each is a copy of one store MLflow created once per session: its schema migrations cost
    seconds of CPU per store. The tests of a store's own creation (two first writers at once, a
    training that keeps MLflow's creation lines off the console) let MLflow create theirs."""
    made: list[Path] = []

    def new(folder: Path) -> str:
        if not made:
            from mlflow import MlflowClient

            made.append(tmp_path_factory.mktemp("mlflow-store") / "mlflow.db")
            MlflowClient(f"sqlite:///{made[0]}").search_experiments()  # creates and migrates it
        path = folder / "mlflow.db"
        shutil.copyfile(made[0], path)
        return f"sqlite:///{path}"

    return new


@pytest.fixture(scope="session", autouse=True)
def hermetic_environment(tmp_path_factory: pytest.TempPathFactory):
    root = tmp_path_factory.mktemp("session")
    with pytest.MonkeyPatch.context() as patch:
        # One tokenizer / corpus build per test session, shared by its tests and their ranks.
        patch.setenv("QWENTITAN_CACHE", str(root / "cache"))
        patch.setenv("QWENTITAN_MLFLOW", "off")
        patch.setenv("MLFLOW_TRACKING_URI", f"sqlite:///{root / 'mlflow.db'}")
        # No rank polls a real instance metadata service for spot notices (runtime.spot); the
        # tests of the watcher point it at a loopback stand-in.
        patch.setenv("AWS_EC2_METADATA_DISABLED", "true")
        # Libraries' own caches and settings (Hugging Face, Chromium's profile helpers); uv's
        # stays the machine's (it follows XDG_CACHE_HOME otherwise): the installs the tests
        # rehearse take their wheels from it as a user's would, where an empty cache downloaded
        # and unpacked PyPI's torch again (19 CPU-s, test_trn2_install.py).
        if "UV_CACHE_DIR" not in os.environ and (uv := shutil.which("uv")):
            where = subprocess.run([uv, "cache", "dir"], capture_output=True, text=True)
            if where.returncode == 0 and where.stdout.strip():
                patch.setenv("UV_CACHE_DIR", where.stdout.strip())
        patch.setenv("HF_HOME", str(root / "huggingface"))
        patch.setenv("XDG_CACHE_HOME", str(root / "xdg-cache"))
        patch.setenv("XDG_CONFIG_HOME", str(root / "xdg-config"))
        # Relative defaults (./outputs, ./mlflow.db, ./mlruns) resolve here, not in the checkout.
        patch.chdir(root)
        yield root


@contextlib.contextmanager
def _output_to(path: Path) -> Iterator[None]:
    """Send this process's stdout and stderr file descriptors (so its children's) to `path`."""
    sys.stdout.flush()
    sys.stderr.flush()
    saved = os.dup(1), os.dup(2)
    with path.open("w") as out:
        os.dup2(out.fileno(), 1)
        os.dup2(out.fileno(), 2)
        try:
            yield
        finally:
            sys.stdout.flush()
            sys.stderr.flush()
            for fd, copy in zip((1, 2), saved, strict=True):
                os.dup2(copy, fd)
                os.close(copy)


def _ranks(argv: Sequence[str]) -> int | None:
    """The ranks `train ARGV` starts on this host (its last --ranks), or None (its default)."""
    ranks = None
    for i, arg in enumerate(argv):
        if arg == "--ranks" and i + 1 < len(argv):
            ranks = int(argv[i + 1])
        elif arg.startswith("--ranks="):
            ranks = int(arg.split("=", 1)[1])
    return ranks


def _train(argv: Sequence[str], log: Path) -> tuple[int, str]:
    from unittest import mock

    from qwentitan.launch.launcher import child, cli

    # The plan resolved here, in a process that holds torch already (a `train` started from a
    # shell resolves it in a forked child, so that its supervising process keeps none).
    in_process = mock.patch.object(child, "in_child", lambda function, *args: function(*args))
    with _output_to(log), in_process:
        code = cli.main(["train", *argv])
    return code, log.read_text()


@pytest.fixture(scope="session")
def train_in_process(training_slot) -> Callable[..., tuple[int, str]]:
    """`train(argv, log)`: `qwentitan-launch train ARGV` called in this process (torchrun and
    the ranks are still processes); returns the exit code and everything the launcher and its
    ranks printed, which is also left in the file `log`. For tests whose subject is not the
    launcher's process tree. `at_start()`, if given, returns flags added once the training's
    cores are held: a deadline counted from the training's start, not from a wait for a core."""

    def train(
        argv: Sequence[str], log: Path, at_start: Callable[[], Sequence[str]] | None = None
    ) -> tuple[int, str]:
        with training_slot(_ranks(argv)):
            return _train([*argv, *(at_start() if at_start else ())], log)

    return train
