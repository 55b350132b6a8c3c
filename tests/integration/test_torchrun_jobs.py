"""Jobs launched through torchrun agents: two agents on this machine join one c10d rendezvous
over loopback as two "nodes"; SIGKILL of one rank -> torchrun restarts the group from the last
checkpoint; SIGTERM -> a checkpoint at the next step boundary, clean exit, and a resume continues
from it."""

import os
import re
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

pytestmark = pytest.mark.slow

STEP_DIR = re.compile(r"step-(\d+)")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def launch(args: list[str], log: Path) -> subprocess.Popen:
    """`qwentitan-launch run ARGS` on the CPU platform, output to `log`."""
    env = dict(os.environ, QWENTITAN_PLATFORM="cpu", OMP_NUM_THREADS="1")
    return subprocess.Popen(
        [sys.executable, "-m", "qwentitan.launch.cli", "run", *args],
        stdout=log.open("w"),
        stderr=subprocess.STDOUT,
        env=env,
    )


def saved_steps(checkpoints: Path) -> list[int]:
    if not checkpoints.is_dir():
        return []
    return sorted(
        int(m.group(1))
        for p in checkpoints.iterdir()
        if (m := STEP_DIR.fullmatch(p.name)) and (p / ".metadata").exists()
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


def test_two_nodes_of_one_rank_train_the_tiny_recipe(tmp_path):
    port = free_port()
    run_dir = tmp_path / "run"
    common = [
        "--recipe", "tiny_dense", "--instance", "cpu", "--ranks-per-node", "1",
        "--nnodes", "2", "--rdzv-endpoint", f"127.0.0.1:{port}",
        "--steps", "3", "--dump-folder", str(run_dir),
    ]  # fmt: skip
    logs = [tmp_path / f"node{k}.log" for k in (0, 1)]
    nodes = [launch([*common, "--node-rank", str(k)], logs[k]) for k in (0, 1)]
    codes = [n.wait(timeout=600) for n in nodes]
    text = [log.read_text() for log in logs]
    assert codes == [0, 0], text[0][-3000:] + text[1][-3000:]
    # Each node's plan: one rank here, world size 2 over the two nodes.
    assert all("ranks         2 = 2 x 1 per node" in t for t in text)
    # The rank that logs (global rank 0) trained all three steps with FSDP over both nodes.
    assert logged_steps(text[0] + text[1])[-1] == 3
    checkpoint = run_dir / "checkpoint"
    assert saved_steps(checkpoint) == [3]
    # DCP writes one shard file per rank: two ranks took part.
    shards = sorted(p.name for p in (checkpoint / "step-3").glob("*.distcp"))
    assert len(shards) == 2, shards


def _ranks(run_pid: int) -> list[psutil.Process]:
    """The training ranks: children of the torchrun agent, itself the child of `run`."""
    agents = psutil.Process(run_pid).children()
    return [rank for agent in agents for rank in agent.children()]


def test_sigkill_of_one_rank_restarts_the_group_from_the_last_checkpoint(tmp_path):
    run_dir = tmp_path / "run"
    checkpoints = run_dir / "checkpoint"
    log = tmp_path / "run.log"
    proc = launch(
        [
            "--recipe", "tiny_dense", "--instance", "cpu", "--ranks-per-node", "2",
            "--steps", "10", "--checkpoint-interval", "2", "--max-restarts", "1",
            "--dump-folder", str(run_dir),
        ],
        log,
    )  # fmt: skip
    try:
        wait_for(lambda: 4 in saved_steps(checkpoints), 400, "the step-4 checkpoint", proc)
        victim = _ranks(proc.pid)[-1]
        victim.send_signal(signal.SIGKILL)
        code = proc.wait(timeout=600)
    finally:
        if proc.poll() is None:
            proc.kill()
    text = log.read_text()
    assert code == 0, text[-4000:]
    # torchrun restarted the group once; the new ranks loaded the newest checkpoint (step 4 or
    # later, on the interval) and ran exactly the remaining steps.
    assert "failed (exitcode: -9)" in text
    loads = re.findall(r"Loading the checkpoint from \S+/step-(\d+)", text)
    assert len(loads) == 1, loads
    resumed_from = int(loads[0])
    assert resumed_from % 2 == 0 and resumed_from >= 4
    after = logged_steps(text[text.index("Loading the checkpoint from") :])
    assert after == list(range(resumed_from + 1, 11))
    assert saved_steps(checkpoints)[-1] == 10


def test_sigterm_checkpoints_at_the_next_step_and_a_resume_continues(tmp_path):
    run_dir = tmp_path / "run"
    checkpoints = run_dir / "checkpoint"
    args = ["--recipe", "tiny_dense", "--instance", "cpu", "--ranks-per-node", "2",
            "--steps", "8", "--checkpoint-interval", "100", "--dump-folder", str(run_dir)]  # fmt: skip
    first = tmp_path / "first.log"
    proc = launch(args, first)
    try:
        wait_for(lambda: len(logged_steps(first.read_text())) >= 2, 400, "two steps", proc)
        os.kill(proc.pid, signal.SIGTERM)
        code = proc.wait(timeout=300)
    finally:
        if proc.poll() is None:
            proc.kill()
    text = first.read_text()
    assert code == 0, text[-4000:]
    assert "SIGTERM received" in text
    saved = saved_steps(checkpoints)
    assert len(saved) == 1 and 2 <= saved[0] < 8, saved
    stopped_at = saved[0]
    assert logged_steps(text)[-1] == stopped_at

    second = tmp_path / "second.log"
    proc = launch(args, second)
    assert proc.wait(timeout=600) == 0, second.read_text()[-4000:]
    resumed = logged_steps(second.read_text())
    assert resumed == list(range(stopped_at + 1, 9))
    assert saved_steps(checkpoints)[-1] == 8
