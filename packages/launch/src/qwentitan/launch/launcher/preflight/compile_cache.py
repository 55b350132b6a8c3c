"""Preflight's `compile_cache` check: on a multi-node plan, is the Neuron (NEFF) cache shared?

TorchNeuron keeps each compiled graph in `$TORCH_NEURONX_NEFF_CACHE_DIR`, which the plan sets
(`--compile-cache`, else the shell's export, else `~/.cache/qwentitan/neuron-compile-cache`). In
a folder on each host's own disk, every node of a multi-node run compiles every graph again. On a shared file system (FSx for Lustre, EFS / NFS)
the first node's NEFFs serve the others and the next run. The check reads this host's mount
table: where preflight runs on another host than the nodes (a login node), it says what this
host sees.
"""

from __future__ import annotations

from pathlib import Path

from qwentitan.launch.base.env_defaults import COMPILE_CACHE
from qwentitan.launch.launcher.plan import LaunchPlan
from qwentitan.launch.launcher.preflight.report import CheckResult

# File systems every node of a cluster mounts alike (FSx for Lustre, EFS and other NFS, SMB,
# parallel file systems, an S3 bucket through Mountpoint or s3fs).
SHARED_FS = frozenset(
    {"lustre", "nfs", "nfs4", "efs", "cifs", "smb3", "beegfs", "gpfs", "ceph", "glusterfs",
     "fuse.mountpoint-s3", "fuse.s3fs", "fuse.glusterfs", "fuse.ceph"}
)  # fmt: skip
MOUNTS = Path("/proc/mounts")


def file_system(path: Path, mounts: str) -> tuple[str, str]:
    """(mount point, file system type) holding `path`, from a mount table's text."""
    best = ("/", "unknown")
    for line in mounts.splitlines():
        fields = line.split()
        if len(fields) < 3:
            continue
        point = fields[1].replace("\\040", " ")
        holds = path == Path(point) or Path(point) in path.parents
        if holds and len(point) >= len(best[0]):
            best = (point, fields[2])
    return best


def check_compile_cache(plan: LaunchPlan, mounts: str | None = None) -> CheckResult:
    if plan.topology.device_type != "neuron":
        return CheckResult("compile_cache", "skip", "the NEFF cache is the Neuron compiler's")
    cache = Path(plan.env[COMPILE_CACHE]).expanduser().resolve()
    source = plan.env_sources.get(COMPILE_CACHE, "plan")
    if mounts is None:
        mounts = MOUNTS.read_text() if MOUNTS.is_file() else ""
    point, kind = file_system(cache, mounts)
    figures = {"folder": str(cache), "source": source, "mount": point, "fs_type": kind}
    if plan.nodes == 1:
        return CheckResult("compile_cache", "pass", f"one node; NEFF cache {cache}", figures)
    if kind in SHARED_FS:
        detail = f"NEFF cache {cache} on {kind} ({point}): the {plan.nodes} nodes share it"
        return CheckResult("compile_cache", "pass", detail, figures)
    return CheckResult(
        "compile_cache",
        "warn",
        f"the NEFF cache {cache} ({source}) is on this host's {kind} at {point}, not a shared "
        f"file system, so each of the {plan.nodes} nodes compiles every graph again; pass "
        "--compile-cache on a folder every node mounts, e.g. --compile-cache "
        "/fsx/neuron-compile-cache on FSx for Lustre",
        figures,
    )
