"""The sbatch script: valid bash, one torchrun agent per node via srun, c10d on the first node."""

import shlex
import subprocess

import pytest

from qwentitan.launch.launcher.plan import RunRequest, resolve_plan
from qwentitan.launch.launcher.plan_file import load_plan, save_plan
from qwentitan.launch.launcher.slurm import SlurmOptions, render_sbatch, write_sbatch

pytestmark = pytest.mark.usefixtures("torchtitan_recipes")


@pytest.fixture
def two_node_plan():
    return resolve_plan(
        RunRequest(
            recipe="qwen3_debugmodel",
            instance="trn2.48xlarge",
            nodes=2,
            seq_len=2048,
            tp=4,
            ac="full",
            max_restarts=2,
        )
    )


def _srun_command(script: str) -> list[str]:
    """The training srun command (continuation lines joined), as shell words."""
    joined = script.replace("\\\n", " ")
    lines = [line for line in joined.splitlines() if line.startswith("srun ")]
    train = [line for line in lines if "hostname" not in line]
    assert len(train) == 1, lines
    return shlex.split(train[0])


def test_script_is_valid_bash(tmp_path, two_node_plan):
    path = write_sbatch(
        two_node_plan, tmp_path / "job.sbatch", SlurmOptions(partition="trn2", time="01:00:00")
    )
    assert path.stat().st_mode & 0o111  # executable
    result = subprocess.run(["bash", "-n", str(path)], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr
    assert not list(tmp_path.glob(".*.tmp"))  # written atomically, no leftovers


def test_sbatch_header(two_node_plan):
    script = render_sbatch(
        two_node_plan, SlurmOptions(partition="trn2", time="01:00:00", grace_seconds=90)
    )
    header = [line for line in script.splitlines() if line.startswith("#SBATCH")]
    assert "#SBATCH --nodes=2" in header and "#SBATCH --ntasks-per-node=1" in header
    assert "#SBATCH --signal=USR1@90" in header and "#SBATCH --requeue" in header
    assert "#SBATCH --partition=trn2" in header and "#SBATCH --time=01:00:00" in header
    assert script.startswith("#!/bin/bash\n")


def test_srun_runs_one_agent_per_node_on_the_written_plan(two_node_plan):
    script = render_sbatch(two_node_plan, SlurmOptions(port=29555), "/jobs/job.plan.json")
    words = _srun_command(script)
    assert words[:4] == ["srun", "--nodes=2", "--ntasks-per-node=1", "--kill-on-bad-exit=1"]
    assert words[4:] == [
        "qwentitan-launch",
        "run",
        "--plan",
        "/jobs/job.plan.json",
        "--rdzv-endpoint",
        "$HEAD_ADDR:$RDZV_PORT",
    ]
    assert "RDZV_PORT=29555" in script.splitlines()
    assert 'HEAD_NODE="${NODES[0]}"' in script


def test_torchrun_line_of_each_node_and_environment(two_node_plan):
    script = render_sbatch(two_node_plan)
    torchrun = [line for line in script.splitlines() if line.startswith("#   torchrun ")]
    assert len(torchrun) == 1
    words = torchrun[0][1:].split()
    assert words[:5] == [
        "torchrun",
        "--nnodes=2",
        "--nproc-per-node=64",
        "--rdzv-backend=c10d",
        "--rdzv-endpoint=$HEAD_ADDR:$RDZV_PORT",
    ]
    # the environment travels in the plan file; the script only shows it
    assert not [line for line in script.splitlines() if line.startswith("export ")]
    env = two_node_plan.env
    assert env["NEURON_LOGICAL_NC_CONFIG"] == "2" and "NEURON_CC_FLAGS" not in env
    assert env["FI_PROVIDER"] == "efa" and env["FI_EFA_USE_DEVICE_RDMA"] == "1"
    assert "#   NEURON_LOGICAL_NC_CONFIG=2" in script.splitlines()


def test_every_node_runs_exactly_the_written_plan(tmp_path, two_node_plan, monkeypatch):
    monkeypatch.setenv("TORCH_NEURONX_NEFF_CACHE_DIR", "/elsewhere")  # a node's own shell
    path = save_plan(two_node_plan, tmp_path / "job.plan.json")
    node = load_plan(path, rdzv_endpoint="10.0.0.7:29500")
    assert node.torchrun_args() == [
        arg.replace("localhost:0", "10.0.0.7:29500") for arg in two_node_plan.torchrun_args()
    ]
    assert node.overrides == two_node_plan.overrides and node.env == two_node_plan.env
    assert node.env_sources == two_node_plan.env_sources
    assert (node.nodes, node.lnc, node.max_restarts, node.global_batch) == (
        2,
        2,
        2,
        two_node_plan.global_batch,
    )
    assert not list(tmp_path.glob(".*.tmp"))


def test_a_broken_plan_file_is_one_sentence(tmp_path):
    from qwentitan.launch.base.errors import LaunchError

    bad = tmp_path / "job.plan.json"
    bad.write_text("{")
    with pytest.raises(LaunchError, match=r"cannot be read .*write it again with `slurm`\.$"):
        load_plan(bad)
    with pytest.raises(LaunchError, match=r"^There is no plan file"):
        load_plan(tmp_path / "missing.json")


def test_the_script_runs_under_a_fake_slurm(tmp_path, two_node_plan):
    """Execute the script with stub scontrol / srun / launcher: the srun sees the resolved words."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "scontrol").write_text("#!/bin/bash\necho node-a; echo node-b\n")
    (bin_dir / "hostname").write_text("#!/bin/bash\necho 10.0.0.7 fe80::1\n")
    (bin_dir / "srun").write_text(
        '#!/bin/bash\nwhile [[ "$1" == --* || "$1" == -w ]]; do '
        'if [[ "$1" == -w ]]; then shift; fi; shift; done\n'
        'echo "SRUN $*" >> "$LOG"; "$@"\n'
    )
    (bin_dir / "qwentitan-launch").write_text('#!/bin/bash\necho "LAUNCH $*" >> "$LOG"\n')
    for f in bin_dir.iterdir():
        f.chmod(0o755)
    script = write_sbatch(
        two_node_plan, tmp_path / "job.sbatch", SlurmOptions(workdir=str(tmp_path))
    )
    log = tmp_path / "log"
    env = {
        "PATH": f"{bin_dir}:/usr/bin:/bin",
        "LOG": str(log),
        "SLURM_JOB_NODELIST": "node-[a-b]",
        "SLURM_JOB_NUM_NODES": "2",
        "SLURM_NODEID": "0",
    }
    result = subprocess.run(["bash", str(script)], env=env, capture_output=True, text=True)
    assert result.returncode == 0, result.stderr
    launch = [line for line in log.read_text().splitlines() if line.startswith("LAUNCH")]
    assert len(launch) == 1
    assert f"run --plan {tmp_path / 'job.plan.json'} --rdzv-endpoint 10.0.0.7:29500" in launch[0]


def test_good_slurm_times_pass(two_node_plan):
    for time in ("30", "30:00", "04:00:00", "2-12", "2-12:30", "2-12:30:00", "UNLIMITED"):
        assert f"#SBATCH --time={time}" in render_sbatch(two_node_plan, SlurmOptions(time=time))
