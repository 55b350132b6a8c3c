"""Preflight's `init_ops` check: the model's parameter inits against what TorchNeuron mishandles.

torchtitan's Trainer runs every module's `param_init` on the training device, so on a neuron
plan an init op TorchNeuron mishandles (`trunc_normal_`) would run on the device at the start of
every run, loaded weights or not (qwentitan.modeling.check_neuron_init says why). The check only
reads the model config (no model is built), so it runs for every plan on any host.
"""

from __future__ import annotations

from qwentitan.launch.launcher.plan import LaunchPlan
from qwentitan.launch.launcher.preflight.report import CheckResult


def check_init_ops(plan: LaunchPlan) -> CheckResult:
    from qwentitan.modeling import ModelingError, check_neuron_init, param_init_ops

    spec = plan.config.model_spec
    ops = param_init_ops(spec.model) if spec is not None else {}
    if not ops:
        return CheckResult(
            "init_ops",
            "skip",
            "the model config holds no torchtitan param_init (the hf path initialises "
            "through transformers' own init_weights)",
        )
    used = sorted({name for names in ops.values() for name in names})
    figures = {"param_inits": len(ops), "ops": used}
    neuron = plan.topology.device_type == "neuron"
    try:
        check_neuron_init(spec.model)
    except ModelingError as error:
        if neuron:
            return CheckResult("init_ops", "fail", str(error), figures)
        return CheckResult("init_ops", "pass", f"{error} (refused on neuron plans only)", figures)
    return CheckResult(
        "init_ops",
        "pass",
        f"{len(ops)} parameter inits run {', '.join(used)}; none TorchNeuron mishandles",
        figures,
    )
