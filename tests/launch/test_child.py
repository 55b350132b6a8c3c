"""`train` resolves its plan in a short-lived child: the supervising process keeps no torch."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

_CHILD = textwrap.dedent(
    """
    import os, sys
    from qwentitan.launch.base.errors import LaunchError
    from qwentitan.launch.launcher.child import in_child

    assert in_child(os.getpid) != os.getpid()  # run elsewhere, answered here
    def refuse():
        raise LaunchError("pass {tp} 2", field="tp")
    try:
        in_child(refuse)
    except LaunchError as error:
        print(error.field, error.phrased(lambda f: "--" + f))
    """
)

# `train` with the supervisor replaced: what this process holds when the ranks would start.
_TRAIN = textwrap.dedent(
    """
    import json, sys
    from qwentitan.launch.launcher import cli
    from qwentitan.launch.launcher import supervisor

    seen = {}
    def supervise(argv, env, **_):
        seen.update(torch="torch" in sys.modules, torchtitan="torchtitan" in sys.modules,
                    argv=argv, colour=env.get("QWENTITAN_COLOR"))
        return 0
    supervisor.supervise = supervise
    code = cli.main(["train", "--ranks", "1", "--steps", "2", "--run-dir", sys.argv[1]])
    print(json.dumps({"code": code, **seen}))
    """
)


def test_in_child_answers_from_another_process_and_raises_its_refusal_here():
    done = subprocess.run([sys.executable, "-c", _CHILD], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "tp pass --tp 2"


def test_a_refusal_is_said_without_importing_torch():
    """The one sentence comes before any of torch's start-up (the CLI once imported every
    package's error class, and with qwentitan.modeling's torch and torchtitan, to catch them)."""
    refusal = (
        "import sys\n"
        "from qwentitan.launch.launcher import cli\n"
        "code = cli.main(['fetch', '--recipe', 'tiny_dense'])\n"
        "print(code, 'torch' in sys.modules)"
    )
    done = subprocess.run([sys.executable, "-c", refusal], capture_output=True, text=True)
    assert done.stdout.split() == ["2", "False"], done.stderr[-3000:]
    assert done.stderr.startswith("qwentitan-launch fetch: Recipe tiny_dense needs no download")


def test_train_supervises_its_ranks_without_torch_in_the_process(tmp_path):
    env = {**os.environ, "QWENTITAN_MLFLOW": "off"}
    done = subprocess.run(
        [sys.executable, "-c", _TRAIN, str(tmp_path / "run")],
        capture_output=True, text=True, env=env,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    seen = json.loads(done.stdout.strip().splitlines()[-1])
    assert seen["code"] == 0 and seen["torch"] is False and seen["torchtitan"] is False
    assert "torchtitan.train" in seen["argv"] and seen["colour"] == "0"  # stdout is a pipe


_KILLED = textwrap.dedent(
    """
    import os, signal
    from qwentitan.launch.base.errors import LaunchError
    from qwentitan.launch.launcher.child import in_child

    def killed():
        os.kill(os.getpid(), signal.SIGKILL)  # as the out-of-memory killer would

    try:
        in_child(killed)
    except LaunchError as error:
        print(error)
    """
)

# `in_child` interrupted in the parent (SIGTERM's handler raises, as `train`'s does) while the
# child is busy: the child goes too.
_INTERRUPTED = textwrap.dedent(
    """
    import os, signal, sys, time
    from qwentitan.launch.launcher.child import in_child

    def busy(path):
        open(path, "w").write(str(os.getpid()))
        time.sleep(60)

    def stop(*_):
        raise SystemExit(143)

    signal.signal(signal.SIGTERM, stop)
    signal.signal(signal.SIGALRM, lambda *_: os.kill(os.getpid(), signal.SIGTERM))
    signal.alarm(3)
    in_child(busy, sys.argv[1])
    """
)


def test_a_plan_child_killed_by_sigkill_is_one_sentence():
    done = subprocess.run([sys.executable, "-c", _KILLED], capture_output=True, text=True)
    assert done.returncode == 0 and "Traceback" not in done.stderr, done.stderr
    assert done.stdout.strip() == (
        "The process that resolves the plan was killed by SIGKILL (what the out-of-memory killer "
        "sends) before it answered; free memory on this host, then try again."
    )


def test_a_signal_while_the_plan_child_is_busy_ends_the_child_too(tmp_path):
    import time

    marker = tmp_path / "child.pid"
    with (tmp_path / "stderr").open("w") as stderr:  # no pipe the child would hold open
        done = subprocess.run(
            [sys.executable, "-c", _INTERRUPTED, str(marker)], stdout=stderr, stderr=stderr
        )
    assert done.returncode == 143, (tmp_path / "stderr").read_text()
    pid = int(marker.read_text())
    for _ in range(50):  # the kernel reaps it at once; allow a moment
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            break
        time.sleep(0.1)
    else:
        os.kill(pid, 9)
        raise AssertionError(f"the plan's child {pid} outlived its parent")
