"""Preflight: the host's operating system and install route, and which SPMD backend the plan runs.

The OS: the Neuron SDK 2.33 install pages give TorchNeuron for PyTorch 2.14 two routes. The Deep
Learning AMI "Neuron torch-neuronx 2.14.0" ships it in the venv
`/opt/aws_neuronx_venv_torch_neuronx_2_14_0` on Ubuntu 24.04 and 26.04 ("Update PyTorch on a
Deep Learning AMI", the note at its top); the standalone wheels of the manual route (a
`python3.12 -m venv` and pip from the Neuron repository) are for Ubuntu 26.04, and on 24.04 AWS
points to that DLAMI (torch-neuronx 2.33 release notes). So the check reads /etc/os-release and
warns when the Neuron packages come from anywhere but the DLAMI's venv on a host that is not
Ubuntu 26.04: a warning, since the wheels may still work there; not verified on Trainium.

The SPMD backend: torchtitan 0.3.0's `parallelism.spmd_backend` is one of `spmd_types` (its
default), `full_dtensor` and `partial_dtensor` (DTensor on the model-parallel axes, FSDP2's
`fully_shard` on the data-parallel ones: `ParallelismConfig` in torchtitan/config/configs.py).
No Neuron page names these; AWS's fork is torchtitan 0.2.2, whose FSDP2 + DTensor tensor
parallelism ("What is TorchTitan Neuron?", TorchTitan Neuron 0.2.2+neuron.1 release notes) is
what `partial_dtensor` keeps. The check reports the plan's backend and, where it is not that
one, the override that runs the fork's way.
"""

from __future__ import annotations

import importlib.util
from collections.abc import Callable
from pathlib import Path

from qwentitan.launch.launcher.plan import LaunchPlan
from qwentitan.launch.launcher.preflight.report import CheckResult

OS_RELEASE = Path("/etc/os-release")
DLAMI_VENV_PREFIX = "/opt/aws_neuronx_venv_"
MANUAL_ROUTE_OS = ("ubuntu", "26.04")
FORK_BACKEND = "partial_dtensor"


def read_os_release(path: Path = OS_RELEASE) -> dict[str, str]:
    """The KEY=value lines of os-release(5), unquoted; empty where the file cannot be read."""
    try:
        text = path.read_text()
    except OSError:
        return {}
    fields = {}
    for line in text.splitlines():
        key, sep, value = line.partition("=")
        if sep and key.strip() and not key.startswith("#"):
            fields[key.strip()] = value.strip().strip("'\"")
    return fields


def describe_os(fields: dict[str, str]) -> str:
    return (
        fields.get("PRETTY_NAME")
        or " ".join(part for part in (fields.get("NAME"), fields.get("VERSION_ID")) if part)
        or "an unknown OS (no /etc/os-release)"
    )


def neuron_packages_origin() -> str | None:
    """Where `torch_neuronx` would be imported from, None where it is not installed."""
    spec = importlib.util.find_spec("torch_neuronx")
    if spec is None:
        return None
    return next(iter(spec.submodule_search_locations or []), spec.origin)


def check_host_os(
    plan: LaunchPlan,
    *,
    on_neuron_host: bool,
    os_release: Path = OS_RELEASE,
    origin: Callable[[], str | None] = neuron_packages_origin,
) -> CheckResult:
    """Report the OS; on a Neuron host, warn when a manual install runs outside Ubuntu 26.04."""
    fields = read_os_release(os_release)
    name = describe_os(fields)
    figures: dict[str, object] = {
        "os": name,
        "id": fields.get("ID"),
        "version": fields.get("VERSION_ID"),
    }
    if plan.topology.device_type != "neuron":
        return CheckResult("host_os", "skip", f"{name}; the plan does not train on Neuron", figures)
    if not on_neuron_host:
        return CheckResult(
            "host_os", "skip", f"{name}; the route is checked on the Neuron host", figures
        )
    where = origin()
    route = (
        "unknown"
        if where is None
        else ("dlami" if where.startswith(DLAMI_VENV_PREFIX) else "manual")
    )
    figures.update(route=route, neuron_packages=where)
    on_26_04 = (fields.get("ID", "").lower(), fields.get("VERSION_ID")) == MANUAL_ROUTE_OS
    if route == "manual" and not on_26_04:
        return CheckResult(
            "host_os",
            "warn",
            f"{name} with the Neuron packages installed by hand ({where}); AWS's standalone "
            "torch-neuronx wheels are for Ubuntu 26.04 and on 24.04 it documents the Deep "
            f"Learning AMI's venv ({DLAMI_VENV_PREFIX}torch_neuronx_2_14_0) instead",
            figures,
        )
    via = {"dlami": "the Deep Learning AMI's venv", "manual": "a manual install"}.get(
        route, "no torch-neuronx found"
    )
    return CheckResult("host_os", "pass", f"{name}, {via}", figures)


def check_spmd_backend(plan: LaunchPlan) -> CheckResult:
    """Which torchtitan SPMD backend the ranks run, and how to run the fork's way instead."""
    backend = plan.config.parallelism.spmd_backend
    figures = {"spmd_backend": backend, "closest_to_aws_fork": FORK_BACKEND}
    detail = f"torchtitan's {backend} backend"
    if plan.topology.device_type == "neuron" and backend != FORK_BACKEND:
        detail += (
            f"; AWS's fork shards the way {FORK_BACKEND} does (FSDP2 + DTensor): "
            f"`-- --parallelism.spmd_backend {FORK_BACKEND}` runs that instead"
        )
    return CheckResult("spmd_backend", "pass", detail, figures)
