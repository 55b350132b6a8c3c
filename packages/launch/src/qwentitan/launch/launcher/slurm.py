"""An sbatch script for a planned multi-node run: SLURM allocates, torchrun launches, nothing home-made.

The plan is resolved once, here, and written beside the script (`plan_file`); one task per node
(`srun --ntasks-per-node=1`) runs `qwentitan-launch run --plan FILE`, which starts one torchrun
agent for the node's ranks with exactly that plan (its overrides and its environment) and joins
the c10d rendezvous hosted on the first node of the allocation.

What a real SLURM (22.05, tests/integration/test_slurm_jobs.py) asks of the script:
- slurmd opens `--output` before the script runs, relative to the folder sbatch ran in: the log
  path is absolute and its folder is made when the script is written;
- under `sbatch --export=NONE` the job has no PATH of the user's: qwentitan is called by this
  Python's absolute path and the step is `srun --export=ALL`;
- a node's own name may resolve to 127.0.1.1 there (Debian's /etc/hosts): the rendezvous host is
  the first node's SLURM address (NodeAddr); its port and id come from the job id, so two jobs
  on one node keep apart;
- `--requeue` never applies to a time limit: SLURM signals the script (`B:USR1`) `grace` seconds
  ahead, the script passes USR1 on to the ranks (checkpoint at the next step) and, when they
  stopped (`STOPPED_EXIT`) with a new checkpoint short of the last step, requeues the job
  itself (`scontrol requeue`); `--open-mode=append` keeps each run's lines in the one log. srun
  sees a stop as exit 0 (its `--kill-on-bad-exit` would otherwise end the other nodes as the
  first one stops); the checkpoint folder tells a stop from the end.
  `scancel --signal=USR1 JOB` reaches the ranks only: the same checkpoint, no requeue.
"""

from __future__ import annotations

import os
import re
import shlex
import sys
from dataclasses import dataclass
from pathlib import Path

from qwentitan.launch.base.env_defaults import RDZV_ID
from qwentitan.launch.base.errors import LaunchError
from qwentitan.launch.launcher.plan import TRAIN_ENTRY, LaunchPlan
from qwentitan.launch.launcher.plan_file import save_plan
from qwentitan.launch.launcher.supervisor import STOPPED_EXIT

DEFAULT_PORT = 29500
# A job's rendezvous port is the base port plus its job id modulo this.
PORT_SPAN = 1000
# Overrides every rank of an sbatch job gets: its output goes to a log file, not a terminal.
LOG_FILE_OVERRIDES = ("--metrics.disable-color-printing",)


@dataclass(frozen=True, slots=True)
class SlurmOptions:
    """What SLURM needs beyond the plan."""

    job_name: str | None = None
    partition: str | None = None
    time: str | None = None  # e.g. "04:00:00"
    port: int = DEFAULT_PORT  # the first of PORT_SPAN rendezvous ports
    grace_seconds: int = 120
    log_dir: str = "slurm-logs"  # relative to the working folder
    workdir: str | None = None
    launcher: str | None = None  # default: this Python's `-m qwentitan.launch.launcher.cli`


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
    if o.port + PORT_SPAN - 1 > 65535:
        raise LaunchError(
            f"--port {o.port} leaves no room for the {PORT_SPAN} ports a job picks from by its "
            f"id; pass one up to {65536 - PORT_SPAN}."
        )
    values = {
        "--dump-folder and the overrides": " ".join(plan.trainer_args()),
        "the environment": " ".join(plan.env.values()),
        "the working folder": workdir,
        "the plan file": plan_file,
        "the log folder": o.log_dir,
        "the launcher": o.launcher or "",
    }
    for where, value in values.items():
        if _CONTROL.search(value):
            raise LaunchError(
                f"A value of {where} holds a control character (a newline, tab, ...), which an "
                f"sbatch script cannot carry safely: {value[:80]!r}; pass it without."
            )
    # #SBATCH lines are split at white space: the log folder and --chdir cannot hold any.
    for where, value in (("log folder", log_folder(o, workdir)), ("working folder", workdir)):
        if re.search(r"\s", str(value)):
            raise LaunchError(
                f"The {where} {value} holds a space, which an #SBATCH line cannot carry; write "
                "the script from a folder without one."
            )


def log_folder(o: SlurmOptions, workdir: str) -> Path:
    """Where the job's logs go, absolute: slurmd opens them before the script runs."""
    return Path(workdir, o.log_dir)


def _header(plan: LaunchPlan, o: SlurmOptions, workdir: str) -> list[str]:
    log = f"{log_folder(o, workdir)}/%x-%j.out"
    header = [
        "#!/bin/bash",
        f"#SBATCH --job-name={o.job_name or f'qwentitan-{plan.recipe}'}",
        f"#SBATCH --nodes={plan.nodes}",
        "#SBATCH --ntasks-per-node=1",
        "#SBATCH --exclusive",
        f"#SBATCH --chdir={workdir}",
        f"#SBATCH --output={log}",
        f"#SBATCH --error={log}",
        "#SBATCH --open-mode=append",
        "#SBATCH --export=ALL",
        f"#SBATCH --signal=B:USR1@{o.grace_seconds}",
        "#SBATCH --requeue",
    ]
    if o.partition:
        header.append(f"#SBATCH --partition={o.partition}")
    if o.time:
        header.append(f"#SBATCH --time={o.time}")
    return header


def _about(plan: LaunchPlan, o: SlurmOptions) -> list[str]:
    """The comment block: what runs, and how to stop it."""
    return [
        "",
        f"# {plan.world_size} ranks = {plan.nodes} nodes x {plan.ranks_per_node} "
        f"({plan.topology.name}, LNC {plan.lnc}); FSDP {plan.dims.dp_shard}, "
        f"TP {plan.dims.tp}, EP {plan.dims.ep}.",
        "# qwentitan is called by the absolute path of the Python that wrote this script, so the",
        "# job needs no activated environment (sbatch --export=NONE works too).",
        "#",
        f"# Stop: `scancel --signal=USR1 JOBID` checkpoints at the next step and ends the job "
        f"(exit {STOPPED_EXIT});",
        "# sbatch this script again to continue from that checkpoint. A plain `scancel` leaves the",
        "# ranks about 30 s (SLURM's KillWait) to checkpoint. Before the time limit SLURM sends",
        f"# USR1 to this script ({o.grace_seconds} s ahead): it stops the ranks the same way and "
        "requeues the job",
        f"# until step {plan.steps} is saved.",
        "set -euo pipefail",
        'echo "qwentitan: job $SLURM_JOB_ID, run $((${SLURM_RESTART_COUNT:-0} + 1)), on '
        '$SLURM_JOB_NODELIST, $(date -Is)"',
    ]


def _rendezvous(plan: LaunchPlan, o: SlurmOptions) -> list[str]:
    lines = [
        "",
        "# The first node hosts the c10d rendezvous at its SLURM address (NodeAddr: its name may",
        "# resolve to 127.0.1.1 there); port and rendezvous id are this job's own.",
        'mapfile -t NODES < <(scontrol show hostnames "$SLURM_JOB_NODELIST")',
        "HEAD_ADDR=$(scontrol show node \"${NODES[0]}\" | sed -n 's/.*NodeAddr=\\([^ ]*\\).*/\\1/p')",
        f"RDZV_PORT=$(({o.port} + SLURM_JOB_ID % {PORT_SPAN}))",
        f'export {RDZV_ID}="qwentitan-$SLURM_JOB_ID"',
    ]
    if plan.topology.device_type == "cpu":
        lines += [
            "# Threads per rank from the CPUs SLURM gave the node, not from the cores it has.",
            f"THREADS=$((SLURM_CPUS_ON_NODE / {plan.ranks_per_node}))",
            "export OMP_NUM_THREADS=${OMP_NUM_THREADS:-$((THREADS > 0 ? THREADS : 1))}",
        ]
    return [
        *lines,
        "",
        "# The plan file holds the ranks' environment too (Neuron, compile cache, EFA):",
        *(f"#   {k}={shlex.quote(v)}" for k, v in plan.env.items()),
        "",
        "# One task per node; each runs one torchrun agent for that node's ranks:",
        f"#   torchrun --nnodes={plan.nodes} --nproc-per-node={plan.ranks_per_node} "
        "--rdzv-backend=c10d --rdzv-endpoint=$HEAD_ADDR:$RDZV_PORT "
        f"--rdzv-id=${RDZV_ID} -m {TRAIN_ENTRY} {shlex.join(plan.trainer_args())}",
    ]


def _step(plan: LaunchPlan, o: SlurmOptions, workdir: str, plan_file: str) -> list[str]:
    """The srun step, in the background so that the time-limit trap runs while it trains."""
    launcher = o.launcher or shlex.join([sys.executable, "-m", "qwentitan.launch.launcher.cli"])
    checkpoints = Path(workdir, plan.checkpoint_folder)
    node_log = shlex.quote(str(log_folder(o, workdir))) + '/"$SLURM_JOB_NAME-$SLURM_JOB_ID"'
    return [
        f"CHECKPOINTS={shlex.quote(str(checkpoints))}",
        "saved_step() { { ls \"$CHECKPOINTS\" 2>/dev/null || true; } | sed -n 's/^step-\\([0-9]*\\)$/\\1/p' "
        "| sort -n | tail -n 1; }",
        "FROM_STEP=$(saved_step)",
        "# The time limit's USR1 is passed on to the step (srun hands it to every process) every",
        "# 2 s until the step ends: qwentitan and the ranks ignore USR1 while they start (and srun",
        "# and the step's shell need a moment to set their handlers).",
        'pass_on() { while sleep 2 && kill -USR1 "$STEP" 2>/dev/null; do :; done; }',
        "TIME_UP= STEP=",
        "trap 'TIME_UP=1; [[ -z $STEP ]] || pass_on &' USR1",
        "# SLURM's signal is lost when it comes before this script runs: a limit that near at",
        "# the start counts as signalled.",
        "END=$(scontrol show job \"$SLURM_JOB_ID\" | sed -n 's/.*EndTime=\\([^ ]*\\).*/\\1/p') || END=",
        'if [[ -n $END ]] && END_S=$(date -d "$END" +%s 2>/dev/null) &&',
        f"  ((END_S - $(date +%s) <= {o.grace_seconds})); then",
        "  TIME_UP=1",
        "fi",
        "",
        "# Node 0's output goes to this log, each other node's to <log>.node<N>.out beside it: every",
        "# node's torchrun shows its local rank 0, which would print each line once per node here.",
        "# Lines are labelled with the global rank: c10d orders the ranks by node address and",
        "# process id, so rank 0 (MLflow, the summary) may be on another node than node 0.",
        "export TORCHELASTIC_LOG_LINE_PREFIX_TEMPLATE='[rank${rank}]:'",
        f"# A stop (exit {STOPPED_EXIT}) is exit 0 to srun: its --kill-on-bad-exit would end the "
        "other nodes",
        "# as the first one stops. The checkpoint folder tells a stop from the end (below).",
        f"srun --export=ALL --nodes={plan.nodes} --ntasks-per-node=1 --kill-on-bad-exit=1 \\",
        '  bash -c \'trap "" USR1; [[ $SLURM_NODEID == 0 ]] || '
        f'exec >>"$0.node$SLURM_NODEID.out" 2>&1; "$@"; c=$?; exit $((c == {STOPPED_EXIT} ? 0 : c))\' '
        "\\",
        f"  {node_log} \\",
        f"  {launcher} {shlex.join(['run', '--plan', plan_file])} \\",
        '  --rdzv-endpoint "$HEAD_ADDR:$RDZV_PORT" &',
        "STEP=$!",
        "[[ -z $TIME_UP ]] || pass_on &",
        "# The trap ends `wait` early (128 + signal): wait again until the step has ended.",
        'CODE=0; wait "$STEP" || CODE=$?',
        'while (( CODE > 128 )) && kill -0 "$STEP" 2>/dev/null; do CODE=0; wait "$STEP" || CODE=$?; done',
    ]


def _requeue(plan: LaunchPlan) -> list[str]:
    """After the step: a stop left a checkpoint short of the last step; the time limit's is
    requeued when it saved a new step."""
    if not plan.config.checkpoint.enable:
        return ["", "# No checkpoints in this plan: a stop cannot be resumed.", 'exit "$CODE"', ""]
    steps = plan.steps
    return [
        "",
        "TO_STEP=$(saved_step)",
        f"if (( CODE == 0 && ${{TO_STEP:-0}} < {steps} )); then",
        "  if [[ -n $TIME_UP ]] && (( ${TO_STEP:-0} > ${FROM_STEP:-0} )); then",
        f'    echo "qwentitan: stopped for the time limit at step $TO_STEP of {steps}; '
        'requeueing job $SLURM_JOB_ID to continue."',
        '    exec scontrol requeue "$SLURM_JOB_ID"',
        "  elif [[ -n $TIME_UP ]]; then",
        f'    echo "qwentitan: no new step was saved before the time limit (step ${{TO_STEP:-0}} of '
        f'{steps}); not requeued: pass a longer --time."',
        "  else",
        f'    echo "qwentitan: stopped by a signal at step ${{TO_STEP:-0}} of {steps}, '
        'checkpoint saved; sbatch this script again to continue."',
        "  fi",
        f"  exit {STOPPED_EXIT}",
        "fi",
        'exit "$CODE"',
        "",
    ]


def render_sbatch(
    plan: LaunchPlan, options: SlurmOptions | None = None, plan_file: str | Path = "PLAN.json"
) -> str:
    """The sbatch script running the plan saved at `plan_file`, as text; LaunchError for a value
    it cannot carry (`check_options`)."""
    o = options or SlurmOptions()
    workdir = os.path.abspath(o.workdir or os.getcwd())
    check_options(plan, o, workdir, str(plan_file))
    lines = [
        *_header(plan, o, workdir),
        *_about(plan, o),
        *_rendezvous(plan, o),
        *_step(plan, o, workdir, str(plan_file)),
        *_requeue(plan),
    ]
    return "\n".join(lines)


def write_sbatch(
    plan: LaunchPlan,
    path: str | Path,
    options: SlurmOptions | None = None,
    *,
    overwrite: bool = False,
) -> Path:
    """Write the plan file (`<script>.plan.json`) and the script, each atomically (the script
    executable), and make the log folder: slurmd opens the log before the script runs. An
    existing script or plan file is replaced only with `overwrite` (a job may be queued on it)."""
    from qwentitan.checkpoint.files import atomic_file

    o = options or SlurmOptions()
    path = Path(path)
    if path.is_dir():
        raise LaunchError(f"{path} is a folder; pass -o with a file name for the sbatch script.")
    plan_file = path.with_name(f"{path.stem}.plan.json").absolute()
    existing = [p for p in (path, plan_file) if p.exists() or p.is_symlink()]
    if existing and not overwrite:
        raise LaunchError(
            f"{existing[0]} already exists (a queued job may run it); pass --overwrite to "
            "replace the script and its plan file, or -o another path."
        )
    script = render_sbatch(plan, o, plan_file)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        log_folder(o, os.path.abspath(o.workdir or os.getcwd())).mkdir(parents=True, exist_ok=True)
        save_plan(plan, plan_file)
        with atomic_file(path) as tmp:
            tmp.write_text(script)
            tmp.chmod(0o755)
    except OSError as error:
        raise LaunchError(
            f"Could not write {path} ({error.strerror or error}); pass -o with a writable path."
        ) from None
    return path


def shared_folder_warnings(plan: LaunchPlan, mounts: str | None = None) -> list[str]:
    """For a multi-node Neuron plan, one line each where this host's mount table (preflight's
    `compile_cache` test) puts on a node-local disk what every node needs: the NEFF cache (each
    node then compiles every graph again) or the Python the script runs (each node needs it
    at the same path)."""
    from qwentitan.launch.launcher.preflight.compile_cache import (
        MOUNTS,
        SHARED_FS,
        check_compile_cache,
        file_system,
    )

    if plan.topology.device_type != "neuron" or plan.nodes == 1:
        return []
    if mounts is None:
        mounts = MOUNTS.read_text() if MOUNTS.is_file() else ""
    warnings = []
    cache = check_compile_cache(plan, mounts)
    if cache.status == "warn":
        warnings.append(f"{cache.detail[0].upper()}{cache.detail[1:]}.")
    python = Path(sys.executable).absolute()
    point, kind = file_system(python, mounts)
    if kind not in SHARED_FS:
        warnings.append(
            f"The script runs {python}, on this host's {kind} at {point}, not a shared file "
            f"system: each of the {plan.nodes} nodes needs that Python and its packages at the "
            "same path; install the environment on a folder every node mounts and run slurm "
            "with its Python."
        )
    return warnings
