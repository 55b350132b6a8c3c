"""Preflight checks of the host and the plan: versions, devices, LNC, sequence length, disk, kernels."""

from __future__ import annotations

import dataclasses
import importlib.metadata as md
import json
import math
import os
import shutil
import subprocess
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

from qwentitan.launch.base import neuron_sdk
from qwentitan.launch.base.errors import LaunchError
from qwentitan.launch.base.target import GIB, LNC_ENV, configured_lnc
from qwentitan.launch.launcher.environment import lnc_in_compiler_flags, merged_env, rank_env
from qwentitan.launch.launcher.plan import LaunchPlan
from qwentitan.launch.launcher.preflight.report import CheckResult

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
TESTED_NEURON = {"torch-neuronx": neuron_sdk.STACK["torch-neuronx"]}


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
    """The device this host would train on (asks the platform layer, the one place that decides)."""
    from qwentitan.launch.runtime.platforms import current_platform

    return current_platform().device_type


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
    runtime = configured_lnc(plan.env)
    compiler = lnc_in_compiler_flags(plan.env.get("NEURON_CC_FLAGS", ""))
    figures = {"plan_lnc": plan.lnc, "runtime": runtime, "compiler": compiler}
    if runtime != plan.lnc or compiler != plan.lnc:
        return CheckResult(
            "lnc", "fail", f"runtime LNC {runtime} and compiler --lnc {compiler} differ", figures
        )
    try:
        env = merged_env(plan)  # refuses a conflicting value already set in this shell
    except LaunchError as error:
        return CheckResult("lnc", "fail", str(error), figures)
    figures["shell_cc_flags"] = env.get("NEURON_CC_FLAGS")
    return CheckResult(
        "lnc",
        "pass",
        f"{LNC_ENV}={runtime} and NEURON_CC_FLAGS --lnc={compiler} agree (this shell included)",
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
        f"{plan.seq_len} is a multiple of {multiple} (128 x LNC {plan.lnc})",
        figures,
    )


# Measured on tiny_dense's step-N (torch 2.14 DCP): each saved tensor costs about 1.6 kB of zip
# record in its .distcp file and 0.3 kB of .metadata besides its bytes.
_BYTES_PER_TENSOR = 2048
# A rank's data position (three token buffers of up to seq_len ints, pickled) and the small
# states every checkpoint also holds (step, lr schedule).
_BYTES_PER_BUFFERED_TOKEN = 3 * 10
_SMALL_STATES = 64 * 1024


def checkpoint_bytes(plan: LaunchPlan, *, full: bool = True) -> int:
    """Bytes of one saved step: with `full`, model, AdamW's two moments (and step) per
    parameter, and every rank's data position; else the model only (the final model-only or
    HF save, in the export dtype). The model is counted by its state dict, as torchtitan saves
    it: a tied embedding is saved under both of its names."""
    from qwentitan.launch.launcher.resume import state_shapes

    shapes = state_shapes(plan.config)
    elements = sum(math.prod(shape) for shape in shapes.values())
    params = plan.model_shape.params if plan.model_shape else elements
    ckpt = plan.config.checkpoint
    training = 4 if plan.config.training.dtype == "float32" else 2
    if not full:
        export = {"float16": 2, "bfloat16": 2}.get(getattr(ckpt, "export_dtype", ""), training)
        return elements * export + len(shapes) * _BYTES_PER_TENSOR
    data = plan.world_size * (plan.seq_len * _BYTES_PER_BUFFERED_TOKEN + _BYTES_PER_TENSOR)
    return (
        elements * training
        + 2 * params * training
        + 4 * len(shapes) * _BYTES_PER_TENSOR  # the model's tensors, and AdamW's three per one
        + data
        + _SMALL_STATES
    )


def planned_checkpoint_bytes(plan: LaunchPlan) -> int:
    """Bytes the run's checkpoints take at most at once: the kept interval saves plus the one
    being written (torchtitan purges beyond `keep_latest_k` only after a save)."""
    ckpt = plan.config.checkpoint
    if not getattr(ckpt, "enable", False):
        return 0
    interval = max(int(getattr(ckpt, "interval", plan.steps) or plan.steps), 1)
    # Interval saves before the last step; the last step's save is the final one.
    before_last = (plan.steps - 1) // interval
    keep = min(getattr(ckpt, "keep_latest_k", 0) or before_last, before_last)
    full_state = checkpoint_bytes(plan)
    model_only = getattr(ckpt, "last_save_in_hf", False) or getattr(
        ckpt, "last_save_model_only", True
    )
    final = checkpoint_bytes(plan, full=False) if model_only else full_state
    at_an_interval = min(keep + 1, before_last) * full_state
    return max(at_an_interval, keep * full_state + final)


def check_disk(plan: LaunchPlan) -> CheckResult:
    folder = Path(plan.config.dump_folder).expanduser().resolve()
    probe = folder
    while not probe.exists():
        probe = probe.parent
    free = shutil.disk_usage(probe).free
    need = planned_checkpoint_bytes(plan)
    figures = {
        "folder": str(folder),
        "free_gib": round(free / GIB, 2),
        "needed_gib": round(need / GIB, 3),
    }
    ok = free >= need * 1.1
    return CheckResult(
        "disk",
        "pass" if ok else "fail",
        f"{free / GIB:.1f} GiB free at {probe}, checkpoints need about {need / GIB:.2f} GiB"
        + ("" if ok else "; free space or point --dump-folder elsewhere"),
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


def env_summary() -> dict[str, str]:
    keys = (LNC_ENV, "NEURON_CC_FLAGS", "NEURON_RT_VISIBLE_CORES")
    return {k: os.environ[k] for k in keys if k in os.environ}


Runner = Callable[[list[str], dict[str, str]], int]


def _run(command: list[str], env: dict[str, str]) -> int:
    return subprocess.run(command, env=env).returncode


def smoke_command(plan: LaunchPlan, run_dir: Path) -> list[str]:
    """The plan's own torchrun command on this one node, cut to one step with no checkpoint."""
    smoke = ["--training.steps", "1", "--checkpoint.no-enable", "--dump-folder", str(run_dir)]
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
        env = rank_env(plan)
        env["QWENTITAN_MLFLOW"] = "off"  # a smoke step is not a run to keep
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
