"""A job launched through its torchrun agent: SIGKILL of one rank -> torchrun restarts the group
from the last checkpoint; SIGINT (Ctrl-C) to the launcher -> a checkpoint at the next step
boundary and exit 75 (stopped, not finished). The process tree is what this tests, so it
launches `qwentitan-launch run` as a process. (Two agents joining one c10d rendezvous as two
nodes, and the same `run` launched again after a signal stopped it continuing to its last step:
the two-node job and the usr1 chain of test_slurm_jobs.py.)"""

import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

from qwentitan.launch.launcher.resume import saved_steps
from qwentitan.launch.launcher.supervisor import STOPPED_EXIT

pytestmark = pytest.mark.slow


def launch(args: list[str], log: Path) -> subprocess.Popen:
    """`qwentitan-launch run ARGS` on the CPU platform, output to `log`."""
    env = dict(os.environ, OMP_NUM_THREADS="1")
    return subprocess.Popen(
        [sys.executable, "-m", "qwentitan.launch.launcher.cli", "run", *args],
        stdout=log.open("w"),
        stderr=subprocess.STDOUT,
        env=env,
    )


def wait_for(predicate, timeout: float, what: str, proc: subprocess.Popen | None = None) -> None:
    deadline = time.time() + timeout
    while not predicate():
        if proc is not None and proc.poll() is not None:
            raise AssertionError(f"process ended (code {proc.returncode}) before {what}")
        if time.time() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.2)


def logged_steps(text: str) -> list[int]:
    """Step numbers of torchtitan's per-step metric lines ("step:  3  loss: ...")."""
    plain = re.sub(r"\x1b\[[0-9;]*m", "", text)  # torchtitan colours its metric lines
    return [int(m.group(1)) for m in re.finditer(r"(?<!validate )step:\s*(\d+)\s+loss", plain)]


def _ranks(run_pid: int) -> list[psutil.Process]:
    """The training ranks: children of the torchrun agent, itself the child of `run`."""
    agents = psutil.Process(run_pid).children()
    return [rank for agent in agents for rank in agent.children()]


def test_sigkill_restarts_from_the_last_checkpoint_and_sigint_stops_with_one(tmp_path):
    """One launch, two faults: SIGKILL of a rank makes torchrun restart the group from the newest
    checkpoint; then SIGINT to `run` checkpoints at the next step boundary and exits 75
    (stopped, not finished). (Launching the same `run` again resumes from that checkpoint and
    runs exactly the remaining steps: the usr1 chain of test_slurm_jobs.py, whose second job
    does that after a USR1 stop.)"""
    run_dir = tmp_path / "run"
    checkpoints = run_dir / "checkpoint"
    args = ["--recipe", "tiny_dense", "--instance", "cpu", "--ranks-per-node", "2",
            "--steps", "10", "--checkpoint-interval", "2", "--max-restarts", "1",
            "--dump-folder", str(run_dir)]  # fmt: skip
    first = tmp_path / "first.log"
    proc = launch(args, first)
    try:
        wait_for(lambda: 2 in saved_steps(checkpoints), 400, "the step-2 checkpoint", proc)
        _ranks(proc.pid)[-1].send_signal(signal.SIGKILL)
        wait_for(
            lambda: "Loading the checkpoint from" in first.read_text(), 400, "the restart", proc
        )
        restarted = first.read_text().index("Loading the checkpoint from")
        # A step trained after the restart, then the launcher alone gets a Ctrl-C (SIGINT), which
        # the ranks treat like SIGTERM: a checkpoint at the next step boundary, then exit 0; `run`
        # exits STOPPED_EXIT, so a scheduler can tell the stop from the end.
        wait_for(lambda: logged_steps(first.read_text()[restarted:]), 400, "a step", proc)
        os.kill(proc.pid, signal.SIGINT)
        code = proc.wait(timeout=300)
    finally:
        if proc.poll() is None:
            proc.kill()
    text = first.read_text()
    assert code == STOPPED_EXIT, text[-4000:]
    # torchrun restarted the group once (its own "failed (exitcode: -9)" line is dropped by our
    # agent); the new ranks of this fresh run loaded the newest checkpoint (on the interval) and
    # went on from the step after it.
    loads = re.findall(r"Loading the checkpoint from \S+/step-(\d+)", text)
    assert len(loads) == 1, loads
    resumed_from = int(loads[0])
    assert resumed_from % 2 == 0 and resumed_from >= 2
    after = logged_steps(text[text.index("Loading the checkpoint from") :])
    stopped_at = after[-1]
    assert after == list(range(resumed_from + 1, stopped_at + 1))
    # SIGINT: a checkpoint at the step the ranks stopped after, before the last step.
    assert "SIGINT received" in text
    assert stopped_at < 10 and saved_steps(checkpoints)[-1] == stopped_at
