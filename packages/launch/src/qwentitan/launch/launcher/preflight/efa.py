"""Preflight: EFA on this host, for a plan that spans nodes.

The Neuron collectives cross nodes over EFA. The TorchTitan Neuron troubleshooting page
("Multi-node run hangs or fails during collectives bootstrap") asks to confirm that EFA is
present on every node with a non-zero EFA endpoint count. Two views of it are read:
- the kernel's: RDMA devices bound to the `efa` driver under /sys/class/infiniband;
- libfabric's: `fi_info -p efa -t FI_EP_RDM` (the EFA installer puts it in /opt/amazon/efa/bin),
  one `provider: efa` entry per endpoint it can open.
Run preflight on every node of the job; this check covers the node it runs on.
"""

from __future__ import annotations

import shutil
import subprocess
from collections.abc import Callable
from pathlib import Path

from qwentitan.launch.launcher.plan import LaunchPlan
from qwentitan.launch.launcher.preflight.report import CheckResult

SYS_INFINIBAND = Path("/sys/class/infiniband")
FI_INFO_DIRS = ("/opt/amazon/efa/bin",)
TROUBLESHOOTING = "https://awsdocs-neuron.readthedocs-hosted.com/en/latest/training/torchtitan/troubleshooting.html"

Runner = Callable[[list[str]], subprocess.CompletedProcess[str]]


def efa_devices(root: Path = SYS_INFINIBAND) -> list[str]:
    """RDMA devices whose kernel driver is `efa`."""
    if not root.is_dir():
        return []
    found = []
    for device in sorted(root.iterdir()):
        driver = device / "device" / "driver"
        if driver.exists() and driver.resolve().name == "efa":
            found.append(device.name)
    return found


def fi_info_endpoints(runner: Runner | None = None, path: str | None = None) -> int | None:
    """EFA RDM endpoints libfabric lists; None when fi_info is not installed or fails."""
    tool = path or shutil.which("fi_info") or shutil.which("fi_info", path=":".join(FI_INFO_DIRS))
    if tool is None:
        return None
    command = [tool, "-p", "efa", "-t", "FI_EP_RDM"]
    run = runner or (lambda argv: subprocess.run(argv, capture_output=True, text=True, timeout=60))
    try:
        done = run(command)
    except (OSError, subprocess.TimeoutExpired):
        return None
    if done.returncode != 0:  # fi_info exits non-zero when no provider matches
        return 0
    return sum(1 for line in done.stdout.splitlines() if line.strip() == "provider: efa")


def check_efa(
    plan: LaunchPlan,
    *,
    on_target_host: bool,
    root: Path = SYS_INFINIBAND,
    endpoints: Callable[[], int | None] = fi_info_endpoints,
) -> CheckResult:
    if plan.nodes <= 1:
        return CheckResult("efa", "skip", "one node: no traffic between nodes")
    if plan.topology.device_type != "neuron":
        return CheckResult("efa", "skip", f"{plan.topology.device_type} plans do not use EFA here")
    if not on_target_host:
        return CheckResult("efa", "skip", f"checked on each {plan.topology.name} node only")
    devices = efa_devices(root)
    count = endpoints()
    figures = {"devices": devices, "fi_info_endpoints": count, "nodes": plan.nodes}
    listed = f"{len(devices)} EFA device(s) in {root}" + (
        f" ({', '.join(devices[:4])}{', ...' if len(devices) > 4 else ''})" if devices else ""
    )
    listed += (
        "; fi_info not found" if count is None else f"; fi_info -p efa: {count} RDM endpoint(s)"
    )
    if not devices or count == 0:
        return CheckResult(
            "efa",
            "fail",
            f"{listed}: a {plan.nodes}-node run needs EFA on every node; launch the instances "
            f"with their EFA interfaces and the EFA driver (see {TROUBLESHOOTING})",
            figures,
        )
    return CheckResult("efa", "pass", f"{listed} on this node of {plan.nodes}", figures)
