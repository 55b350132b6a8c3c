"""qwentitan.launch: see packages/launch/README.md for the public API."""

from importlib import import_module
from importlib.metadata import version as _version

__version__ = _version("qwentitan-launch")

# Everything is imported on first use, so that `import qwentitan.launch` (and the CLI's `--help`)
# never pays for torch, torchtitan or mlflow.
_LAZY = {
    "Platform": "qwentitan.launch.runtime.platforms",
    "host_device": "qwentitan.launch.runtime.platforms",
    "get_platform": "qwentitan.launch.runtime.platforms",
    "TARGETS": "qwentitan.launch.base.target",
    "Target": "qwentitan.launch.base.target",
    "get_target": "qwentitan.launch.base.target",
    "Topology": "qwentitan.launch.base.target",
    "get_topology": "qwentitan.launch.base.target",
    "LaunchPlan": "qwentitan.launch.launcher.plan",
    "resolve_plan": "qwentitan.launch.launcher.plan",
    "RESUME_MODES": "qwentitan.launch.launcher.plan",
    "meta_model": "qwentitan.launch.launcher.memory",
    "load_plan": "qwentitan.launch.launcher.plan_file",
    "save_plan": "qwentitan.launch.launcher.plan_file",
    "MemoryEstimate": "qwentitan.launch.launcher.memory",
    "ModelShape": "qwentitan.launch.launcher.memory",
    "estimate_memory": "qwentitan.launch.launcher.memory",
    "PreemptionWatch": "qwentitan.launch.runtime.preemption",
    "supervise": "qwentitan.launch.launcher.supervisor",
    "SlurmOptions": "qwentitan.launch.launcher.slurm",
    "render_sbatch": "qwentitan.launch.launcher.slurm",
    "write_sbatch": "qwentitan.launch.launcher.slurm",
    "PreflightReport": "qwentitan.launch.launcher.preflight",
    "run_preflight": "qwentitan.launch.launcher.preflight",
    "RunRequest": "qwentitan.launch.launcher.request",
    "LaunchError": "qwentitan.launch.base.errors",
    "recipe_names": "qwentitan.launch.recipes",
    "get_recipe": "qwentitan.launch.recipes",
    "Trainer": "qwentitan.launch.runtime.trainer",
    "tracked_metrics": "qwentitan.launch.tracking.processor",
    "sync_run_dir": "qwentitan.launch.tracking.store",
}

__all__ = ["__version__", *sorted(_LAZY)]


def __getattr__(name: str):
    if name in _LAZY:
        return getattr(import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'qwentitan.launch' has no attribute {name!r}")
