"""The environment of a planned run's ranks: what the plan fixes, checked against the shell.

The plan writes a few variables every rank needs (`plan_env`: torchrun restarts, Neuron, EFA,
MLflow's HTTP limits) and records where each value came from; `check_shell` refuses, when the
plan is resolved, a shell that would contradict it; `rank_env` lays the plan's variables over the
shell when the ranks start. This is the only environment qwentitan.launch writes: the ranks'
process environment, never its own `os.environ`. What `plan_env` may write is all a plan file
may carry (`plan_env_refusal`): a file's `PYTHONPATH` or `LD_PRELOAD` would run code in every
process of every node.

The runtime's LNC (`NEURON_LOGICAL_NC_CONFIG`) and the compiler's must be equal: the Neuron SDK
does not support compiling for another LNC than the runtime's (aws-neuron/aws-neuron-sdk,
about-neuron/arch/neuron-features/logical-neuroncore-config.rst, which names the compiler options
`--logical-nc-config` and `-lnc`). TorchNeuron passes `--lnc` from `NEURON_LOGICAL_NC_CONFIG` to
neuronx-cc itself and appends `NEURON_CC_FLAGS` after it (TorchNeuron source, public mirror
parmoham-aws/test-repo-parmoham: torch_neuronx/csrc/core/compilation/NeuronCompiler.cpp), so the
plan sets only the runtime's variable (a `--lnc` in NEURON_CC_FLAGS would repeat it and change
the compile-cache key) and refuses a shell whose NEURON_CC_FLAGS names another LNC.

`NEURON_RT_VISIBLE_CORES` is not set: TorchNeuron's process-group setup gives each process the
core of its `LOCAL_RANK` when the variable is unset, then asserts that the process sees exactly
one device (torch_neuronx/distributed/backend.py, `_set_rt_visible_cores` and
`_neuron_runtime_setup`). A value in the shell reaches every rank of the node alike.
"""

from __future__ import annotations

import os
import re
import shlex
from collections.abc import Mapping
from pathlib import Path

from qwentitan.launch.base import env_defaults
from qwentitan.launch.base.env_defaults import (
    COMPILE_CACHE,
    COMPILER_FLAGS,
    LNC_ENV,
    VISIBLE_CORES,
)
from qwentitan.launch.base.errors import LaunchError
from qwentitan.launch.base.target import Topology

DEFAULT_COMPILE_CACHE = "~/.cache/qwentitan/neuron-compile-cache"
# EFA settings AWS uses for multi-node collectives (torchtitan's multinode_trainer.slurm and the
# Neuron EFA setup guide); libfabric reads them. Not verified on a trn2 cluster.
EFA_ENV = {"FI_PROVIDER": "efa", "FI_EFA_USE_DEVICE_RDMA": "1", "FI_EFA_FORK_SAFE": "1"}
# Where a value of the plan came from, as `plan` prints it.
FLAG, ENVIRONMENT, DEFAULT, PLAN = "flag", "environment", "default", "plan"
SOURCES = (FLAG, ENVIRONMENT, DEFAULT, PLAN)
# torch's CPU allocator asks for transparent huge pages for its blocks of 2 MB and more. A CPU
# rank's largest tensors (the logits over Qwen's 151,936-row vocabulary, their gradients) are far
# above glibc's mmap threshold, so each step maps them afresh and the kernel zero-fills them
# 4 KiB at a time: on the development VM, 2 ranks of tiny_dense, 6 steps, the same losses to the
# last digit: sys time 19.3 s -> 8.8 s, tokens/s per rank 235-246 -> 413-491.
CPU_HUGE_PAGES = "THP_MEM_ALLOC_ENABLE"
# What `plan_env` may write, so all a plan file's `env` may hold: these names, and the names of
# these families (Neuron's runtime and compile cache, libfabric/EFA, MLflow's HTTP limits).
PLAN_ENV_NAMES = ("TORCH_DISABLE_SHARE_RDZV_TCP_STORE", CPU_HUGE_PAGES)
PLAN_ENV_PREFIXES = ("NEURON_", "TORCH_NEURONX_", "FI_", "MLFLOW_HTTP_REQUEST_")
PLAN_ENV_RULE = f"{', '.join(PLAN_ENV_NAMES)} or {'*, '.join(PLAN_ENV_PREFIXES)}* only"
_NAME = re.compile(r"[A-Z_][A-Z0-9_]*")
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
                f"{VISIBLE_CORES}={value} is not a core number or range; unset it."
            ) from None
    return count


def shell_lnc(shell: Mapping[str, str]) -> int | None:
    """The LNC the shell exports (`NEURON_LOGICAL_NC_CONFIG`), None when unset."""
    return env_defaults.configured_lnc(shell)


def check_shell(topology: Topology, shell: Mapping[str, str]) -> None:
    """Refuse a shell whose Neuron settings would contradict the plan on every rank."""
    if topology.device_type != "neuron":
        return
    visible = shell.get(VISIBLE_CORES, "")
    count = visible_core_count(visible)
    if count and (topology.ranks_per_node > 1 or count > 1):
        raise LaunchError(
            f"{VISIBLE_CORES}={visible} is set in this shell and would give each of the "
            f"{topology.ranks_per_node} ranks per node the same {count} core(s), which "
            "TorchNeuron refuses; unset it (each rank then gets the core of its LOCAL_RANK)."
        )
    compiler = lnc_in_compiler_flags(shell.get(COMPILER_FLAGS, ""))
    if compiler not in (None, topology.lnc):
        raise LaunchError(
            f"{COMPILER_FLAGS} sets --lnc={compiler} but the plan uses LNC {topology.lnc}; "
            f"remove it from {COMPILER_FLAGS} (TorchNeuron passes the runtime's LNC itself) or "
            f"pass {{lnc}} {compiler}.",
            field="lnc",
        )


def plan_env(
    topology: Topology,
    *,
    nodes: int,
    shell: Mapping[str, str],
    compile_cache: str | None = None,
    lnc_source: str = DEFAULT,
    mlflow_timeout_s: int | None = None,
) -> tuple[dict[str, str], dict[str, str]]:
    """What every rank of a node needs, and where each value came from (FLAG, ENVIRONMENT,
    DEFAULT or PLAN): torchrun restarts; Neuron; huge pages on CPU; EFA across nodes; MLflow's
    HTTP limits."""
    # torchrun's c10d rendezvous shares its TCPStore with the ranks by default, and torch 2.14
    # does not prefix the ranks' keys per restart attempt: after a --max-restarts restart, gloo
    # reads the dead ranks' addresses. With sharing off, rank 0 hosts a fresh store each attempt.
    env: dict[str, str] = {"TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1"}
    sources: dict[str, str] = {}
    if topology.device_type == "neuron":
        env[LNC_ENV] = str(topology.lnc)
        sources[LNC_ENV] = lnc_source
        env["NEURON_PLATFORM_TARGET_OVERRIDE"] = topology.target.compile_target or ""
        # The compile cache outlives runs: a flag wins, then the user's export, then ours.
        if compile_cache is not None:
            cache, sources[COMPILE_CACHE] = compile_cache, FLAG
        elif shell.get(COMPILE_CACHE):
            cache, sources[COMPILE_CACHE] = shell[COMPILE_CACHE], ENVIRONMENT
        else:
            cache, sources[COMPILE_CACHE] = DEFAULT_COMPILE_CACHE, DEFAULT
        env[COMPILE_CACHE] = str(Path(cache).expanduser())
    if topology.device_type == "cpu" and CPU_HUGE_PAGES not in shell:  # a user's setting wins
        env[CPU_HUGE_PAGES] = "1"
    if nodes > 1 and topology.target.efa:
        env.update(EFA_ENV)
    if mlflow_timeout_s is not None:
        from qwentitan.launch.tracking.store import bounded_http

        # MLflow reads its HTTP limits only from the environment; a user's own settings win.
        env.update({k: v for k, v in bounded_http(mlflow_timeout_s).items() if k not in shell})
    return env, {name: sources.get(name, PLAN) for name in env}


def plan_env_refusal(name: object, value: object) -> str | None:
    """Why a plan may not set variable `name` to `value` (None: it may): only what `plan_env`
    writes, as plain one-line strings, never a variable that makes Python or the loader run code
    (PYTHONPATH, LD_PRELOAD, ...)."""
    if not isinstance(name, str) or not _NAME.fullmatch(name):
        return "which is not a variable name ([A-Z_][A-Z0-9_]*)"
    if name not in PLAN_ENV_NAMES and not name.startswith(PLAN_ENV_PREFIXES):
        return f"which a plan does not set ({PLAN_ENV_RULE})"
    if not isinstance(value, str) or any(c in value for c in "\n\r\0"):
        return f"whose value {value!r:.60} is not a one-line string"
    return None


def rank_env(
    env: Mapping[str, str],
    *,
    device_type: str,
    ranks_per_node: int,
    shell: Mapping[str, str] | None = None,
) -> dict[str, str]:
    """What torchrun hands every rank on this host: the shell with the plan's `env` on top."""
    merged = dict(env_defaults.shell() if shell is None else shell)
    merged.update(env)
    if device_type == "cpu":
        threads = max(1, (os.cpu_count() or 1) // ranks_per_node)
        merged.setdefault("OMP_NUM_THREADS", str(threads))
    # A rank's stdout is torchrun's pipe: whether to colour is the launching process's call.
    merged.setdefault(env_defaults.COLOUR, "1" if env_defaults.colour() else "0")
    return merged
