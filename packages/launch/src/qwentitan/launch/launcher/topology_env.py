"""The environment variables a topology fixes for every rank: torchrun restarts, Neuron, EFA.

The plan writes them; `environment` merges them with the shell at launch time. They live apart
from that merge so that `plan` -> `topology_env` and `environment` -> `plan` form no import loop.
The Neuron runtime's LNC and the compiler's `--lnc` are written with one value: the Neuron SDK
does not support compiling for another LNC than the runtime's (aws-neuron/aws-neuron-sdk,
about-neuron/arch/neuron-features/logical-neuroncore-config.rst).
"""

from __future__ import annotations

from pathlib import Path

from qwentitan.launch.base.target import LNC_ENV
from qwentitan.launch.base.topology import Topology

# EFA settings AWS uses for multi-node collectives (torchtitan's multinode_trainer.slurm and the
# Neuron EFA setup guide); libfabric reads them. Not verified on a trn2 cluster.
EFA_ENV = {"FI_PROVIDER": "efa", "FI_EFA_USE_DEVICE_RDMA": "1", "FI_EFA_FORK_SAFE": "1"}


def plan_env(topology: Topology, *, nodes: int, compile_cache: str) -> dict[str, str]:
    """Environment every rank of a node needs (torchrun restarts; Neuron; EFA across nodes)."""
    # torchrun's c10d rendezvous shares its TCPStore with the ranks by default, and torch 2.14
    # does not prefix the ranks' keys per restart attempt: after a --max-restarts restart, gloo
    # reads the dead ranks' addresses. With sharing off, rank 0 hosts a fresh store each attempt.
    env: dict[str, str] = {"TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1"}
    if topology.device_type == "neuron":
        # The runtime's LNC and the compiler's --lnc must be equal or the NEFF fails to load.
        env[LNC_ENV] = str(topology.lnc)
        env["NEURON_CC_FLAGS"] = f"--lnc={topology.lnc}"
        env["NEURON_PLATFORM_TARGET_OVERRIDE"] = topology.target.compile_target or ""
        env["TORCH_NEURONX_NEFF_CACHE_DIR"] = str(Path(compile_cache).expanduser())
    if nodes > 1 and topology.target.efa:
        env.update(EFA_ENV)
    return env
