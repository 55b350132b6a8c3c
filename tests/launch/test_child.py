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
