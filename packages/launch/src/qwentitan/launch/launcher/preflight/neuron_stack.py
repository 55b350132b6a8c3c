"""Preflight: the Neuron SDK stack of this host against the stacks AWS documents, and which
torchtitan qwentitan runs.

The documented stacks (base/neuron_sdk.py): Neuron SDK 2.34 (the default: torch 2.14.0 with
torch-neuronx 2.14.3.1) and 2.33 (torch-neuronx 2.14.3.0), each with neuronx-cc 2.*, nki and
Python 3.12-3.14. AWS documents its TorchTitan fork (aws-neuron/torchtitan-neuron) for Trainium;
qwentitan is written against upstream torchtitan 0.3.0, which already holds the two changes
TorchNeuron's own Qwen3 patch makes to torchtitan (a Neuron branch in `get_peak_flops`,
`aten.linear` in the selective activation-checkpointing save list). The trn2 environment
(`nox -s train_trn2`) puts 0.3.0 before the Neuron venv's packages, so a fork the venv holds for
AWS's own tutorials is reported, not refused; only a fork that qwentitan itself would import is.
"""

from __future__ import annotations

import importlib.metadata as md
import importlib.util
import sys
from collections.abc import Callable, Iterable

from qwentitan.launch.base import neuron_sdk
from qwentitan.launch.launcher.plan import LaunchPlan
from qwentitan.launch.launcher.preflight.report import CheckResult

Lookup = Callable[[str], str | None]
# (version, folder) of every installed distribution named torchtitan, in import order.
Installs = Callable[[], list[tuple[str, str]]]


def installed_version(name: str) -> str | None:
    try:
        return md.version(name)
    except md.PackageNotFoundError:
        return None


def torchtitan_installs() -> list[tuple[str, str]]:
    """Every torchtitan distribution on sys.path, the imported one first."""
    found = []
    for dist in md.distributions():
        if (dist.metadata["Name"] or "").lower() == "torchtitan":
            found.append((dist.version, str(dist.locate_file(""))))
    return found


def imported_torchtitan(
    version_of: Lookup = installed_version, installs: Installs = torchtitan_installs
) -> tuple[str, str | None]:
    """Which torchtitan `import torchtitan` gets and any shadowed fork: (description, problem)."""
    spec = importlib.util.find_spec("torchtitan")
    if spec is None:
        return "torchtitan not installed", f"install torchtitan {neuron_sdk.TORCHTITAN_UPSTREAM}"
    version = version_of("torchtitan") or "unknown version"
    where = next(iter(spec.submodule_search_locations or []), spec.origin)
    described = f"qwentitan runs torchtitan {version} from {where}"
    forks = [(v, folder) for v, folder in installs()[1:] if neuron_sdk.is_fork(v)]
    if forks:
        v, folder = forks[0]
        described += (
            f"; AWS's fork {neuron_sdk.TORCHTITAN_FORK} {v} in {folder} comes after it, left "
            "there for AWS's own tutorials"
        )
    if neuron_sdk.is_fork(version):
        return described, (
            f"that is AWS's fork {neuron_sdk.TORCHTITAN_FORK}, but qwentitan is built on upstream "
            f"torchtitan {neuron_sdk.TORCHTITAN_UPSTREAM}; run through `nox -s train_trn2`, whose "
            "environment puts 0.3.0 before the Neuron venv's packages"
        )
    if version != neuron_sdk.TORCHTITAN_UPSTREAM:
        return described, f"qwentitan is tested with torchtitan {neuron_sdk.TORCHTITAN_UPSTREAM}"
    return described, None


def closest_stack(versions: dict[str, str | None]) -> str:
    """The documented stack these versions match, else the one they differ least from (newest
    first among equals)."""

    def misses(sdk: str) -> int:
        return sum(
            versions.get(name) is None or not neuron_sdk.matches(versions[name] or "", family)
            for name, family in neuron_sdk.STACKS[sdk].items()
        )

    return min(neuron_sdk.SDK_VERSIONS, key=misses)


def stack_problems(
    versions: dict[str, str | None], python: tuple[int, ...], sdk: str = neuron_sdk.SDK_VERSION
) -> list[str]:
    """What differs from the documented stack `sdk`, one phrase each."""
    problems = []
    if not neuron_sdk.python_supported(python):
        have = ".".join(map(str, python[:3]))
        problems.append(f"Python {have} (Neuron wheels: {neuron_sdk.PYTHON_RANGE})")
    for name, family in neuron_sdk.STACKS[sdk].items():
        found = versions.get(name)
        if found is None:
            problems.append(f"{name} missing")
        elif not neuron_sdk.matches(found, family):
            problems.append(f"{name} {found} (documented: {family + '*' if family else 'any'})")
    return problems


def _listed(versions: dict[str, str | None], names: Iterable[str]) -> str:
    return ", ".join(f"{n} {versions.get(n) or 'missing'}" for n in names)


def check_neuron_stack(
    plan: LaunchPlan,
    *,
    on_neuron_host: bool,
    version_of: Lookup = installed_version,
    python: tuple[int, ...] = tuple(sys.version_info[:3]),
    installs: Installs = torchtitan_installs,
) -> CheckResult:
    """Fail on a Neuron host whose stack is none of the documented ones or whose ranks would
    import AWS's fork; report what is installed elsewhere (a skip: nothing Neuron runs there)."""
    versions = {name: version_of(name) for name in neuron_sdk.STACK}
    torchtitan, torchtitan_problem = imported_torchtitan(version_of, installs)
    listed = _listed(versions, neuron_sdk.STACK)
    figures = {**versions, "python": ".".join(map(str, python[:3])), "torchtitan": torchtitan}
    if plan.topology.device_type != "neuron":
        return CheckResult("neuron_stack", "skip", "the plan does not train on Neuron", figures)
    if not on_neuron_host:
        return CheckResult(
            "neuron_stack", "skip", f"checked on the Neuron host only; here: {listed}; {torchtitan}",
            figures,
        )  # fmt: skip
    sdk = closest_stack(versions)
    problems = stack_problems(versions, python, sdk)
    if torchtitan_problem:
        problems.append(f"{torchtitan}: {torchtitan_problem}")
    if problems:
        return CheckResult(
            "neuron_stack",
            "fail",
            f"not the Neuron SDK {sdk} stack: {'; '.join(problems)}; see the README's "
            "'On the trn2 host'",
            figures,
        )
    figures["neuron_sdk"] = sdk
    return CheckResult(
        "neuron_stack",
        "pass",
        f"Neuron SDK {sdk} stack: {listed}, Python {figures['python']}; {torchtitan}",
        figures,
    )
