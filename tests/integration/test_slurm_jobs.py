"""The sbatch script `qwentitan-launch slurm` writes, submitted to a real SLURM: the two-node
cluster of scripts/slurm_cluster.sh (Debian's slurm-wlm on this machine; nodes n1 and n2 of one
CPU each, partition `debug`). Without a cluster that answers `sinfo`, every test here skips.

Two shared jobs, since each run costs a start of torch on every node:
- `two_node_job`: tiny_moe on 2 nodes x 1 rank (two torchrun agents joining one c10d rendezvous,
  FSDP and the MoE across them), 5 steps, written in one folder and submitted from another with
  `sbatch --export=NONE`, with its time limit within the grace from the start
  (`--time 4 --grace-seconds 240`: SLURM signals it in its first 30 s, or before the script runs,
  which the script makes up for), so its script requeues it after step 1 whatever the machine's
  speed; the test then gives the requeued run a longer limit, as a user would, and it resumes to
  the end. A stop on two nodes is what srun's --kill-on-bad-exit once turned into 143:0.
- `usr1_chain`: tiny_dense on one node, an 8-step job stopped by `scancel --signal=USR1` after
  step 3, then the same script submitted again.
"""

from __future__ import annotations

import contextlib
import os
import re
import subprocess
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import pytest
from torch.distributed.checkpoint import FileSystemReader

from qwentitan.launch.launcher.cli import main as launch_main
from qwentitan.launch.launcher.resume import saved_steps
from qwentitan.launch.launcher.supervisor import STOPPED_EXIT

pytestmark = pytest.mark.slow

PARTITION = "debug"
ENDED = {"COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY", "DEADLINE"}
JOB_TIMEOUT_S = 900.0  # a job on this 2-core machine under load; normally 1-2 min
_STEP_LINE = re.compile(r"(?<!validate )step:\s+(\d+)\s+loss")


@pytest.fixture(scope="module")
def cluster() -> None:
    try:
        result = subprocess.run(
            ["sinfo", "-h", "-p", PARTITION, "-o", "%D"],
            capture_output=True, text=True, timeout=30,
        )  # fmt: skip
    except (OSError, subprocess.TimeoutExpired) as error:
        pytest.skip(f"no SLURM here ({error}); start one with scripts/slurm_cluster.sh up")
    if result.returncode != 0 or result.stdout.strip() != "2":
        pytest.skip(
            f"no two-node SLURM partition {PARTITION!r} answers (sinfo: "
            f"{(result.stderr or result.stdout).strip()[:200]}); start one with "
            "scripts/slurm_cluster.sh up"
        )


def write_script(workdir: Path, recipe: str, *args: str) -> Path:
    """`qwentitan-launch slurm --recipe RECIPE ... -o job.sbatch`, run in `workdir` (in this
    process)."""
    workdir.mkdir(parents=True, exist_ok=True)
    with contextlib.chdir(workdir):
        code = launch_main(
            ["slurm", "--recipe", recipe, "--ranks-per-node", "1", "--partition", PARTITION,
             "--dump-folder", "D", "-o", "job.sbatch", *args, "--", "--validator.no-enable"]
        )  # fmt: skip
    assert code == 0
    return workdir / "job.sbatch"


def sbatch(script: Path, cwd: Path, *options: str) -> int:
    result = subprocess.run(
        ["sbatch", "--parsable", *options, str(script)],
        cwd=cwd, capture_output=True, text=True, timeout=60,
        env={**os.environ, "QWENTITAN_MLFLOW": "off"},
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    return int(result.stdout.strip().split(";")[0])


def job(job_id: int) -> dict[str, str]:
    """`scontrol show job` as a dict (JobState, ExitCode, Restarts, ...)."""
    out = subprocess.run(
        ["scontrol", "-o", "show", "job", str(job_id)],
        capture_output=True, text=True, timeout=60, check=True,
    ).stdout  # fmt: skip
    return dict(re.findall(r"(\w+)=(\S*)", out))


def scontrol(*args: str) -> None:
    subprocess.run(["scontrol", *args], capture_output=True, timeout=60, check=True)


def wait_for(what: str, ready: Callable[[], bool], job_id: int) -> None:
    deadline = time.monotonic() + JOB_TIMEOUT_S
    while not ready():
        state = job(job_id)
        if state.get("JobState") in ENDED and not ready():
            raise AssertionError(f"job {job_id} ended ({state}) before {what}")
        assert time.monotonic() < deadline, f"timed out waiting for {what} in job {job_id}"
        time.sleep(0.5)


def wait_ended(job_id: int) -> dict[str, str]:
    deadline = time.monotonic() + JOB_TIMEOUT_S
    while (state := job(job_id))["JobState"] not in ENDED:
        assert time.monotonic() < deadline, f"timed out waiting for job {job_id}: {state}"
        time.sleep(1)
    return state


@dataclass(frozen=True)
class Job:
    id: int
    recipe: str
    state: dict[str, str]
    workdir: Path
    submitted_from: Path | None = None

    @property
    def log(self) -> Path:
        return self.workdir / "slurm-logs" / f"qwentitan-{self.recipe}-{self.id}.out"

    def text(self, node: int = 0) -> str:
        """The job's log (node 0's output), or node `node`'s beside it."""
        log = self.log if node == 0 else self.log.with_name(f"{self.log.stem}.node{node}.out")
        return log.read_text(errors="replace") if log.exists() else ""

    def steps(self) -> list[int]:
        return [int(n) for n in _STEP_LINE.findall(self.text())]

    @property
    def checkpoints(self) -> list[int]:
        return saved_steps(self.workdir / "D" / "checkpoint")


@pytest.fixture(scope="module")
def two_node_job(cluster, tmp_path_factory) -> Job:
    workdir = tmp_path_factory.mktemp("two-nodes")
    script = write_script(
        workdir, "tiny_moe", "--nodes", "2", "--steps", "5", "--time", "4", "--grace-seconds", "240"
    )
    elsewhere = tmp_path_factory.mktemp("submitted-from")
    # No `training_slot`: the job waits on SLURM (queueing, the requeue) far longer than its
    # ranks compute, and what it asserts does not depend on the machine's speed.
    job_id = sbatch(script, elsewhere, "--export=NONE")
    wait_for("the requeue", lambda: int(job(job_id).get("Restarts", 0)) >= 1, job_id)
    # The requeued run would be signalled at once too, and stop where it resumed: not requeued.
    scontrol("update", f"JobId={job_id}", "TimeLimit=30")
    return Job(job_id, "tiny_moe", wait_ended(job_id), workdir, elsewhere)


def runs(log: str) -> list[str]:
    """A job's log cut at the line its script prints as each run starts."""
    return re.split(r"^qwentitan: job \d+, run \d+,.*$", log, flags=re.M)[1:]


def test_a_two_node_job_completes_at_the_first_sbatch_from_another_folder(two_node_job):
    """The log folder and the working folder are the script's, not where sbatch runs; with
    --export=NONE the job has none of the caller's environment and still starts qwentitan."""
    assert two_node_job.state["JobState"] == "COMPLETED", two_node_job.text()[-3000:]
    assert two_node_job.state["ExitCode"] == "0:0"
    assert two_node_job.checkpoints[-1] == 5
    assert two_node_job.steps() == [1, 2, 3, 4, 5]  # each once: one node's rank in this log
    assert not list(two_node_job.submitted_from.iterdir())  # nothing where sbatch ran
    # QWENTITAN_MLFLOW=off was in sbatch's environment: under --export=NONE the ranks did not get
    # it, and rank 0 (on either node) logged to MLflow
    both = two_node_job.text() + two_node_job.text(node=1)
    assert f"logged to sqlite:///{two_node_job.workdir}/mlflow.db" in both


def test_the_two_nodes_train_one_moe_model_each_saving_its_shard(two_node_job):
    assert "ranks         2 = 2 x 1 per node" in two_node_job.text()
    assert "ranks         2 = 2 x 1 per node" in two_node_job.text(node=1)
    step = two_node_job.workdir / "D" / "checkpoint" / "step-5"
    # DCP writes one shard file per rank: both nodes' ranks took part
    assert len(list(step.glob("*.distcp"))) == 2
    # the MoE trained end to end: its routed experts and router are in the checkpoint
    saved = FileSystemReader(step).read_metadata().state_dict_metadata
    assert any(".moe.routed_experts." in key for key in saved), sorted(saved)[:20]
    assert any(".moe.router.gate." in key for key in saved), sorted(saved)[:20]


def test_a_time_limit_stop_is_requeued_and_resumed_to_completion(two_node_job):
    text = two_node_job.text()
    assert two_node_job.state["Restarts"] == "1"
    run1, run2 = runs(text)  # both runs' lines, in one log (--open-mode=append)
    stopped_at = [int(n) for n in _STEP_LINE.findall(run1)][-1]
    assert stopped_at < 5
    assert f"stopped for the time limit at step {stopped_at} of 5; requeueing" in run1
    assert [int(n) for n in _STEP_LINE.findall(run2)] == list(range(stopped_at + 1, 6))
    assert stopped_at in two_node_job.checkpoints


def test_the_log_holds_each_line_once_without_colour(two_node_job):
    text, node1 = two_node_job.text(), two_node_job.text(node=1)
    assert "\x1b[" not in text + node1
    # once, the finished run's: the stopped one's console says "Stopping after step" instead
    # (runtime.console leaves torchtitan's finished-run lines after a stop to RUN_DIR/logs)
    assert text.count("Training completed") == 1 and "Stopping after step" in runs(text)[0]
    # the second node's output is kept beside the job's log; each run's lines in the job's log
    # come from one rank, labelled with its global rank
    assert re.search(r"step:\s+5\s+loss", node1)
    for run in runs(text):
        assert len(set(re.findall(r"^\[rank(\d+)\]:", run, flags=re.M))) == 1
    # the rendezvous: the first node's SLURM address (NodeAddr) and a port from the job id
    assert f"--rdzv-endpoint=127.0.0.1:{29500 + two_node_job.id % 1000} " in text


@dataclass(frozen=True)
class Usr1Chain:
    stopped: Job  # scancel --signal=USR1 after step 3
    first_log: str  # its log as it was when it ended
    resubmitted: Job  # the same script again


@pytest.fixture(scope="module")
def usr1_chain(cluster, tmp_path_factory) -> Usr1Chain:
    root = tmp_path_factory.mktemp("usr1")
    workdir = root / "work"
    script = write_script(workdir, "tiny_dense", "--nodes", "1", "--steps", "8")
    first = sbatch(script, root)  # no `training_slot`, as two_node_job
    probe = Job(first, "tiny_dense", {}, workdir)
    wait_for("step 3", lambda: 3 in probe.steps(), first)
    subprocess.run(["scancel", "--signal=USR1", str(first)], check=True, timeout=60)
    stopped = Job(first, "tiny_dense", wait_ended(first), workdir)
    first_log = stopped.text()
    second = sbatch(script, root)
    return Usr1Chain(stopped, first_log, Job(second, "tiny_dense", wait_ended(second), workdir))


def test_usr1_stops_with_a_checkpoint_and_no_requeue(usr1_chain):
    stopped = usr1_chain.stopped
    assert stopped.state["ExitCode"] == f"{STOPPED_EXIT}:0", usr1_chain.first_log[-3000:]
    assert stopped.state["Restarts"] == "0"
    last = stopped.steps()[-1]
    assert 3 <= last < 8
    assert f"stopped by a signal at step {last} of 8, checkpoint saved" in usr1_chain.first_log


def test_resubmitting_continues_to_the_last_step_and_keeps_the_first_log(usr1_chain):
    stopped, again = usr1_chain.stopped, usr1_chain.resubmitted
    assert again.state["JobState"] == "COMPLETED", again.text()[-3000:]
    assert again.state["ExitCode"] == "0:0"
    last = stopped.steps()[-1]
    assert again.steps() == list(range(last + 1, 9))
    assert again.checkpoints[-1] == 8 and last in again.checkpoints
    assert stopped.text() == usr1_chain.first_log  # the first job's log is its own, kept
