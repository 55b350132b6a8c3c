"""Preflight: the Neuron SDK stack of this host against the pairs AWS documents, and which
torchtitan is imported.

The documented pairs (base/neuron_sdk.py, from the Neuron SDK 2.33 support matrix): Python
3.12-3.14, torch 2.14.0 with torch-neuronx 2.14.3.x, neuronx-cc 2.*, nki. AWS documents its
TorchTitan fork (aws-neuron/torchtitan-neuron 0.2.2+neuron.1) for Trainium; qwentitan is written
against upstream torchtitan 0.3.0, which already holds the two changes TorchNeuron's own Qwen3
patch makes to torchtitan (a Neuron branch in `get_peak_flops`, `aten.linear` in the selective
activation-checkpointing save list), so 0.3.0 is the one supported here and the fork is refused.
"""

from __future__ import annotations

import importlib.metadata as md
import importlib.util
import sys
from collections.abc import Callable

from qwentitan.launch.base import neuron_sdk
from qwentitan.launch.launcher.plan import LaunchPlan
from qwentitan.launch.launcher.preflight.report import CheckResult

Lookup = Callable[[str], str | None]


def installed_version(name: str) -> str | None:
    try:
        return md.version(name)
    except md.PackageNotFoundError:
        return None


def imported_torchtitan(version_of: Lookup = installed_version) -> tuple[str, str | None]:
    """Which torchtitan `import torchtitan` gets: (description, problem or None)."""
    spec = importlib.util.find_spec("torchtitan")
    if spec is None:
        return "torchtitan not installed", f"install torchtitan {neuron_sdk.TORCHTITAN_UPSTREAM}"
    version = version_of("torchtitan") or "unknown version"
    where = next(iter(spec.submodule_search_locations or []), spec.origin)
    described = f"torchtitan {version} from {where}"
    if "neuron" in version or version.startswith("0.2."):
        return described, (
            f"this is AWS's fork {neuron_sdk.TORCHTITAN_FORK} ({neuron_sdk.TORCHTITAN_FORK_VERSION}"
            f"), but qwentitan is built on upstream torchtitan {neuron_sdk.TORCHTITAN_UPSTREAM}; "
            f"run `pip uninstall torchtitan` in this venv and install again (nox -s train_trn2)"
        )
    if version != neuron_sdk.TORCHTITAN_UPSTREAM:
        return described, f"qwentitan is tested with torchtitan {neuron_sdk.TORCHTITAN_UPSTREAM}"
    return described, None


def stack_problems(
    versions: dict[str, str | None], python: tuple[int, ...]
) -> list[str]:  # fmt: skip
    """What differs from the documented pairs, one phrase each."""
    problems = []
    if not neuron_sdk.python_supported(python):
        have = ".".join(map(str, python[:3]))
        problems.append(f"Python {have} (Neuron wheels: {neuron_sdk.PYTHON_RANGE})")
    for name, prefix in neuron_sdk.STACK.items():
        found = versions.get(name)
        if found is None:
            problems.append(f"{name} missing")
        elif not found.startswith(prefix):
            problems.append(
                f"{name} {found} (documented: {prefix or 'any'}{'*' if prefix else ''})"
            )
    return problems


def check_neuron_stack(
    plan: LaunchPlan,
    *,
    on_neuron_host: bool,
    version_of: Lookup = installed_version,
    python: tuple[int, ...] = tuple(sys.version_info[:3]),
) -> CheckResult:
    """Fail on a Neuron host whose stack or torchtitan differs from the documented pairs; report
    what is installed elsewhere (a skip: nothing Neuron runs there)."""
    versions = {name: version_of(name) for name in neuron_sdk.STACK}
    torchtitan, torchtitan_problem = imported_torchtitan(version_of)
    listed = ", ".join(f"{n} {v or 'missing'}" for n, v in versions.items())
    figures = {**versions, "python": ".".join(map(str, python[:3])), "torchtitan": torchtitan}
    if plan.topology.device_type != "neuron":
        return CheckResult("neuron_stack", "skip", "the plan does not train on Neuron", figures)
    if not on_neuron_host:
        return CheckResult(
            "neuron_stack",
            "skip",
            f"checked on the Neuron host only; here: {listed}; {torchtitan}",
            figures,
        )
    problems = stack_problems(versions, python)
    if torchtitan_problem:
        problems.append(f"{torchtitan}: {torchtitan_problem}")
    if problems:
        return CheckResult(
            "neuron_stack",
            "fail",
            "not the Neuron SDK "
            f"{neuron_sdk.SDK_VERSION} stack: {'; '.join(problems)}; see the README's "
            "'On the trn2 host'",
            figures,
        )
    return CheckResult(
        "neuron_stack",
        "pass",
        f"Neuron SDK {neuron_sdk.SDK_VERSION} pairs: {listed}, Python {figures['python']}; "
        f"{torchtitan}",
        figures,
    )
