"""qwentitan.launch: see packages/launch/README.md for the public API."""

from importlib import import_module
from importlib.metadata import version as _version

__version__ = _version("qwentitan-launch")

# Everything is imported on first use, so that `import qwentitan.launch` (and the CLI's `--help`)
# never pays for torch, torchtitan or mlflow.
_LAZY = {
    "Platform": "qwentitan.launch.platforms",
    "current_platform": "qwentitan.launch.platforms",
    "get_platform": "qwentitan.launch.platforms",
    "TARGETS": "qwentitan.launch.target",
    "Target": "qwentitan.launch.target",
    "get_target": "qwentitan.launch.target",
    "INSTANCES": "qwentitan.launch.topology",
    "Instance": "qwentitan.launch.topology",
    "Topology": "qwentitan.launch.topology",
    "get_topology": "qwentitan.launch.topology",
    "LaunchPlan": "qwentitan.launch.plan",
    "ParallelDegrees": "qwentitan.launch.plan",
    "resolve_plan": "qwentitan.launch.plan",
    "RESUME_MODES": "qwentitan.launch.plan",
    "meta_model": "qwentitan.launch.plan",
    "MemoryEstimate": "qwentitan.launch.memory",
    "ModelShape": "qwentitan.launch.memory",
    "estimate_memory": "qwentitan.launch.memory",
    "PreemptionWatch": "qwentitan.launch.preemption",
    "supervise": "qwentitan.launch.preemption",
    "SlurmOptions": "qwentitan.launch.slurm",
    "render_sbatch": "qwentitan.launch.slurm",
    "write_sbatch": "qwentitan.launch.slurm",
    "PreflightReport": "qwentitan.launch.preflight",
    "run_preflight": "qwentitan.launch.preflight",
}

__all__ = ["__version__", *sorted(_LAZY)]


def __getattr__(name: str):
    if name in _LAZY:
        return getattr(import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'qwentitan.launch' has no attribute {name!r}")
