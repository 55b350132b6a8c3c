"""An sbatch script for a planned multi-node run: SLURM allocates, torchrun launches, nothing home-made.

One task per node (`srun --ntasks-per-node=1`) runs `qwentitan-launch run`, which starts one
torchrun agent for the node's ranks and joins the c10d rendezvous hosted on the first node of
the allocation. The Neuron and EFA environment of the plan is exported before `srun`, so every
node sees the same settings. `--signal=USR1@<grace>` asks for a checkpoint before the time
limit, and `--requeue` plus the checkpoint folder let a preempted job resume where it stopped.
"""

from __future__ import annotations

import os
import shlex
from dataclasses import dataclass
from pathlib import Path

from qwentitan.launch.launcher.plan import TRAIN_ENTRY, LaunchPlan

DEFAULT_PORT = 29500


@dataclass(frozen=True, slots=True)
class SlurmOptions:
    """What SLURM needs beyond the plan."""

    job_name: str | None = None
    partition: str | None = None
    time: str | None = None  # e.g. "04:00:00"
    port: int = DEFAULT_PORT
    max_restarts: int = 3
    grace_seconds: int = 120
    log_dir: str = "slurm-logs"
    workdir: str | None = None
    launcher: str = "qwentitan-launch"


def render_sbatch(plan: LaunchPlan, options: SlurmOptions | None = None) -> str:
    """The sbatch script, as text."""
    o = options or SlurmOptions()
    job = o.job_name or f"qwentitan-{plan.recipe}"
    workdir = o.workdir or os.getcwd()
    header = [
        "#!/bin/bash",
        f"#SBATCH --job-name={job}",
        f"#SBATCH --nodes={plan.nodes}",
        "#SBATCH --ntasks-per-node=1",
        "#SBATCH --exclusive",
        f"#SBATCH --output={o.log_dir}/%x-%j.out",
        f"#SBATCH --signal=USR1@{o.grace_seconds}",
        "#SBATCH --requeue",
    ]
    if o.partition:
        header.append(f"#SBATCH --partition={o.partition}")
    if o.time:
        header.append(f"#SBATCH --time={o.time}")

    run_args = [
        "run",
        "--recipe",
        plan.recipe,
        "--instance",
        plan.topology.name,
        "--lnc",
        str(plan.lnc),
        "--ranks-per-node",
        str(plan.ranks_per_node),
        "--max-restarts",
        str(o.max_restarts),
        *_knob_args(plan),
    ]
    quoted = " ".join(shlex.quote(a) for a in run_args)
    body = [
        "",
        f"# {plan.world_size} ranks = {plan.nodes} nodes x {plan.ranks_per_node} "
        f"({plan.topology.name}, LNC {plan.lnc}); FSDP {plan.degrees.data_parallel_shard}, "
        f"TP {plan.degrees.tensor_parallel}, EP {plan.degrees.expert_parallel}.",
        "# Activate the environment holding qwentitan (and torch-neuronx) before sbatch;",
        "# SLURM exports it to every node.",
        "set -euo pipefail",
        f"cd {shlex.quote(workdir)}",
        f"mkdir -p {shlex.quote(o.log_dir)}",
        "",
        "# The first node of the allocation hosts the c10d rendezvous.",
        'mapfile -t NODES < <(scontrol show hostnames "$SLURM_JOB_NODELIST")',
        'HEAD_NODE="${NODES[0]}"',
        "HEAD_ADDR=$(srun --nodes=1 --ntasks=1 -w \"$HEAD_NODE\" hostname --ip-address | awk '{print $1}')",
        f"RDZV_PORT={o.port}",
        "",
        "# Neuron runtime and compiler (LNC kept equal), compile cache, EFA.",
        *(f"export {k}={shlex.quote(v)}" for k, v in plan.env.items()),
        "",
        "# One task per node; each runs one torchrun agent for that node's ranks:",
        f"#   torchrun --nnodes={plan.nodes} --nproc-per-node={plan.ranks_per_node} "
        "--rdzv-backend=c10d --rdzv-endpoint=$HEAD_ADDR:$RDZV_PORT "
        f"-m {TRAIN_ENTRY} {shlex.join(plan.trainer_args())}",
        f"srun --nodes={plan.nodes} --ntasks-per-node=1 --kill-on-bad-exit=1 \\",
        f"  {shlex.quote(o.launcher)} {quoted} \\",
        '  --nnodes "$SLURM_JOB_NUM_NODES" --node-rank "$SLURM_NODEID" \\',
        '  --rdzv-endpoint "$HEAD_ADDR:$RDZV_PORT"',
        "",
    ]
    return "\n".join(header + body)


def write_sbatch(plan: LaunchPlan, path: str | Path, options: SlurmOptions | None = None) -> Path:
    """Write the script atomically (temporary sibling, then rename) and make it executable."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(render_sbatch(plan, options))
    tmp.chmod(0o755)
    tmp.replace(path)
    return path


def _knob_args(plan: LaunchPlan) -> list[str]:
    """Re-state the plan's knobs so every node resolves the same plan."""
    args: list[str] = []
    d = plan.degrees
    if d.tensor_parallel != 1:
        args += ["--tp", str(d.tensor_parallel)]
    if d.expert_parallel != 1:
        args += ["--ep", str(d.expert_parallel)]
    flags = {
        "--training.seq-len": "--seq-len",
        "--training.local-batch-size": "--local-batch-size",
        "--training.global-batch-size": "--global-batch-size",
        "--training.steps": "--steps",
        "--parallelism.data-parallel-shard-degree": "--fsdp",
        "--dump-folder": "--dump-folder",
        "--checkpoint.interval": "--checkpoint-interval",
    }
    it = iter(plan.overrides)
    for word in it:
        if word in flags:
            args += [flags[word], next(it)]
        elif word.startswith("activation-checkpoint:"):
            args += ["--ac", word.split(":", 1)[1]]
    return args
