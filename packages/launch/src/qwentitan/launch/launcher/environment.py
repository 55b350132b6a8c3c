"""The host environment a planned run's ranks start with: the plan's variables on top of the shell's.

What the plan itself writes for every rank (Neuron LNC and compiler target, EFA) is fixed by the
topology and lives in `topology_env`; this module merges it with the shell at launch time and
refuses a shell that contradicts it.

The runtime's LNC (`NEURON_LOGICAL_NC_CONFIG`) and the compiler's LNC must be equal: the Neuron
SDK does not support compiling for another LNC than the runtime's (aws-neuron/aws-neuron-sdk,
about-neuron/arch/neuron-features/logical-neuroncore-config.rst, which names
the compiler options `--logical-nc-config` and `-lnc`). TorchNeuron passes `--lnc` from
`NEURON_LOGICAL_NC_CONFIG` to neuronx-cc itself and appends `NEURON_CC_FLAGS` after it
(TorchNeuron source, public mirror parmoham-aws/test-repo-parmoham:
torch_neuronx/csrc/core/compilation/NeuronCompiler.cpp, csrc/core/KernelExecution.cpp), so a
conflicting value already in the shell is refused rather than silently overridden.

`NEURON_RT_VISIBLE_CORES` is not set: TorchNeuron's process-group setup gives each process the
core of its `LOCAL_RANK` when the variable is unset, then asserts that the process sees exactly
one device (torch_neuronx/distributed/backend.py, `_set_rt_visible_cores` and
`_neuron_runtime_setup`). A node-wide range would reach every rank and fail all of them.
"""

from __future__ import annotations

import os
import shlex
from typing import TYPE_CHECKING

from qwentitan.launch.base.errors import LaunchError
from qwentitan.launch.base.target import LNC_ENV, configured_lnc

if TYPE_CHECKING:
    from qwentitan.launch.launcher.plan import LaunchPlan

# Every spelling of the compiler's LNC option: neuronx-cc documents `--logical-nc-config` and
# `-lnc`; TorchNeuron itself passes `--lnc`.
_LNC_FLAGS = ("--lnc", "-lnc", "--logical-nc-config")


def lnc_in_compiler_flags(flags: str) -> int | None:
    """The LNC a NEURON_CC_FLAGS string sets, if any (`--lnc=2`, `-lnc 2`, `--logical-nc-config`)."""
    words = shlex.split(flags)
    for i, word in enumerate(words):
        for name in _LNC_FLAGS:
            if word.startswith(name + "="):
                return int(word.split("=", 1)[1])
            if word == name and i + 1 < len(words):
                return int(words[i + 1])
    return None


def visible_core_count(value: str) -> int:
    """How many NeuronCores a NEURON_RT_VISIBLE_CORES value names (`3`: 1, `0-63`: 64, `0,2-3`: 3)."""
    count = 0
    for part in filter(None, value.replace(" ", "").split(",")):
        low, _, high = part.partition("-")
        try:
            count += int(high or low) - int(low) + 1
        except ValueError:
            raise LaunchError(
                f"NEURON_RT_VISIBLE_CORES={value} is not a core number or range; unset it."
            ) from None
    return count


def merged_env(plan: LaunchPlan, base: dict[str, str] | None = None) -> dict[str, str]:
    """The host environment with the plan's on top, refusing a conflicting LNC already set."""
    env = dict(os.environ if base is None else base)
    if plan.topology.device_type == "neuron":
        visible = env.get("NEURON_RT_VISIBLE_CORES", "")
        if visible_core_count(visible) > 1:
            raise LaunchError(
                f"NEURON_RT_VISIBLE_CORES={visible} is set in this shell and would give every "
                "rank all those cores, which TorchNeuron refuses; unset it (each rank then gets "
                "the core of its LOCAL_RANK)."
            )
        runtime = configured_lnc(env)
        if runtime not in (None, plan.lnc):
            raise LaunchError(
                f"{LNC_ENV}={runtime} is set in this shell but the plan uses LNC "
                f"{plan.lnc}; unset it or pass --lnc {runtime}."
            )
        flags = env.get("NEURON_CC_FLAGS", "")
        compiler = lnc_in_compiler_flags(flags)
        if compiler not in (None, plan.lnc):
            raise LaunchError(
                f"NEURON_CC_FLAGS sets --lnc={compiler} but the plan uses LNC {plan.lnc}; "
                f"remove it from NEURON_CC_FLAGS or pass --lnc {compiler}."
            )
        if compiler is None and flags:
            plan_flags = f"{flags} {plan.env['NEURON_CC_FLAGS']}"
        else:
            plan_flags = flags or plan.env["NEURON_CC_FLAGS"]
        env.update(plan.env)
        env["NEURON_CC_FLAGS"] = plan_flags
        return env
    env.update(plan.env)
    return env


def rank_env(plan: LaunchPlan, base: dict[str, str] | None = None) -> dict[str, str]:
    """What torchrun hands every rank of a planned run on this host: `merged_env` plus the platform."""
    from qwentitan.launch.runtime.platforms import PLATFORM_ENV

    env = merged_env(plan, base)
    env[PLATFORM_ENV] = plan.topology.device_type  # every rank trains on what was planned
    if plan.topology.device_type == "cpu":
        env.setdefault("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 1) // plan.ranks_per_node)))
    return env
