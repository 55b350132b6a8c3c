"""A signal to the `train` launcher only (`kill PID`, `kill -INT PID`) reaches every rank: they
checkpoint at the next step boundary and exit, the launcher exits 0 and no process outlives it.
Even a launcher killed outright (SIGKILL) takes its tree down the same way, with a checkpoint."""

import os
import re
import signal
import subprocess
import sys

import psutil
import pytest

from qwentitan.launch.launcher.resume import saved_steps

pytestmark = pytest.mark.slow
_STEP = re.compile(r"\bstep:\s+(\d+)\s")
_ANSI = re.compile(r"\x1b\[[0-9;]*m")


@pytest.mark.parametrize(
    ("sig", "ranks_get", "exit_code", "ranks"),
    [
        (signal.SIGTERM, signal.SIGTERM, 0, 2),
        # SIGINT to the launcher: tests/integration/test_torchrun_jobs.py stops its run with it
        # the kernel tells the agent (PR_SET_PDEATHSIG), which SIGTERMs its ranks: that chain
        # does not depend on their number, so one rank shows it (and spares a rank's start-up)
        (signal.SIGKILL, signal.SIGTERM, -signal.SIGKILL, 1),
    ],
    ids=["SIGTERM-2-ranks", "SIGKILL-1-rank"],
)
def test_signal_to_the_launcher_checkpoints_every_rank_and_leaves_no_process(
    sig, ranks_get, exit_code, ranks, tmp_path
):
    run_dir = tmp_path / "run"
    launcher = subprocess.Popen(
        [sys.executable, "-m", "qwentitan.launch.launcher.cli", "train", "--steps", "200",
         "--ranks", str(ranks), "--seq-len", "32", "--local-batch-size", "1",
         "--validate-every", "1000", "--run-dir", str(run_dir)],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        env={**os.environ, "PYTHONUNBUFFERED": "1"},
    )  # fmt: skip
    log: list[str] = []
    try:
        for line in launcher.stdout:  # until the ranks are training
            log.append(_ANSI.sub("", line))
            if _STEP.search(log[-1]):
                break
        tree = psutil.Process(launcher.pid).children(recursive=True)
        assert len(tree) >= 1 + ranks, "".join(log)[-3000:]  # the torchrun agent and the ranks
        launcher.send_signal(sig)  # the launcher only, not its group
        log += [_ANSI.sub("", line) for line in launcher.stdout]
        assert launcher.wait(timeout=120) == exit_code, "".join(log)[-3000:]
    finally:
        if launcher.poll() is None:
            os.killpg(os.getpgid(launcher.pid), signal.SIGKILL)
            launcher.wait()
    text = "".join(log)
    stopped = int(
        re.search(rf"Stopping after step (\d+): {ranks_get.name} received", text).group(1)
    )
    assert 1 <= stopped < 200
    assert saved_steps(run_dir / "checkpoint") == [stopped]
    gone = psutil.wait_procs(tree, timeout=30)[1]
    assert not [p for p in gone if p.status() != psutil.STATUS_ZOMBIE]
