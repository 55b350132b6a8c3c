"""The torchrun agent `train` and `run` start: a failed rank ends the job in one line with the
rank's exit code, not torchrun's traceback."""

import subprocess
import sys
import textwrap

import pytest

pytestmark = pytest.mark.slow


def agent(tmp_path, body: str, ranks: int = 1) -> subprocess.CompletedProcess:
    script = tmp_path / "rank.py"
    script.write_text(textwrap.dedent(body))
    return subprocess.run(
        [sys.executable, "-m", "qwentitan.launch.launcher.agent", "--standalone",
         f"--nproc-per-node={ranks}", str(script)],
        capture_output=True, text=True, timeout=240,
    )  # fmt: skip


def test_a_rank_that_explains_its_failure_ends_the_job_with_its_code_and_no_traceback(tmp_path):
    result = agent(
        tmp_path,
        """
        import sys
        print("the disk is full: free space and resume", file=sys.stderr)
        sys.exit(2)
        """,
    )
    assert result.returncode == 2, result.stderr[-2000:]
    assert "Traceback" not in result.stderr and "ChildFailedError" not in result.stderr
    assert "the disk is full: free space and resume" in result.stderr
    last = result.stderr.strip().splitlines()[-1]
    assert last == "qwentitan-launch: rank 0 ended with exit code 2; its own message is above."


def test_a_job_whose_ranks_succeed_exits_0(tmp_path):
    result = agent(tmp_path, "print('trained')\n")
    assert result.returncode == 0, result.stderr[-2000:]
    assert "trained" in result.stdout


@pytest.mark.parametrize("sig", ["SIGKILL", "SIGTERM"])
def test_a_rank_killed_by_a_signal_is_named_with_it_and_128_plus_it(tmp_path, sig):
    result = agent(tmp_path, f"import os, signal\nos.kill(os.getpid(), signal.{sig})\n")
    import signal

    assert result.returncode == 128 + signal.Signals[sig], result.stderr[-2000:]
    assert "Traceback" not in result.stderr and "message is above" not in result.stderr
    assert result.stderr.strip().splitlines()[-1] == (
        f"qwentitan-launch: rank 0 was killed by {sig}, so it said nothing itself; --resume "
        "continues from the last checkpoint."
    )


def test_a_failed_rank_gets_no_extra_torchrun_line(tmp_path):
    result = agent(tmp_path, "import sys\nsys.exit(3)\n")
    assert result.returncode == 3
    assert "failed (exitcode" not in result.stderr, result.stderr[-2000:]


def test_sigterm_to_the_agent_is_one_line_not_a_traceback(tmp_path):
    import os
    import signal
    import time

    script = tmp_path / "rank.py"
    ready = tmp_path / "ready"
    script.write_text(
        "import signal, sys, time\n"
        "signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))  # saves, then ends\n"
        f"open({str(ready)!r}, 'w').close()\n"
        "time.sleep(120)\n"
    )
    agent_process = subprocess.Popen(
        [sys.executable, "-m", "qwentitan.launch.launcher.agent", "--standalone",
         "--nproc-per-node=1", str(script)],
        stderr=subprocess.PIPE, text=True,
    )  # fmt: skip
    deadline = time.monotonic() + 200
    while not ready.exists() and time.monotonic() < deadline:
        time.sleep(0.1)
    os.kill(agent_process.pid, signal.SIGTERM)
    _, err = agent_process.communicate(timeout=120)
    assert agent_process.returncode == 128 + signal.SIGTERM
    assert "Traceback" not in err and "SignalException" not in err, err[-3000:]
    assert err.strip().splitlines()[-1] == (
        "qwentitan-launch: the torchrun agent got SIGTERM and stopped the ranks; --resume "
        "continues from their last checkpoint."
    )


@pytest.mark.parametrize("sig", ["SIGTERM", "SIGHUP"])
def test_a_signal_to_the_launcher_while_the_ranks_start_is_one_line(tmp_path, sig):
    """`run`/`train`'s supervisor forwards the signal (SIGHUP as SIGTERM) to a rank that has no
    handler yet (still starting): one line naming it, exit 128 + SIGTERM, nothing "above"."""
    import os
    import signal
    import time

    ready = tmp_path / "ready"
    script = tmp_path / "rank.py"
    script.write_text(f"import time\nopen({str(ready)!r}, 'w').close()\ntime.sleep(120)\n")
    agent_argv = [sys.executable, "-m", "qwentitan.launch.launcher.agent", "--standalone",
                  "--nproc-per-node=1", str(script)]  # fmt: skip
    supervisor = subprocess.Popen(
        [sys.executable, "-c", "import os, sys; from qwentitan.launch.launcher.supervisor import "
         f"supervise; sys.exit(supervise({agent_argv!r}, dict(os.environ), stopped_exit=75))"],
        stderr=subprocess.PIPE, text=True,
    )  # fmt: skip
    deadline = time.monotonic() + 200
    while not ready.exists() and time.monotonic() < deadline:
        time.sleep(0.1)
    os.kill(supervisor.pid, getattr(signal, sig))
    _, err = supervisor.communicate(timeout=120)
    assert supervisor.returncode == 128 + signal.SIGTERM, err[-3000:]
    assert "Traceback" not in err and "message is above" not in err, err[-3000:]
    assert err.strip().splitlines()[-1] == (
        "qwentitan-launch: rank 0 was killed by SIGTERM, so it said nothing itself; --resume "
        "continues from the last checkpoint."
    )


def test_the_rank_a_signal_killed_is_named_not_the_peer_that_lost_it(tmp_path):
    """Rank 1 SIGKILLed; rank 0 then fails on the lost connection (as gloo's "Connection closed
    by peer"), in the same second: the line names rank 1 and its signal."""
    result = agent(
        tmp_path,
        """
        import os, signal, sys, time
        if os.environ["RANK"] == "1":
            os.kill(os.getpid(), signal.SIGKILL)
        time.sleep(0.3)
        print("RuntimeError: Connection closed by peer", file=sys.stderr)
        sys.exit(1)
        """,
        ranks=2,
    )
    assert result.returncode == 128 + 9, result.stderr[-2000:]
    assert result.stderr.strip().splitlines()[-1] == (
        "qwentitan-launch: rank 1 was killed by SIGKILL, so it said nothing itself; --resume "
        "continues from the last checkpoint."
    )


@pytest.mark.parametrize(
    ("codes", "named"),
    [
        ({0: 1, 1: -9}, 1),  # the peer's lost connection in the same second as the kill
        ({0: -15, 1: 2, 2: -15}, 1),  # torchrun SIGTERMs the rest after rank 1 explained itself
        ({0: -15, 1: -15, 3: -6}, 3),  # an abort among the SIGTERMed
        ({0: -15, 1: -15}, 0),
    ],
)
def test_the_cause_among_failures_in_the_same_second(codes, named):
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError, ProcessFailure

    from qwentitan.launch.launcher.agent import _cause

    failures = {r: ProcessFailure(r, 100 + r, c, "<N/A>") for r, c in codes.items()}
    for failure in failures.values():
        failure.timestamp = 1000  # whole seconds: a cascade of failures ties
    failed = ChildFailedError("rank.py", failures)
    assert _cause(failed)[0] == named
    assert failed.get_first_failure()[0] == 0  # torchrun's own pick: the first in the table
