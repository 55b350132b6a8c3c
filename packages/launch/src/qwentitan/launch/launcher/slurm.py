"""An sbatch script for a planned multi-node run: SLURM allocates, torchrun launches, nothing home-made.

The plan is resolved once, here, and written beside the script (`plan_file`); one task per node
(`srun --ntasks-per-node=1`) runs `qwentitan-launch run --plan FILE`, which starts one torchrun
agent for the node's ranks with exactly that plan (its overrides and its environment) and joins
the c10d rendezvous hosted on the first node of the allocation. `--signal=USR1@<grace>` asks for
a checkpoint before the time limit, and `--requeue` plus the checkpoint folder let a preempted
job resume where it stopped.
"""

from __future__ import annotations

import os
import shlex
from dataclasses import dataclass
from pathlib import Path

from qwentitan.launch.launcher.plan import TRAIN_ENTRY, LaunchPlan
from qwentitan.launch.launcher.plan_file import save_plan

DEFAULT_PORT = 29500


@dataclass(frozen=True, slots=True)
class SlurmOptions:
    """What SLURM needs beyond the plan."""

    job_name: str | None = None
    partition: str | None = None
    time: str | None = None  # e.g. "04:00:00"
    port: int = DEFAULT_PORT
    grace_seconds: int = 120
    log_dir: str = "slurm-logs"
    workdir: str | None = None
    launcher: str = "qwentitan-launch"


def render_sbatch(
    plan: LaunchPlan, options: SlurmOptions | None = None, plan_file: str | Path = "PLAN.json"
) -> str:
    """The sbatch script, as text, running the plan saved at `plan_file`."""
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

    quoted = shlex.join(["run", "--plan", str(plan_file)])
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
        "# The plan file holds the ranks' environment too (Neuron, compile cache, EFA):",
        *(f"#   {k}={shlex.quote(v)}" for k, v in plan.env.items()),
        "",
        "# One task per node; each runs one torchrun agent for that node's ranks:",
        f"#   torchrun --nnodes={plan.nodes} --nproc-per-node={plan.ranks_per_node} "
        "--rdzv-backend=c10d --rdzv-endpoint=$HEAD_ADDR:$RDZV_PORT "
        f"-m {TRAIN_ENTRY} {shlex.join(plan.trainer_args())}",
        f"srun --nodes={plan.nodes} --ntasks-per-node=1 --kill-on-bad-exit=1 \\",
        f"  {shlex.quote(o.launcher)} {quoted} \\",
        '  --rdzv-endpoint "$HEAD_ADDR:$RDZV_PORT"',
        "",
    ]
    return "\n".join(header + body)


def write_sbatch(plan: LaunchPlan, path: str | Path, options: SlurmOptions | None = None) -> Path:
    """Write the plan file (`<script>.plan.json`) and the script, each atomically; the script is
    executable."""
    path = Path(path)
    plan_file = save_plan(plan, path.with_name(f"{path.stem}.plan.json")).resolve()
    from qwentitan.checkpoint.files import atomic_file  # its package imports torch, for now

    with atomic_file(path) as tmp:
        Path(tmp).write_text(render_sbatch(plan, options, plan_file))
        Path(tmp).chmod(0o755)
    return path
