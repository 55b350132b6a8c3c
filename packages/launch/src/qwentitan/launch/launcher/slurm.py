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
import re
import shlex
from dataclasses import dataclass
from pathlib import Path

from qwentitan.launch.base.errors import LaunchError
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


# What SLURM takes (sbatch(1)): partition names, comma-separated; the --time formats "M",
# "M:S", "H:M:S", "D-H", "D-H:M", "D-H:M:S" and UNLIMITED; job names without spaces.
_PARTITION = re.compile(r"[A-Za-z0-9_.-]+(,[A-Za-z0-9_.-]+)*")
_TIME = re.compile(
    r"\d+(:\d{1,2}){0,2}|\d+-\d{1,2}(:\d{1,2}){0,2}|UNLIMITED|INFINITE", re.IGNORECASE
)
_JOB_NAME = re.compile(r"[A-Za-z0-9_.+-]+")
_ENV_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")
_CONTROL = re.compile(r"[\x00-\x1f\x7f]")


def check_options(plan: LaunchPlan, o: SlurmOptions, workdir: str, plan_file: str) -> None:
    """Refuse (LaunchError) any value that is not what its line of the script expects, before
    it is written: a newline in a value would start a command of its own."""
    for flag, value, pattern, what in (
        ("--partition", o.partition, _PARTITION, "letters, digits, _ . - and commas"),
        ("--time", o.time, _TIME, "minutes, H:M:S or D-H:M:S"),
        ("job name", o.job_name, _JOB_NAME, "letters, digits and _ . + -"),
    ):
        if value is not None and not pattern.fullmatch(value):
            raise LaunchError(
                f"{flag} {value!r} is not a SLURM {flag.lstrip('-')} ({what}); pass one that is."
            )
    for name in plan.env:
        if not _ENV_NAME.fullmatch(name):
            raise LaunchError(f"Environment variable name {name!r} cannot be exported; rename it.")
    values = {
        "--dump-folder and the overrides": " ".join(plan.trainer_args()),
        "the environment": " ".join(plan.env.values()),
        "the working folder": workdir,
        "the plan file": plan_file,
        "the log folder": o.log_dir,
        "the launcher": o.launcher,
    }
    for where, value in values.items():
        if _CONTROL.search(value):
            raise LaunchError(
                f"A value of {where} holds a control character (a newline, tab, ...), which an "
                f"sbatch script cannot carry safely: {value[:80]!r}; pass it without."
            )
    if re.search(r"\s", o.log_dir):
        raise LaunchError(f"The log folder {o.log_dir!r} holds a space; pick one without.")


def render_sbatch(
    plan: LaunchPlan, options: SlurmOptions | None = None, plan_file: str | Path = "PLAN.json"
) -> str:
    """The sbatch script running the plan saved at `plan_file`, as text; LaunchError for a value
    it cannot carry (`check_options`)."""
    o = options or SlurmOptions()
    job = o.job_name or f"qwentitan-{plan.recipe}"
    workdir = o.workdir or os.getcwd()
    check_options(plan, o, workdir, str(plan_file))
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
    from qwentitan.checkpoint.files import atomic_file

    path = Path(path)
    if path.is_dir():
        raise LaunchError(f"{path} is a folder; pass -o with a file name for the sbatch script.")
    plan_file = path.with_name(f"{path.stem}.plan.json").absolute()
    script = render_sbatch(plan, options, plan_file)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        save_plan(plan, plan_file)
        with atomic_file(path) as tmp:
            tmp.write_text(script)
            tmp.chmod(0o755)
    except OSError as error:
        raise LaunchError(
            f"Could not write {path} ({error.strerror or error}); pass -o with a writable path."
        ) from None
    return path
