"""Preflight checks of the host and the plan: versions, devices, LNC, sequence length, disk, kernels."""

from __future__ import annotations

import dataclasses
import importlib.metadata as md
import json
import subprocess
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

from qwentitan.checkpoint.files import disk_room
from qwentitan.launch.base import env_defaults, neuron_sdk
from qwentitan.launch.base.env_defaults import COMPILER_FLAGS, LNC_ENV
from qwentitan.launch.base.errors import LaunchError
from qwentitan.launch.base.target import GIB
from qwentitan.launch.launcher.environment import check_shell, lnc_in_compiler_flags
from qwentitan.launch.launcher.plan import LaunchPlan
from qwentitan.launch.launcher.preflight.report import CheckResult
from qwentitan.launch.launcher.run_folder import planned_checkpoint_bytes

# The matrix the README's "Tested matrix" lists: version prefixes that were run.
TESTED = {
    "torch": "2.14.",
    "torchtitan": "0.3.0",
    "transformers": "5.",
    "safetensors": "0.8.",
    "mlflow": "3.",
}
# Needed on Trainium only; torch-neuronx 2.14.3 is built against torch 2.14 (the documented
# pairs, neuron_stack.py, check the rest of the Neuron SDK stack).
TESTED_NEURON = {"torch-neuronx": neuron_sdk.TORCH_NEURONX + "."}


def _installed(name: str) -> str | None:
    try:
        return md.version(name)
    except md.PackageNotFoundError:
        return None


def check_versions(plan: LaunchPlan) -> CheckResult:
    wanted = dict(TESTED)
    if plan.topology.device_type == "neuron" and host_device_type() == "neuron":
        wanted.update(TESTED_NEURON)
    found = {name: _installed(name) for name in wanted}
    bad = [
        f"{n} {v or 'missing'} (tested {wanted[n]}*)"
        for n, v in found.items()
        if v is None or not v.startswith(wanted[n])
    ]
    figures = {n: v for n, v in found.items()}
    if bad:
        return CheckResult("versions", "fail", "; ".join(bad), figures)
    listed = ", ".join(f"{n} {v}" for n, v in found.items())
    note = ""
    if plan.topology.device_type == "neuron" and host_device_type() != "neuron":
        note = "; torch-neuronx not checked on this non-Neuron host"
    return CheckResult("versions", "pass", listed + note, figures)


def host_device_type() -> str:
    """The device this host would train on (asks the platform layer, the one place that probes)."""
    from qwentitan.launch.runtime.platforms import host_device

    return host_device()


def check_devices(plan: LaunchPlan) -> CheckResult:
    from qwentitan.launch.runtime.platforms import get_platform

    wanted = plan.topology.device_type
    if host_device_type() != wanted:
        return CheckResult(
            "devices",
            "skip",
            f"this host has no {wanted} devices; the plan needs {plan.ranks_per_node} per node",
        )
    have = get_platform(wanted).max_ranks
    figures = {"devices": have, "ranks_per_node": plan.ranks_per_node}
    status = "pass" if have >= plan.ranks_per_node else "fail"
    unit = "logical cores" if wanted == "neuron" else ("GPUs" if wanted == "cuda" else "CPU slots")
    return CheckResult(
        "devices", status, f"{have} {unit} for {plan.ranks_per_node} ranks per node", figures
    )


def check_lnc(plan: LaunchPlan) -> CheckResult:
    if plan.topology.device_type != "neuron":
        return CheckResult("lnc", "skip", "LNC applies to Trainium only")
    runtime = env_defaults.configured_lnc(plan.env)
    # TorchNeuron passes --lnc from the runtime's variable to the compiler itself; a shell's
    # NEURON_CC_FLAGS may only repeat it.
    compiler = lnc_in_compiler_flags(env_defaults.compiler_flags())
    figures = {"plan_lnc": plan.lnc, "runtime": runtime, "shell_compiler": compiler}
    if runtime != plan.lnc:
        return CheckResult("lnc", "fail", f"runtime LNC {runtime} is not the plan's", figures)
    try:
        check_shell(plan.topology, env_defaults.shell())  # this shell's Neuron settings
    except LaunchError as error:
        return CheckResult("lnc", "fail", str(error), figures)
    return CheckResult(
        "lnc",
        "pass",
        f"{LNC_ENV}={runtime}, which TorchNeuron passes to the compiler as --lnc "
        f"({COMPILER_FLAGS} names {'no LNC' if compiler is None else 'the same'})",
        figures,
    )


def check_seq_len(plan: LaunchPlan) -> CheckResult:
    multiple = plan.topology.seq_len_multiple
    figures = {"seq_len": plan.seq_len, "multiple_of": multiple}
    if plan.topology.device_type != "neuron":
        return CheckResult(
            "seq_len", "skip", f"no tiling rule on {plan.topology.device_type}", figures
        )
    try:  # the Target's rule, the one `plan` and `train` refuse by
        plan.topology.target.check_seq_len(plan.seq_len, plan.lnc)
    except LaunchError as error:
        return CheckResult("seq_len", "fail", str(error), figures)
    return CheckResult(
        "seq_len",
        "pass",
        f"{plan.seq_len} is a multiple of {multiple} (the NKI attention kernels' rule)",
        figures,
    )


def check_disk(plan: LaunchPlan) -> CheckResult:
    room = disk_room(Path(plan.config.dump_folder), planned_checkpoint_bytes(plan))
    figures = {
        "folder": str(room.folder),
        "free_gib": round(room.free / GIB, 2),
        "needed_gib": round(room.needed / GIB, 3),
    }
    return CheckResult(
        "disk",
        "pass" if room.enough else "fail",
        f"{room.free / GIB:.1f} GiB free at {room.folder}, checkpoints need about "
        f"{room.needed / GIB:.2f} GiB"
        + ("" if room.enough else "; free space or point --run-dir elsewhere"),
        figures,
    )


def check_kernels(plan: LaunchPlan) -> CheckResult:
    """Launch every op the recipe's model runs once, forward and backward, by the route it takes
    on this host (`nki.jit` / `wrap_nki` on neuron, the reference twin elsewhere), against an
    independent PyTorch reference; reports the route and the largest difference per op."""
    from qwentitan.modeling.kernel_path import rules_in

    spec = plan.config.model_spec
    rules = rules_in(spec.model) if spec is not None else []
    if not rules:
        return CheckResult("kernels", "skip", "this recipe uses no custom ops")
    from qwentitan.kernels import check_kernels as launch_each_op

    device = host_device_type()
    checks = launch_each_op(rules, device=device)
    # The reference twins are exact on CPU; NKI kernels in bf16-accumulating tiles are not.
    tolerance = 1e-4 if device == "cpu" else 2e-2
    figures = {c.op: {"route": c.route, "max_abs_diff": c.max_abs_diff} for c in checks}
    bad = [c.op for c in checks if not c.max_abs_diff <= tolerance]
    summary = ", ".join(f"{c.op} {c.route} {c.max_abs_diff:.2e}" for c in checks)
    where = f"on {device}" + (
        "" if device == plan.topology.device_type else f" (not {plan.topology.device_type})"
    )
    return CheckResult(
        "kernels",
        "fail" if bad else "pass",
        f"{summary}: max |op - reference| {where} (tolerance {tolerance:g})",
        figures,
    )


Runner = Callable[[list[str], dict[str, str]], int]


def _run(command: list[str], env: dict[str, str]) -> int:
    return subprocess.run(command, env=env).returncode


def smoke_command(plan: LaunchPlan, run_dir: Path) -> list[str]:
    """The plan's own torchrun command on this one node, cut to one step with no checkpoint."""
    smoke = ["--training.steps", "1", "--checkpoint.no-enable", "--dump-folder", str(run_dir)]
    if hasattr(plan.config.metrics, "mlflow"):
        smoke.append("--metrics.mlflow.no-enable")  # a smoke step is not a run to keep
    overrides = list(plan.overrides)
    # The activation-checkpointing choice is a tyro subcommand, which must stay last.
    at = len(overrides) - (bool(overrides) and overrides[-1].startswith("activation-checkpoint:"))
    overrides[at:at] = smoke
    one_node = dataclasses.replace(plan, nodes=1, rdzv_endpoint="localhost:0", overrides=overrides)
    return one_node.launch_argv()


def check_compile_smoke(
    plan: LaunchPlan, *, allow_fallback: bool = False, runner: Runner | None = None
) -> CheckResult:
    """Train one step of the recipe on this host (the target): compile time and CPU fallbacks.

    The first step compiles every graph (minutes on Neuron), so a compile failure shows here
    instead of an hour into a paid run. A step in which TorchNeuron ran ops on the CPU fails the
    check unless `allow_fallback`.
    """
    wanted = plan.topology.device_type
    if host_device_type() != wanted:
        return CheckResult("compile_smoke", "skip", f"runs one step on a {wanted} host only")
    with tempfile.TemporaryDirectory(prefix="qwentitan-smoke-") as tmp:
        run_dir = Path(tmp)
        env = plan.rank_env()
        start = time.perf_counter()
        code = (runner or _run)(smoke_command(plan, run_dir), env)
        wall = time.perf_counter() - start
        report_file = run_dir / "reports" / "first_step.json"
        report = json.loads(report_file.read_text()) if report_file.is_file() else None
    figures: dict[str, object] = {"wall_s": round(wall, 1), "exit_code": code}
    if code != 0 or report is None:
        why = f"exit code {code}" if code != 0 else "no first-step report was written"
        detail = f"one training step failed ({why}); see its log above"
        return CheckResult("compile_smoke", "fail", detail, figures)
    fallback = report.get("fallback_ops")
    figures.update(first_step_s=report["seconds"], fallback_ops=fallback)
    detail = f"one step in {report['seconds']:.1f} s (compilation included)"
    if fallback:
        listed = ", ".join(fallback)
        if not allow_fallback:
            return CheckResult(
                "compile_smoke",
                "fail",
                f"{detail}, but {len(fallback)} ops ran on the CPU ({listed}); fix them or pass "
                "--allow-fallback",
                figures,
            )
        detail += f"; {len(fallback)} ops ran on the CPU, allowed ({listed})"
    return CheckResult("compile_smoke", "pass", detail, figures)
