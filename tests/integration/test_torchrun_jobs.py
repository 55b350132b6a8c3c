"""Jobs launched through torchrun agents: two agents on this machine join one c10d rendezvous
over loopback as two "nodes"; SIGKILL of one rank -> torchrun restarts the group from the last
checkpoint; SIGINT (Ctrl-C) to the launcher -> a checkpoint at the next step boundary, clean exit, and a resume continues
from it. The process tree is what these test, so they launch `qwentitan-launch run` as a process."""

import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest
from torch.distributed.checkpoint import FileSystemReader

from qwentitan.launch.launcher.resume import saved_steps
from qwentitan.launch.runtime.preemption import STOPPED_EXIT

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


def test_two_nodes_of_one_rank_train_the_tiny_moe_recipe(tmp_path, free_port):
    port = free_port()
    run_dir = tmp_path / "run"
    common = [
        "--recipe", "tiny_moe", "--instance", "cpu", "--ranks-per-node", "1",
        "--nnodes", "2", "--rdzv-endpoint", f"127.0.0.1:{port}",
        "--steps", "3", "--dump-folder", str(run_dir),
    ]  # fmt: skip
    logs = [tmp_path / f"node{k}.log" for k in (0, 1)]
    nodes = [launch(common, logs[k]) for k in (0, 1)]
    codes = [n.wait(timeout=600) for n in nodes]
    text = [log.read_text() for log in logs]
    assert codes == [0, 0], text[0][-3000:] + text[1][-3000:]
    # Each node's plan: one rank here, world size 2 over the two nodes.
    assert all("ranks         2 = 2 x 1 per node" in t for t in text)
    # Global rank 0 (on whichever node joined first: c10d numbers them) trained all three steps
    # with FSDP over both nodes.
    assert [1, 2, 3] in [logged_steps(t) for t in text]
    checkpoint = run_dir / "checkpoint"
    assert saved_steps(checkpoint) == [3]
    # DCP writes one shard file per rank: two ranks took part.
    shards = sorted(p.name for p in (checkpoint / "step-3").glob("*.distcp"))
    assert len(shards) == 2, shards
    # The MoE trained end to end: its routed experts and router are in the checkpoint.
    saved = FileSystemReader(checkpoint / "step-3").read_metadata().state_dict_metadata
    assert any(".moe.routed_experts." in key for key in saved), sorted(saved)[:20]
    assert any(".moe.router.gate." in key for key in saved), sorted(saved)[:20]


def _ranks(run_pid: int) -> list[psutil.Process]:
    """The training ranks: children of the torchrun agent, itself the child of `run`."""
    agents = psutil.Process(run_pid).children()
    return [rank for agent in agents for rank in agent.children()]


def test_sigkill_restarts_from_the_last_checkpoint_sigint_stops_with_one_and_resume_ends(
    tmp_path,
):
    """One launch, two faults: SIGKILL of a rank makes torchrun restart the group from the newest
    checkpoint; then SIGINT to `run` checkpoints at the next step boundary and exits 75
    (stopped, not finished);
    a second launch resumes from that checkpoint and runs exactly the remaining steps."""
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

    second = tmp_path / "second.log"
    proc = launch(args, second)
    assert proc.wait(timeout=600) == 0, second.read_text()[-4000:]
    assert logged_steps(second.read_text()) == list(range(stopped_at + 1, 11))
    assert saved_steps(checkpoints)[-1] == 10
