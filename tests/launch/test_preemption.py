"""Preemption signals: recorded, not fatal, agreed across ranks; the supervisor forwards them."""

import os
import signal
import subprocess
import sys
import textwrap
import time

import pytest

from qwentitan.launch.launcher.supervisor import STOPPED_EXIT, ignore_sigusr1, ranks_of, supervise
from qwentitan.launch.runtime.preemption import PreemptionWatch


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGUSR1])
def test_signal_is_recorded_instead_of_killing(sig):
    watch = PreemptionWatch().install()
    try:
        assert watch.stop_requested() is None
        os.kill(os.getpid(), sig)
        reason = watch.stop_requested()
        assert reason is not None and sig.name in reason
    finally:
        watch.uninstall()
    assert signal.getsignal(sig) in (signal.SIG_DFL, signal.default_int_handler) or callable(
        signal.getsignal(sig)
    )


def test_ranks_agree_when_only_one_received_the_signal(tmp_path):
    """Two gloo ranks; only rank 1 is signalled; both see the stop at the same check."""
    script = tmp_path / "agree.py"
    script.write_text(
        textwrap.dedent(
            """
            import os, signal, sys
            import torch.distributed as dist
            from qwentitan.launch.runtime.preemption import PreemptionWatch
            dist.init_process_group("gloo")
            watch = PreemptionWatch().install()
            first = watch.stop_requested()
            if dist.get_rank() == 1:
                os.kill(os.getpid(), signal.SIGUSR1)
            second = watch.stop_requested()
            # One write per line: with PYTHONUNBUFFERED (set here) print writes the newline
            # separately, and it can land after the other rank's line on the shared pipe.
            sys.stdout.write(f"rank{dist.get_rank()} first={first} second={second}\\n")
            sys.stdout.flush()
            dist.destroy_process_group()
            """
        )
    )
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--nproc-per-node=2",
            "--standalone",
            str(script),
        ],
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert result.returncode == 0, result.stderr[-2000:]
    for rank in (0, 1):
        line = next(line for line in result.stdout.splitlines() if line.startswith(f"rank{rank} "))
        assert "first=None" in line and "second=SIGUSR1 received" in line


def test_agent_ignores_sigusr1_only(tmp_path):
    probe = subprocess.run(
        [
            sys.executable,
            "-c",
            "import signal; print(signal.getsignal(signal.SIGTERM) == signal.SIG_IGN,"
            " signal.getsignal(signal.SIGUSR1) == signal.SIG_IGN)",
        ],
        preexec_fn=ignore_sigusr1,
        capture_output=True,
        text=True,
    )
    assert probe.stdout.split() == ["False", "True"]


@pytest.mark.parametrize("stopped_exit", [0, STOPPED_EXIT])
def test_supervisor_forwards_sigterm_to_the_ranks_only(tmp_path, stopped_exit):
    """A fake agent (ignoring signals, as torchrun is started) with one rank that checkpoints;
    `run` asks for STOPPED_EXIT when the ranks stopped on a signal, `train` for 0."""
    marker = tmp_path / "checkpointed"
    rank = tmp_path / "rank.py"
    rank.write_text(
        textwrap.dedent(
            f"""
            import signal, sys, time, pathlib
            got = []
            signal.signal(signal.SIGTERM, lambda s, f: got.append(s))
            pathlib.Path({str(tmp_path / "ready")!r}).write_text("1")
            while not got:
                time.sleep(0.05)
            pathlib.Path({str(marker)!r}).write_text("saved")
            sys.exit(0)
            """
        )
    )
    agent = tmp_path / "agent.py"
    agent.write_text(
        f"import subprocess, sys\nsys.exit(subprocess.call([sys.executable, {str(rank)!r}]))\n"
    )
    supervisor = subprocess.Popen(
        [
            sys.executable,
            "-c",
            "import sys, os; from qwentitan.launch.launcher.supervisor import supervise; "
            f"sys.exit(supervise([sys.executable, {str(agent)!r}], dict(os.environ), "
            f"stopped_exit={stopped_exit}))",
        ]
    )
    deadline = time.time() + 60
    while not (tmp_path / "ready").exists():
        assert time.time() < deadline, "rank never started"
        time.sleep(0.1)
    supervisor.send_signal(signal.SIGTERM)
    assert supervisor.wait(timeout=60) == stopped_exit
    assert marker.read_text() == "saved"


@pytest.mark.parametrize("sig", [signal.SIGKILL, signal.SIGSEGV, signal.SIGABRT])
def test_an_agent_killed_by_a_signal_is_one_line_and_128_plus_it(tmp_path, capfd, sig):
    """A fake agent that dies of `sig` with its rank running: one line, exit 128 + sig, and the
    orphaned rank is stopped with the SIGTERM the agent would have sent."""
    rank = tmp_path / "rank.py"
    rank.write_text(
        "import pathlib, signal, sys, time\n"
        f"signal.signal(signal.SIGTERM, lambda *_: (pathlib.Path({str(tmp_path / 'stopped')!r})"
        ".write_text('1'), sys.exit(0)))\n"
        f"pathlib.Path({str(tmp_path / 'ready')!r}).write_text('1')\n"
        "time.sleep(60)\n"
    )
    agent = tmp_path / "agent.py"
    agent.write_text(
        "import os, pathlib, subprocess, sys, time\n"
        f"subprocess.Popen([sys.executable, {str(rank)!r}], start_new_session=True)\n"
        f"while not pathlib.Path({str(tmp_path / 'ready')!r}).exists():\n"
        "    time.sleep(0.05)\n"
        "time.sleep(2.5)  # the supervisor has seen the rank (it looks every second)\n"
        f"os.kill(os.getpid(), {int(sig)})\n"
    )
    code = supervise([sys.executable, str(agent)], dict(os.environ), poll_seconds=0.1)
    assert code == 128 + sig
    deadline = time.time() + 30
    while not (tmp_path / "stopped").exists():
        assert time.time() < deadline, "the orphaned rank was never stopped"
        time.sleep(0.1)
    err = capfd.readouterr().err
    assert err.strip().splitlines() == [
        f"qwentitan-launch: the torchrun agent was killed by {sig.name}; its ranks were sent "
        "SIGTERM to stop, and --resume continues from their last checkpoint."
    ]


def test_ranks_of_lists_direct_children_only():
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"])
    try:
        assert child.pid in ranks_of(os.getpid())
    finally:
        child.kill()
        child.wait()
    assert ranks_of(999_999_999) == []


def test_a_second_sigint_stops_at_once():
    """Ctrl-C once: recorded like SIGTERM (checkpoint, then exit); twice: one line, exit 130."""
    probe = textwrap.dedent(
        """
        import os, signal, sys, time
        from qwentitan.launch.runtime.preemption import PreemptionWatch
        watch = PreemptionWatch().install()
        os.kill(os.getpid(), signal.SIGINT)
        print(watch.stop_requested(), flush=True)
        os.kill(os.getpid(), signal.SIGINT)
        time.sleep(5)  # the handler runs here, before the next bytecode
        print("still running", flush=True)
        """
    )
    result = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True)
    assert result.returncode == 130
    assert result.stdout.splitlines() == ["SIGINT received: checkpointing and exiting"]
    assert result.stderr == (
        "Stopped at once by a second Ctrl-C, without saving this step; "
        "--resume continues from the last checkpoint.\n"
    )


def test_a_rank_stuck_between_step_boundaries_is_ended_by_a_pending_signal():
    """Data loading (and anything else between two steps) asks `stop_if_overdue`: a signal
    that has waited too long for a step boundary ends the rank at once, in one line."""
    script = textwrap.dedent(
        """
        import os, signal, time
        from qwentitan.launch.runtime.preemption import PreemptionWatch, stop_if_overdue
        watch = PreemptionWatch().install()
        stop_if_overdue("loading data", seconds=0.2)  # nothing received: goes on
        os.kill(os.getpid(), signal.SIGTERM)
        stop_if_overdue("loading data", seconds=0.2)  # received just now: still waits
        print("waited", flush=True)
        while True:  # a loop that never reaches a step boundary
            time.sleep(0.05)
            stop_if_overdue("loading data", seconds=0.2)
        """
    )
    result = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=120
    )
    assert result.returncode == 128 + signal.SIGTERM
    assert result.stdout == "waited\n"
    assert result.stderr == (
        "Stopped by SIGTERM while loading data: no step boundary came within 0.2 s, so this step "
        "was not saved; --resume continues from the last checkpoint.\n"
    )


def test_a_signal_that_came_while_the_rank_started_waits_for_the_first_step():
    """The overdue wait counts from the first data read after the signal, not from the signal:
    a SLURM time limit at the start of a job is honoured after step 1, not ended in step 1."""
    script = textwrap.dedent(
        """
        import os, signal, time
        from qwentitan.launch.runtime.preemption import PreemptionWatch, stop_if_overdue
        watch = PreemptionWatch().install()
        os.kill(os.getpid(), signal.SIGUSR1)
        time.sleep(0.5)  # building the model: longer than the overdue wait below
        stop_if_overdue("loading data", seconds=0.2)
        print(watch.stop_requested(), flush=True)
        """
    )
    result = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=120
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout == "SIGUSR1 received: checkpointing and exiting\n"


def test_a_rank_stopping_on_usr1_survives_more_usr1_as_it_exits():
    """The sbatch script passes the time limit's USR1 on every 2 s until the step ends; Python
    resets its handlers to the default as it exits, which would let one of them kill the rank
    after its checkpoint (and torchrun restart it)."""
    script = textwrap.dedent(
        """
        import os, signal, subprocess
        from qwentitan.launch.runtime.preemption import PreemptionWatch
        watch = PreemptionWatch().install()
        os.kill(os.getpid(), signal.SIGUSR1)
        print(watch.stop_requested(), flush=True)
        spam = f"for i in $(seq 3000); do kill -USR1 {os.getpid()} || exit; sleep 0.002; done"
        subprocess.Popen(["bash", "-c", spam], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        """
    )
    result = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=120
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout == "SIGUSR1 received: checkpointing and exiting\n"


def test_reading_data_asks_whether_a_stop_is_overdue(tmp_path, monkeypatch):
    from qwentitan.launch.runtime.data import loader

    asked = []
    monkeypatch.setattr(loader, "stop_if_overdue", asked.append)
    data = tmp_path / "data.jsonl"
    data.write_text("".join(f'{{"text": "document {i}"}}\n' for i in range(3)))

    class Tokens:  # the dataset only asks its tokenizer to encode
        def encode(self, text, add_bos, add_eos):
            return [1] * 5

    key = loader._register(loader.resolve_dataset(str(data)), "train", 20)
    dataset = loader._TextDataset(key, None, Tokens(), seq_len=4, infinite=False)
    assert len(list(dataset)) == 3 and asked == ["loading data"] * 3


# A native teardown that aborts, as the rank's C++ teardown once did after a good end: libc's
# abort() registered with on_exit, which runs after Python's exit handlers.
_RANK_END = """
import atexit, ctypes, os, sys
from qwentitan.launch.runtime import rank_exit
libc = ctypes.CDLL(None)
libc.on_exit(ctypes.cast(libc.abort, ctypes.c_void_p), None)
atexit.register(print, "an earlier exit handler ran", flush=True)
{register}
{end}
"""


@pytest.mark.parametrize(
    ("register", "end", "returncode"),
    [
        # A rank (`-m torchtitan.train`) whose training ended well: exit 0, handlers run.
        ("atexit.register(rank_exit._leave)", "", 0),
        # Its main raised after training: reported as before, the exit is not made good.
        ("atexit.register(rank_exit._leave)", "raise RuntimeError('the save failed')", -6),
        # A process torchrun started, as the Trainer registers it after training.
        (
            "os.environ['TORCHELASTIC_RUN_ID'] = 'run'\nrank_exit.leave_cleanly_after_training()",
            "",
            0,
        ),
        # Not a rank (a test or notebook training in its own process): its exit is its own.
        ("rank_exit.leave_cleanly_after_training()", "", -6),
    ],
    ids=["ended-well", "main-raised", "torchrun-rank", "not-a-rank"],
)
def test_a_rank_that_ended_well_leaves_before_the_native_teardown(register, end, returncode):
    script = _RANK_END.format(register=register, end=end)
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True)
    assert done.returncode == returncode, done.stderr
    assert "an earlier exit handler ran" in done.stdout
    assert ("the save failed" in done.stderr) == bool(end)


def test_torchtitans_closing_sleep_is_skipped_on_one_node(monkeypatch):
    import inspect

    from torchtitan import trainer

    from qwentitan.launch.runtime.rank_exit import without_the_closing_sleep

    # the one sleep of torchtitan's trainer module: rank 0's, at the end of train()
    assert inspect.getsource(trainer).count("time.sleep(") == 1
    slept: list[float] = []
    monkeypatch.setattr(time, "sleep", slept.append)
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")  # one node
    with without_the_closing_sleep():
        trainer.time.sleep(2)
        assert trainer.time.perf_counter is time.perf_counter
    assert slept == [] and trainer.time is time
    trainer.time.sleep(2)
    assert slept == [2]
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "1")  # two nodes: torchtitan's pause stays
    with without_the_closing_sleep():
        trainer.time.sleep(2)
    assert slept == [2, 2]
