"""What a run ran on and with: the tags every tracked run carries.

Everything here is read locally (package metadata, git, /sys, torchrun's environment through
`env_defaults`): nothing waits on the network, so building the tags cannot slow a training start.
"""

from __future__ import annotations

import importlib.metadata
import os
import re
import subprocess
from pathlib import Path

from qwentitan.launch.base import env_defaults

# Distributions whose versions decide whether two runs are comparable.
VERSIONED = (
    "torch",
    "torch-neuronx",
    "transformers",
    "torchtitan",
    "mlflow",
    "qwentitan-kernels",
    "qwentitan-modeling",
    "qwentitan-checkpoint",
    "qwentitan-launch",
)

# On EC2 Nitro hosts the DMI product name is the instance type (e.g. "trn2.48xlarge").
_DMI_PRODUCT = Path("/sys/devices/virtual/dmi/id/product_name")
_INSTANCE_TYPE = re.compile(r"^[a-z][a-z0-9-]*\.[a-z0-9]+$")


def package_versions() -> dict[str, str]:
    """`{"version.torch": "2.14.1", "version.torch-neuronx": "absent", ...}`."""
    versions = {}
    for name in VERSIONED:
        try:
            versions[f"version.{name}"] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            versions[f"version.{name}"] = "absent"
    return versions


def git_commit(where: str | os.PathLike[str] | None = None) -> str:
    """The commit of the working directory's checkout, else of the one holding this package
    (with `+dirty` when tracked files differ), else "unknown"."""
    if where is None:
        found = git_commit(Path.cwd())
        return found if found != "unknown" else git_commit(Path(__file__).resolve().parent)
    try:
        commit = subprocess.run(
            ["git", "rev-parse", "HEAD"], cwd=where, capture_output=True, text=True, timeout=5
        )
        if commit.returncode != 0:
            return "unknown"
        status = subprocess.run(
            ["git", "status", "--porcelain", "--untracked-files=no"],
            cwd=where,
            capture_output=True,
            text=True,
            timeout=5,
        )
    except (OSError, subprocess.TimeoutExpired):
        return "unknown"
    dirty = "+dirty" if status.returncode == 0 and status.stdout.strip() else ""
    return commit.stdout.strip() + dirty


def instance_type(configured: str | None = None) -> str:
    """The configured type (`MLflowLogger.Config.instance_type`), else the EC2 type from DMI,
    else "local"."""
    if configured:
        return configured
    try:
        product = _DMI_PRODUCT.read_text().strip()
    except OSError:
        return "local"
    return product if _INSTANCE_TYPE.match(product) else "local"


def nodes(world_size: int) -> int:
    """Hosts in the job: the world size over the ranks of this node (torchrun's
    LOCAL_WORLD_SIZE; 1 host when run alone)."""
    local = env_defaults.local_world_size() or world_size
    return max(1, world_size // max(1, local))
