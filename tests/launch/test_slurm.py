"""The sbatch script, without SLURM: its header, its srun line, and its body run by bash with stub
`scontrol` / `srun` / launcher (every branch of the time-limit requeue, in seconds). A real SLURM
runs it in tests/integration/test_slurm_jobs.py."""

import os
import shlex
import signal
import subprocess
import sys
import time

import pytest

from qwentitan.launch.base.errors import LaunchError
from qwentitan.launch.launcher.plan import RunRequest, resolve_plan
from qwentitan.launch.launcher.plan_file import load_plan, save_plan
from qwentitan.launch.launcher.slurm import SlurmOptions, render_sbatch, write_sbatch
from qwentitan.launch.launcher.supervisor import STOPPED_EXIT

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
            steps=10,
            run_dir="run",
            overrides=("--checkpoint.enable",),  # a stop is resumable, so requeued
        )
    )


def _srun_command(script: str) -> list[str]:
    """The srun command (continuation lines joined, up to its `&`), as shell words."""
    joined = script.replace("\\\n", " ")
    lines = [line for line in joined.splitlines() if line.startswith("srun ")]
    assert len(lines) == 1, lines
    return shlex.split(lines[0].removesuffix("&"))


def test_script_is_valid_bash_and_its_log_folder_exists(tmp_path, two_node_plan):
    path = write_sbatch(
        two_node_plan,
        tmp_path / "job.sbatch",
        SlurmOptions(partition="trn2", time="01:00:00", workdir=str(tmp_path / "work")),
    )
    assert path.stat().st_mode & 0o111  # executable
    result = subprocess.run(["bash", "-n", str(path)], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr
    assert not list(tmp_path.glob(".*.tmp"))  # written atomically, no leftovers
    # slurmd opens the log before the script runs: its folder exists once the script does
    assert (tmp_path / "work" / "slurm-logs").is_dir()


def test_sbatch_header(two_node_plan, tmp_path):
    options = SlurmOptions(
        partition="trn2", time="01:00:00", grace_seconds=90, workdir=str(tmp_path)
    )
    lines = render_sbatch(two_node_plan, options).splitlines()
    header = [line for line in lines if line.startswith("#SBATCH")]
    assert header == [
        "#SBATCH --job-name=qwentitan-qwen3_debugmodel",
        "#SBATCH --nodes=2",
        "#SBATCH --ntasks-per-node=1",
        "#SBATCH --exclusive",
        f"#SBATCH --chdir={tmp_path}",
        f"#SBATCH --output={tmp_path}/slurm-logs/%x-%j.out",
        f"#SBATCH --error={tmp_path}/slurm-logs/%x-%j.out",
        "#SBATCH --open-mode=append",
        "#SBATCH --export=ALL",
        "#SBATCH --signal=B:USR1@90",
        "#SBATCH --requeue",
        "#SBATCH --partition=trn2",
        "#SBATCH --time=01:00:00",
    ]


def test_srun_runs_one_agent_per_node_on_the_written_plan(two_node_plan):
    script = render_sbatch(two_node_plan, SlurmOptions(port=29555), "/jobs/job.plan.json")
    words = _srun_command(script)
    assert words[:5] == [
        "srun", "--export=ALL", "--nodes=2", "--ntasks-per-node=1", "--kill-on-bad-exit=1"
    ]  # fmt: skip
    assert words[5:7] == ["bash", "-c"]  # node 0's output to the job's log, the others' beside
    # by absolute path: under sbatch --export=NONE the job has no PATH of the user's
    assert words[9:] == [
        sys.executable,
        "-m",
        "qwentitan.launch.launcher.cli",
        "run",
        "--plan",
        "/jobs/job.plan.json",
        "--rdzv-endpoint",
        "$HEAD_ADDR:$RDZV_PORT",
    ]
    assert "RDZV_PORT=$((29555 + SLURM_JOB_ID % 1000))" in script.splitlines()


def test_torchrun_line_of_each_node_and_environment(two_node_plan):
    script = render_sbatch(two_node_plan)
    torchrun = [line for line in script.splitlines() if line.startswith("#   torchrun ")]
    assert len(torchrun) == 1
    words = torchrun[0][1:].split()
    assert words[:6] == [
        "torchrun",
        "--nnodes=2",
        "--nproc-per-node=64",
        "--rdzv-backend=c10d",
        "--rdzv-endpoint=$HEAD_ADDR:$RDZV_PORT",
        "--rdzv-id=$QWENTITAN_RDZV_ID",
    ]
    # the environment travels in the plan file; the script only shows it
    assert [line for line in script.splitlines() if line.startswith("export ")] == [
        'export QWENTITAN_RDZV_ID="qwentitan-$SLURM_JOB_ID"',
        "export TORCHELASTIC_LOG_LINE_PREFIX_TEMPLATE='[rank${rank}]:'",  # global, not local
    ]
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
    bad = tmp_path / "job.plan.json"
    bad.write_text("{")
    with pytest.raises(LaunchError, match=r"cannot be read .*write it again with `slurm`\.$"):
        load_plan(bad)
    with pytest.raises(LaunchError, match=r"^There is no plan file"):
        load_plan(tmp_path / "missing.json")


def test_good_slurm_times_pass(two_node_plan):
    for time_limit in ("30", "30:00", "04:00:00", "2-12", "2-12:30", "2-12:30:00", "UNLIMITED"):
        script = render_sbatch(two_node_plan, SlurmOptions(time=time_limit))
        assert f"#SBATCH --time={time_limit}" in script


def test_values_an_sbatch_line_cannot_carry_are_refused(two_node_plan, tmp_path):
    with pytest.raises(LaunchError, match=r"--port 65000 .*up to 64536"):
        render_sbatch(two_node_plan, SlurmOptions(port=65000))
    with pytest.raises(LaunchError, match=r"log folder .*a b/slurm-logs holds a space"):
        render_sbatch(two_node_plan, SlurmOptions(workdir=str(tmp_path / "a b")))


# The body under bash, with stubs: `scontrol` names two nodes and the first one's NodeAddr (and
# records a requeue), `srun` runs its command as node 0 (passing USR1 on to all of its
# processes, as slurmstepd does), and the launcher records its arguments,
# waits for USR1 where the case says so, saves a step and exits with the case's code.
_LAUNCHER = """\
import os, pathlib, signal, sys, time
log = open(os.environ["LOG"], "a")
log.write("LAUNCH " + " ".join(sys.argv[1:]) + " RDZV_ID=" + os.environ["QWENTITAN_RDZV_ID"] + "\\n")
log.flush()
got = []
signal.signal(signal.SIGUSR1, lambda *_: got.append(1))
pathlib.Path(os.environ["READY"]).write_text(str(os.getpid()))
deadline = time.time() + 60
while os.environ["WAIT"] and not got and time.time() < deadline:
    time.sleep(0.05)
if os.environ["SAVE"]:
    pathlib.Path(os.environ["CHECKPOINTS"], "step-" + os.environ["SAVE"]).mkdir(parents=True)
sys.exit(int(os.environ["CODE"]))
"""


def _run_under_fake_slurm(
    tmp_path, plan, *, code, save="", signal_to=None, saved=(), end_time="", wait=False
):
    """Run the script with the stubs; (exit code, stdout, the stubs' log lines)."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "scontrol").write_text(
        "#!/bin/bash\n"
        'case "$1 $2" in\n'
        '  "show hostnames") echo node-a; echo node-b ;;\n'
        '  "show node") echo "NodeName=$3 Arch=x86_64"; '
        'echo "   NodeAddr=10.0.0.7 NodeHostName=$3 Version=22.05.8" ;;\n'
        '  requeue*) echo "REQUEUE $2" >> "$LOG" ;;\n'
        '  "show job") [[ -z $END_TIME ]] || echo "JobId=$3 EndTime=$END_TIME Deadline=N/A" ;;\n'
        "esac\n"
    )
    (bin_dir / "srun").write_text(  # like slurmstepd, it signals every process of the step
        "#!/bin/bash\n"
        'while [[ "$1" == --* ]]; do shift; done\n'
        'SLURM_NODEID=0 setsid "$@" & task=$!\n'
        "trap 'kill -USR1 -- -$task' USR1\n"
        'code=0; wait "$task" || code=$?\n'
        'while (( code > 128 )) && kill -0 "$task"; do code=0; wait "$task" || code=$?; done\n'
        'exit "$code"\n'
    )
    launcher = bin_dir / "launcher.py"
    launcher.write_text(_LAUNCHER)
    for f in bin_dir.iterdir():
        f.chmod(0o755)
    checkpoints = tmp_path / "run" / "checkpoint"
    for step in saved:
        (checkpoints / f"step-{step}").mkdir(parents=True)
    options = SlurmOptions(workdir=str(tmp_path), launcher=f"{sys.executable} {launcher}")
    script = write_sbatch(plan, tmp_path / "job.sbatch", options)
    log, ready = tmp_path / "log", tmp_path / "ready"
    env = {
        "PATH": f"{bin_dir}:/usr/bin:/bin",
        "LOG": str(log),
        "READY": str(ready),
        "CHECKPOINTS": str(checkpoints),
        "WAIT": "1" if signal_to or wait else "",
        "END_TIME": end_time,
        "SAVE": save,
        "CODE": str(code),
        "SLURM_JOB_ID": "1234",
        "SLURM_JOB_NAME": "job",
        "SLURM_JOB_NODELIST": "node-[a-b]",
    }
    batch = subprocess.Popen(
        ["bash", str(script)], env=env, cwd=tmp_path, stdout=subprocess.PIPE, text=True
    )
    if signal_to is not None:
        deadline = time.time() + 60
        while not ready.exists():
            assert time.time() < deadline and batch.poll() is None, "the launcher never started"
            time.sleep(0.05)
        # SLURM's B:USR1 (time limit) reaches the script; scancel --signal=USR1, the step
        os.kill(batch.pid if signal_to == "script" else int(ready.read_text()), signal.SIGUSR1)
    out, _ = batch.communicate(timeout=120)
    return batch.returncode, out, log.read_text().splitlines()


def test_the_script_runs_the_plan_at_the_first_nodes_address(tmp_path, two_node_plan):
    code, _, log = _run_under_fake_slurm(tmp_path, two_node_plan, code=0, save="10")
    assert code == 0
    # NodeAddr, not `hostname --ip-address` (127.0.1.1 on Debian); port and id from the job id
    assert log == [
        f"LAUNCH run --plan {tmp_path / 'job.plan.json'} --rdzv-endpoint 10.0.0.7:29734 "
        "RDZV_ID=qwentitan-1234"
    ]


def test_a_time_limit_stop_with_a_new_checkpoint_requeues_the_job(tmp_path, two_node_plan):
    code, out, log = _run_under_fake_slurm(
        tmp_path, two_node_plan, code=STOPPED_EXIT, save="5", saved=[2], signal_to="script"
    )
    assert log[-1] == "REQUEUE 1234" and code == 0
    assert "stopped for the time limit at step 5 of 10; requeueing job 1234" in out


def test_a_time_limit_stop_without_a_new_checkpoint_is_not_requeued(tmp_path, two_node_plan):
    code, out, log = _run_under_fake_slurm(
        tmp_path, two_node_plan, code=STOPPED_EXIT, saved=[2], signal_to="script"
    )
    assert code == STOPPED_EXIT and not [line for line in log if "REQUEUE" in line]
    assert "no new step was saved before the time limit (step 2 of 10)" in out
    assert "pass a longer --time" in out


def test_a_time_limit_signal_during_the_last_step_ends_the_job_well(tmp_path, two_node_plan):
    code, _, log = _run_under_fake_slurm(
        tmp_path, two_node_plan, code=STOPPED_EXIT, save="10", saved=[2], signal_to="script"
    )
    assert code == 0 and not [line for line in log if "REQUEUE" in line]


def test_a_time_limit_already_near_at_the_start_counts_as_signalled(tmp_path, two_node_plan):
    """SLURM's warning is lost when it comes before the script runs (seen with a 4-minute job
    and a 230 s grace): a job whose end is within the grace at the start stops and requeues."""
    soon = time.strftime("%Y-%m-%dT%H:%M:%S", time.localtime(time.time() + 60))
    code, out, log = _run_under_fake_slurm(
        tmp_path, two_node_plan, code=STOPPED_EXIT, save="1", end_time=soon, wait=True
    )
    assert log[-1] == "REQUEUE 1234" and code == 0
    assert "stopped for the time limit at step 1 of 10" in out


def test_a_failure_after_the_time_limit_signal_is_not_requeued(tmp_path, two_node_plan):
    code, out, log = _run_under_fake_slurm(
        tmp_path, two_node_plan, code=2, save="5", saved=[2], signal_to="script"
    )
    assert code == 2 and not [line for line in log if "REQUEUE" in line]
    assert "stopped" not in out and "requeue" not in out


def test_a_usr1_to_the_step_stops_it_without_a_requeue(tmp_path, two_node_plan):
    """`scancel --signal=USR1 JOB` signals the step, not the script: no requeue."""
    code, out, log = _run_under_fake_slurm(
        tmp_path, two_node_plan, code=STOPPED_EXIT, save="3", signal_to="step"
    )
    assert code == STOPPED_EXIT and not [line for line in log if "REQUEUE" in line]
    assert "stopped by a signal at step 3 of 10, checkpoint saved; sbatch this script again" in out


def test_the_agent_takes_the_jobs_rendezvous_id(monkeypatch):
    """The plan's id is per recipe; the job's (QWENTITAN_RDZV_ID) keeps two jobs apart."""
    import torch.distributed.run

    from qwentitan.launch.launcher import agent

    seen = []
    monkeypatch.setattr(torch.distributed.run, "run", seen.append)
    argv = ["--nnodes=2", "--rdzv-backend=c10d", "--rdzv-id=qwentitan-tiny_dense", "train.py"]
    assert agent.main(argv) == 0
    monkeypatch.setenv("QWENTITAN_RDZV_ID", "qwentitan-1234")
    assert agent.main(argv) == 0
    assert [args.rdzv_id for args in seen] == ["qwentitan-tiny_dense", "qwentitan-1234"]


def test_node_local_folders_of_a_multi_node_neuron_plan_are_one_warning_each(
    two_node_plan, tmp_path, monkeypatch, capsys
):
    """Issue 56: a NEFF cache and a Python on this host's own disk (the mount table that
    preflight's compile_cache check reads), one line each; none on a shared file system, none
    for one node."""
    from qwentitan.launch.launcher import cli
    from qwentitan.launch.launcher.preflight import compile_cache
    from qwentitan.launch.launcher.slurm import shared_folder_warnings

    local = "/dev/root / ext4 rw 0 0\n"
    cache = two_node_plan.env["TORCH_NEURONX_NEFF_CACHE_DIR"]
    neff, python = shared_folder_warnings(two_node_plan, local)
    assert neff.startswith(f"The NEFF cache {cache} (") and neff.endswith("Lustre.")
    assert "each of the 2 nodes compiles" in neff
    assert python.startswith(f"The script runs {sys.executable}, on this host's ext4 at /, not")
    shared = local + f"fs:/ {cache} lustre rw 0 0\nnfs:/ {sys.prefix} nfs4 rw 0 0\n"
    assert shared_folder_warnings(two_node_plan, shared) == []
    one_node = resolve_plan(RunRequest(recipe="qwen3_debugmodel", instance="trn2.48xlarge",
                                       seq_len=2048))  # fmt: skip
    assert shared_folder_warnings(one_node, local) == []
    # `slurm` says each on one line of stderr and still writes the script
    (tmp_path / "mounts").write_text(local)
    monkeypatch.setattr(compile_cache, "MOUNTS", tmp_path / "mounts")
    argv = ["slurm", "--recipe", "qwen3_debugmodel", "--instance", "trn2.48xlarge", "--nodes",
            "2", "--seq-len", "2048", "-o", str(tmp_path / "job.sbatch")]  # fmt: skip
    assert cli.main(argv) == 0
    said = capsys.readouterr().err.strip().splitlines()
    assert said == [f"qwentitan-launch slurm: warning: {line}" for line in (neff, python)]
    assert (tmp_path / "job.sbatch").is_file()
