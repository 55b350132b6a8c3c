"""Run every preflight check for a plan and collect the report."""

from __future__ import annotations

import socket
from collections.abc import Callable

from qwentitan.launch.launcher.plan import LaunchPlan
from qwentitan.launch.launcher.preflight import (
    checks,
    compile_cache,
    dataset,
    efa,
    host_os,
    init_ops,
    neuron_stack,
    weights,
)
from qwentitan.launch.launcher.preflight.report import CheckResult, PreflightReport

# The checks of the folder a run starts from: they do not apply to a random initialisation.
WEIGHT_CHECKS = ("weights", "round_trip", "initialisation")


def run_preflight(
    plan: LaunchPlan,
    *,
    weights_dir: str | None = None,
    compile_smoke: bool = False,
    allow_fallback: bool = False,
) -> PreflightReport:
    """All checks, in the order a user would fix them; a check that crashes is a failure.

    `compile_smoke` adds a last check that trains one step on this host (minutes on Neuron).
    """
    host = checks.host_device_type()
    on_target = host == plan.topology.device_type
    report = PreflightReport(plan.recipe, plan.topology.name, f"{socket.gethostname()} ({host})")
    folder = weights.weights_folder(plan, weights_dir)
    steps: list[tuple[str, Callable[[], CheckResult]]] = [
        ("versions", lambda: checks.check_versions(plan)),
        ("neuron_stack", lambda: neuron_stack.check_neuron_stack(plan, on_neuron_host=on_target)),
        ("host_os", lambda: host_os.check_host_os(plan, on_neuron_host=on_target)),
        ("spmd_backend", lambda: host_os.check_spmd_backend(plan)),
        ("devices", lambda: checks.check_devices(plan)),
        ("efa", lambda: efa.check_efa(plan, on_target_host=on_target)),
        ("lnc", lambda: checks.check_lnc(plan)),
        ("seq_len", lambda: checks.check_seq_len(plan)),
        ("dataset", lambda: dataset.check_dataset(plan)),
        ("weights", lambda: weights.check_weights(plan, folder)),
        ("round_trip", lambda: weights.check_round_trip(plan, folder)),
        ("kernels", lambda: checks.check_kernels(plan)),
        ("init_ops", lambda: init_ops.check_init_ops(plan)),
        ("initialisation", lambda: weights.check_initialisation(plan, folder, host)),
        ("disk", lambda: checks.check_disk(plan)),
        ("compile_cache", lambda: compile_cache.check_compile_cache(plan)),
    ]
    if compile_smoke:
        steps.append(
            (
                "compile_smoke",
                lambda: checks.check_compile_smoke(plan, allow_fallback=allow_fallback),
            )
        )
    random_init = weights.random_init_reason(plan, weights_dir)
    for name, check in steps:
        if name in WEIGHT_CHECKS and random_init:
            report.checks.append(CheckResult(name, "skip", random_init))
            continue
        if name in ("round_trip", "initialisation") and _failed(report, "weights"):
            report.checks.append(CheckResult(name, "skip", "the weights check failed"))
            continue
        try:
            report.checks.append(check())
        except Exception as error:  # a crash in a check is that check failing, with its reason
            report.checks.append(CheckResult(name, "fail", f"{type(error).__name__}: {error}"))
    return report


def _failed(report: PreflightReport, name: str) -> bool:
    return any(c.name == name and c.status == "fail" for c in report.checks)
