"""The machines a run can be planned for: Trainium instances and the local CPU / CUDA host.

Figures from the Neuron SDK documentation (aws-neuron/aws-neuron-sdk): a trn2.48xlarge holds 16
Trainium2 chips of 8 physical NeuronCore-v3 and 96 GiB HBM each
(about-neuron/arch/neuron-hardware/trainium2.rst, nki/guides/architecture/trainium2_arch.rst);
at LNC=2 two physical cores act as one logical core
(about-neuron/arch/neuron-features/logical-neuroncore-config.rst), so a chip gives 4 ranks of
24 GiB and the instance 64 ranks. A trn1.32xlarge holds 16 Trainium chips of 2 NeuronCore-v2 and
32 GiB HBM each (about-neuron/arch/neuron-hardware/trainium.rst), LNC=1 only.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

from qwentitan.launch.errors import LaunchError

GIB = 1024**3


@dataclass(frozen=True, slots=True)
class Instance:
    """One kind of machine in the catalogue, before the LNC and rank count are chosen."""

    name: str
    description: str
    device_type: str  # "neuron" | "cuda" | "cpu"
    backend: str  # torch.distributed process-group backend
    chips: int = 0
    physical_cores_per_chip: int = 1
    chip_memory_gib: float = 0.0
    allowed_lnc: tuple[int, ...] = (1,)
    default_lnc: int = 1
    compile_target: str | None = None  # NEURON_PLATFORM_TARGET_OVERRIDE
    efa: bool = False
    local: bool = False  # sized from the host this runs on, not from a catalogue


@dataclass(frozen=True, slots=True)
class Topology:
    """An instance with its LNC and ranks per node resolved: what one node of a run looks like."""

    instance: Instance
    lnc: int
    ranks_per_node: int
    memory_per_rank_bytes: int

    @property
    def name(self) -> str:
        return self.instance.name

    @property
    def device_type(self) -> str:
        return self.instance.device_type

    @property
    def backend(self) -> str:
        return self.instance.backend

    @property
    def physical_cores(self) -> int:
        return self.instance.chips * self.instance.physical_cores_per_chip

    @property
    def seq_len_multiple(self) -> int:
        """Neuron kernels tile the sequence in 128-row blocks per physical core of a logical one."""
        return 128 * self.lnc if self.device_type == "neuron" else 1

    def to_dict(self) -> dict[str, object]:
        return {
            "instance": self.name,
            "description": self.instance.description,
            "device_type": self.device_type,
            "backend": self.backend,
            "lnc": self.lnc,
            "ranks_per_node": self.ranks_per_node,
            "memory_per_rank_gib": round(self.memory_per_rank_bytes / GIB, 2),
            "efa": self.instance.efa,
        }


INSTANCES: dict[str, Instance] = {
    i.name: i
    for i in (
        Instance(
            name="trn2.48xlarge",
            description="16 Trainium2 chips, 8 physical NeuronCores and 96 GiB HBM per chip",
            device_type="neuron",
            backend="neuron",
            chips=16,
            physical_cores_per_chip=8,
            chip_memory_gib=96.0,
            allowed_lnc=(1, 2),
            default_lnc=2,
            compile_target="trn2",
            efa=True,
        ),
        Instance(
            name="trn1.32xlarge",
            description="16 Trainium chips, 2 NeuronCores and 32 GiB HBM per chip",
            device_type="neuron",
            backend="neuron",
            chips=16,
            physical_cores_per_chip=2,
            chip_memory_gib=32.0,
            allowed_lnc=(1,),
            default_lnc=1,
            compile_target="trn1",
            efa=True,
        ),
        Instance(
            name="cpu",
            description="this host's CPU, ranks over gloo sharing its memory",
            device_type="cpu",
            backend="gloo",
            local=True,
        ),
        Instance(
            name="cuda",
            description="this host's CUDA GPUs, one rank per GPU over nccl",
            device_type="cuda",
            backend="nccl",
            local=True,
        ),
    )
}


def get_topology(
    name: str, *, lnc: int | None = None, ranks_per_node: int | None = None
) -> Topology:
    """Resolve an instance name (plus LNC for Trainium, ranks for the CPU host) to a Topology."""
    instance = INSTANCES.get(name)
    if instance is None:
        raise LaunchError(
            f"Unknown instance {name!r}; choose one of {', '.join(INSTANCES)} with --instance."
        )
    if instance.device_type == "neuron":
        return _neuron_topology(instance, lnc, ranks_per_node)
    if lnc not in (None, 1):
        raise LaunchError(f"LNC {lnc} applies to Trainium only; drop --lnc for instance {name!r}.")
    if instance.device_type == "cuda":
        return _cuda_topology(instance, ranks_per_node)
    return _cpu_topology(instance, ranks_per_node)


def _neuron_topology(instance: Instance, lnc: int | None, ranks: int | None) -> Topology:
    lnc = instance.default_lnc if lnc is None else lnc
    if lnc not in instance.allowed_lnc:
        allowed = " or ".join(str(v) for v in instance.allowed_lnc)
        raise LaunchError(
            f"LNC {lnc} is not valid on {instance.name}, which groups physical NeuronCores "
            f"{allowed} at a time; pass --lnc {instance.default_lnc}."
        )
    logical_per_chip = instance.physical_cores_per_chip // lnc
    full = instance.chips * logical_per_chip
    ranks = full if ranks is None else ranks
    if not 1 <= ranks <= full:
        raise LaunchError(
            f"{instance.name} at LNC {lnc} has {full} logical cores, so it cannot hold "
            f"{ranks} ranks per node; pass --ranks-per-node between 1 and {full}."
        )
    # HBM is shared by the cores of a chip; a logical core of LNC physical cores gets that share.
    per_rank = int(instance.chip_memory_gib * GIB * lnc / instance.physical_cores_per_chip)
    return Topology(instance, lnc, ranks, per_rank)


def _cpu_topology(instance: Instance, ranks: int | None) -> Topology:
    import psutil

    ranks = 2 if ranks is None else ranks
    cores = os.cpu_count() or 1
    if not 1 <= ranks <= max(cores, 2) * 4:
        raise LaunchError(
            f"This host has {cores} CPU cores, too few for {ranks} ranks per node; "
            f"pass --ranks-per-node between 1 and {max(cores, 2) * 4}."
        )
    total = psutil.virtual_memory().total
    return Topology(instance, 1, ranks, total // ranks)


def _cuda_topology(instance: Instance, ranks: int | None) -> Topology:
    import torch

    count = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if count == 0:
        raise LaunchError(
            "Instance 'cuda' describes this host's GPUs but torch sees none; "
            "run on a CUDA host or pass --instance cpu."
        )
    ranks = count if ranks is None else ranks
    if not 1 <= ranks <= count:
        raise LaunchError(
            f"This host has {count} CUDA devices, so it cannot hold {ranks} ranks per node; "
            f"pass --ranks-per-node between 1 and {count}."
        )
    memory = min(torch.cuda.get_device_properties(i).total_memory for i in range(ranks))
    return Topology(instance, 1, ranks, memory)
