"""The sbatch script: valid bash, one torchrun agent per node via srun, c10d on the first node."""

import shlex
import subprocess

import pytest

import qwentitan.launch.launcher.plan as plan_module
from qwentitan.launch.launcher.plan import resolve_plan
from qwentitan.launch.launcher.slurm import SlurmOptions, render_sbatch, write_sbatch


@pytest.fixture(autouse=True)
def torchtitan_recipes(monkeypatch):
    monkeypatch.setattr(plan_module, "RECIPES_MODULE", "torchtitan.models.qwen3.config_registry")


@pytest.fixture
def two_node_plan():
    return resolve_plan(
        "qwen3_debugmodel",
        instance="trn2.48xlarge",
        nodes=2,
        seq_len=2048,
        tp=4,
        activation_checkpoint="full",
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


def test_srun_runs_one_agent_per_node_joining_the_first_node(two_node_plan):
    script = render_sbatch(two_node_plan, SlurmOptions(port=29555, max_restarts=2))
    words = _srun_command(script)
    assert words[:4] == ["srun", "--nodes=2", "--ntasks-per-node=1", "--kill-on-bad-exit=1"]
    assert words[4:6] == ["qwentitan-launch", "run"]
    run = words[6:]
    assert run[run.index("--recipe") + 1] == "qwen3_debugmodel"
    assert run[run.index("--instance") + 1] == "trn2.48xlarge"
    assert run[run.index("--lnc") + 1] == "2" and run[run.index("--ranks-per-node") + 1] == "64"
    assert run[run.index("--nnodes") + 1] == "$SLURM_JOB_NUM_NODES"
    assert run[run.index("--node-rank") + 1] == "$SLURM_NODEID"
    assert run[run.index("--rdzv-endpoint") + 1] == "$HEAD_ADDR:$RDZV_PORT"
    assert run[run.index("--max-restarts") + 1] == "2"
    # The plan's knobs are restated so every node resolves the same plan.
    assert run[run.index("--tp") + 1] == "4" and run[run.index("--ac") + 1] == "full"
    assert run[run.index("--seq-len") + 1] == "2048"
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
    exports = {
        line.split("=", 1)[0].removeprefix("export "): line.split("=", 1)[1]
        for line in script.splitlines()
        if line.startswith("export ")
    }
    assert exports["NEURON_LOGICAL_NC_CONFIG"] == "2"
    assert exports["NEURON_CC_FLAGS"] == "--lnc=2"
    assert exports["FI_PROVIDER"] == "efa" and exports["FI_EFA_USE_DEVICE_RDMA"] == "1"
    # The exports come before the srun that starts training.
    assert script.index("export NEURON_LOGICAL_NC_CONFIG") < script.index("srun --nodes=2")


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
    assert "--nnodes 2 --node-rank 0 --rdzv-endpoint 10.0.0.7:29500" in launch[0]


def test_good_slurm_times_pass(two_node_plan):
    for time in ("30", "30:00", "04:00:00", "2-12", "2-12:30", "2-12:30:00", "UNLIMITED"):
        assert f"#SBATCH --time={time}" in render_sbatch(two_node_plan, SlurmOptions(time=time))
