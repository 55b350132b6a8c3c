"""One `Target` per machine kind, and one `Topology` per resolved placement: every fact about
where a run goes, stated once.

A Target says what one kind of node offers (device type, process-group backend, accelerators and
their memory, the LNC choices, peak FLOPs, the attention that trains there, the price), and its
methods derive the rest (ranks per node, memory per rank, the sequence-length rule). A Topology is
a Target with its LNC and ranks per node chosen and checked (`get_topology`): what the plan
prints, the ranks' config names and tracking prices. This module is data and rules: what it
needs of this host (CPU cores, GPUs and their memory, for the `cpu` and `cuda` kinds) it asks
`host`; it imports nothing else of qwentitan but `errors`, so every layer may use it, and reads
no environment variable (`env_defaults` does).

Figures from the Neuron SDK documentation (aws-neuron/aws-neuron-sdk): a trn2.48xlarge holds 16
Trainium2 chips of 8 physical NeuronCore-v3 and 96 GiB HBM each
(about-neuron/arch/neuron-hardware/trainium2.rst, nki/guides/architecture/trainium2_arch.rst);
at LNC=2 two physical cores act as one logical core
(about-neuron/arch/neuron-features/logical-neuroncore-config.rst), so a chip gives 4 ranks of
24 GiB and the instance 64 ranks. No Trn1 kind: TorchNeuron, the backend these recipes train on,
supports Trn2 and Trn3 only (Neuron SDK 2.33 release notes, TorchNeuron support matrix). No Trn3
kind either: the documentation gives Trainium3's chip (8 NeuronCore-v4, 144 GiB) and its
UltraServers (about-neuron/arch/neuron-hardware/trn3-arch.rst), but no single instance to plan
for. Peak FLOPs: "A
NeuronCore-v3 Tensor Engine delivers ... 79 BF16/FP16/TF32 TFLOPS"
(https://awsdocs-neuron.readthedocs-hosted.com/en/latest/about-neuron/arch/neuron-hardware/
neuron-core-v3.html), so a rank at LNC 2 peaks at 158 TFLOPS. The chip page (trainium2.rst) gives
667 BF16 TFLOPS for its 8 cores, about 83 per core, a figure for the whole chip rather than its
Tensor Engines; MFU divides by the per-core Tensor Engine figure, as torchtitan's own
tools/utils.py does. A GPU's peak comes from torchtitan's own table, which the ranks read
(`runtime.peak_flops`).
"""

from __future__ import annotations

from dataclasses import dataclass

from qwentitan.launch.base import host
from qwentitan.launch.base.errors import LaunchError

__all__ = [
    "GIB",
    "NEURON_SEQ_MULTIPLE",
    "NEURON_TARGET",
    "PRICE_AS_OF",
    "PRICE_SOURCE",
    "TARGETS",
    "Target",
    "Topology",
    "cpu_cores",
    "get_target",
    "get_topology",
]

GIB = 1024**3

# TorchNeuron sends every 4-D scaled_dot_product_attention on a Neuron tensor to the
# "overrideable" SDPA backend (torch_neuronx/csrc/aten/SdpBackendSelection.cpp, public mirror
# parmoham-aws/test-repo-parmoham), whose NKI flash-attention implementation
# (torch_neuronx/python_ops/scaled_dot_product_fused_attention.py and the NKI attention ops beside
# it) takes only sequence lengths that are multiples of 512 (`seq_len % 512 == 0`); nki-library's
# attention_bwd takes key lengths of 128, 256 or multiples of 512. Other lengths fall back to a
# slow path or fail, so the plan refuses them. 512 is also a multiple of the 128-row tile each
# physical core of a logical one takes (128 x LNC, LNC <= 4).
NEURON_SEQ_MULTIPLE = 512
# The Trainium kind a Neuron host is taken to be when nothing names one (its LNC default, 2,
# is the runtime's own default on trn2).
NEURON_TARGET = "trn2.48xlarge"

# Public on-demand Linux list prices (USD per instance-hour) as recorded on this date; not
# re-verified since (no network in this project's CI). Check
# https://aws.amazon.com/ec2/pricing/on-demand/ before relying on them.
PRICE_AS_OF = "2025-06-01"
PRICE_SOURCE = "AWS EC2 on-demand, us-east-1"


@dataclass(frozen=True, slots=True)
class Target:
    """One kind of machine a run can target: a catalogued instance or this host's CPU / GPUs."""

    name: str
    description: str
    device_type: str  # "neuron" | "cuda" | "cpu"
    backend: str  # torch.distributed process-group backend: neuron, nccl or gloo
    attention: str
    """Attention that trains here: `sdpa` (no FlexAttention backward on CPU, no Inductor on
    Neuron) or `flex`."""
    chips: int = 0
    """Accelerators per node (Trainium chips, GPUs); 0: sized from the host this runs on."""
    cores_per_chip: int = 1  # physical NeuronCores per chip; 1 for a GPU
    chip_memory_gib: float = 0.0
    allowed_lnc: tuple[int, ...] = (1,)
    default_lnc: int = 1
    flops_per_core: float | None = None
    """Peak dense BF16 FLOP/s of one physical core; None: torchtitan's GPU table, or unknown."""
    compile_target: str | None = None  # NEURON_PLATFORM_TARGET_OVERRIDE
    efa: bool = False
    price_per_hour: float | None = None  # USD per instance-hour, as of PRICE_AS_OF

    @property
    def local(self) -> bool:
        """Sized from the host this runs on, not from a catalogue."""
        return self.chips == 0

    @property
    def physical_cores(self) -> int:
        return self.chips * self.cores_per_chip

    def seq_len_multiple(self, lnc: int) -> int:
        """What the sequence length must be a multiple of here (NEURON_SEQ_MULTIPLE on Neuron)."""
        return max(NEURON_SEQ_MULTIPLE, 128 * lnc) if self.device_type == "neuron" else 1

    def check_lnc(self, lnc: int | None) -> int:
        """The LNC to use: `lnc`, or this kind's default; refused where the kind lacks it."""
        if self.device_type != "neuron":
            if lnc not in (None, 1):
                raise LaunchError(
                    f"LNC {lnc} applies to Trainium only; drop {{lnc}} for instance {self.name!r}.",
                    field="lnc",
                )
            return 1
        lnc = self.default_lnc if lnc is None else lnc
        if lnc not in self.allowed_lnc:
            allowed = " or ".join(str(v) for v in self.allowed_lnc)
            raise LaunchError(
                f"LNC {lnc} is not valid on {self.name}, which groups physical NeuronCores "
                f"{allowed} at a time; pass {{lnc}} {self.default_lnc}.",
                field="lnc",
            )
        return lnc

    def max_ranks(self, lnc: int = 1) -> int:
        """Ranks one node holds: a logical core or GPU each; on the CPU host, one per core."""
        if self.chips:
            return self.chips * self.cores_per_chip // lnc
        if self.device_type == "cpu":
            return cpu_cores()
        return host.cuda_devices()

    def default_ranks(self, lnc: int = 1) -> int:
        """Every rank a node holds; on the CPU host two (the smallest distributed run)."""
        limit = self.max_ranks(lnc)
        return min(2, limit) if self.device_type == "cpu" else limit

    def check_ranks(self, ranks: int, lnc: int = 1) -> None:
        """Refuse a rank count per node this kind cannot hold. The CPU host takes more ranks
        than cores (they share them: slow, but they train; `Topology.note` says so)."""
        limit = self.max_ranks(lnc)
        if self.local and self.device_type == "cuda" and limit == 0:
            raise LaunchError(
                "Instance 'cuda' describes this host's GPUs but torch sees none; "
                "run on a CUDA host or pass {instance} cpu.",
                field="instance",
            )
        if ranks < 1:
            raise LaunchError(
                f"{{ranks_per_node}} {ranks} is not a positive number; pass {{ranks_per_node}} 1 "
                "or more.",
                field="ranks_per_node",
            )
        if ranks > limit and self.device_type != "cpu":
            if self.device_type == "neuron":
                held = f"{limit} logical cores at LNC {lnc}"
            else:
                held = f"{limit} CUDA devices"
            host = f"this {self.name} host" if self.local else self.name
            raise LaunchError(
                f"{{ranks_per_node}} {ranks} is more than {host} holds ({held}); pass "
                f"{{ranks_per_node}} {limit} or fewer.",
                field="ranks_per_node",
            )

    def memory_per_rank(self, lnc: int, ranks: int) -> int:
        """Bytes one rank may use: its logical core's HBM share, its GPU, or the host's RAM split."""
        if self.chips:
            # HBM is shared by the cores of a chip; a logical core of LNC physical cores gets that
            # share.
            return int(self.chip_memory_gib * GIB * lnc / self.cores_per_chip)
        if self.device_type == "cpu":
            return host.memory_bytes() // ranks
        return host.cuda_memory_bytes(ranks)

    def check_seq_len(self, seq_len: int, lnc: int, max_positions: int | None = None) -> None:
        """Refuse a sequence length these kernels or the model's RoPE table cannot take."""
        if seq_len < 2:
            raise LaunchError(
                f"{{seq_len}} {seq_len} is too short; pass 2 or more tokens.", field="seq_len"
            )
        multiple = self.seq_len_multiple(lnc)
        if seq_len % multiple:
            raise LaunchError(
                f"{{seq_len}} {seq_len} is not a multiple of {multiple}, which the NKI attention "
                f"kernels on {self.name} need; pass "
                f"{{seq_len}} {-(-seq_len // multiple) * multiple}.",
                field="seq_len",
            )
        if max_positions is not None and seq_len > max_positions:
            raise LaunchError(
                f"{{seq_len}} {seq_len} is longer than the model's {max_positions} positions; "
                f"pass {{seq_len}} {max_positions} or less.",
                field="seq_len",
            )


TARGETS: dict[str, Target] = {
    t.name: t
    for t in (
        Target(
            name="trn2.48xlarge",
            description="16 Trainium2 chips, 8 physical NeuronCores and 96 GiB HBM per chip",
            device_type="neuron",
            backend="neuron",
            attention="sdpa",
            chips=16,
            cores_per_chip=8,
            chip_memory_gib=96.0,
            allowed_lnc=(1, 2),
            default_lnc=2,
            flops_per_core=79e12,
            compile_target="trn2",
            efa=True,
            price_per_hour=44.70,
        ),
        Target(
            name="p4d.24xlarge",
            description="8 NVIDIA A100 GPUs of 40 GiB, one rank per GPU over nccl",
            device_type="cuda",
            backend="nccl",
            attention="flex",
            chips=8,
            chip_memory_gib=40.0,
            efa=True,
            price_per_hour=21.96,
        ),
        Target(
            name="p5.48xlarge",
            description="8 NVIDIA H100 GPUs of 80 GiB, one rank per GPU over nccl",
            device_type="cuda",
            backend="nccl",
            attention="flex",
            chips=8,
            chip_memory_gib=80.0,
            efa=True,
            price_per_hour=55.04,
        ),
        Target(
            name="cpu",
            description="this host's CPU, ranks over gloo sharing its memory",
            device_type="cpu",
            backend="gloo",
            attention="sdpa",
        ),
        Target(
            name="cuda",
            description="this host's CUDA GPUs, one rank per GPU over nccl",
            device_type="cuda",
            backend="nccl",
            attention="flex",
        ),
    )
}


# Kinds a user may name that these recipes cannot train on, with the reason.
UNSUPPORTED = {
    "trn1.32xlarge": "TorchNeuron, the PyTorch backend these recipes train on, supports Trn2 and "
    "Trn3 only (Neuron SDK 2.33)",
}


def get_target(name: str) -> Target:
    """The Target called `name`, or a refusal listing the kinds there are."""
    target = TARGETS.get(name)
    if name in UNSUPPORTED:
        raise LaunchError(
            f"Instance {name!r} is not supported: {UNSUPPORTED[name]}; choose trn2.48xlarge "
            "with --instance."
        )
    if target is None:
        raise LaunchError(
            f"Unknown instance {name!r}; choose one of {', '.join(TARGETS)} with {{instance}}.",
            field="instance",
        )
    return target


cpu_cores = host.cpu_cores  # the CPU host's rank limit, for train and plan alike


@dataclass(frozen=True, slots=True)
class Topology:
    """A Target with its LNC and ranks per node resolved: what one node of a run looks like."""

    target: Target
    lnc: int
    ranks_per_node: int
    memory_per_rank_bytes: int

    @property
    def name(self) -> str:
        return self.target.name

    @property
    def device_type(self) -> str:
        return self.target.device_type

    @property
    def backend(self) -> str:
        return self.target.backend

    @property
    def seq_len_multiple(self) -> int:
        return self.target.seq_len_multiple(self.lnc)

    @property
    def peak_flops(self) -> float | None:
        """Catalogued peak dense BF16 FLOP/s of one rank; None where the rank looks it up
        (a host's GPUs: `runtime.peak_flops`) or none is published (CPU)."""
        per_core = self.target.flops_per_core
        return None if per_core is None else per_core * self.lnc

    @property
    def note(self) -> str | None:
        """What the user should know before the ranks start (more CPU ranks than cores)."""
        cores = cpu_cores()
        if self.device_type != "cpu" or self.ranks_per_node <= cores:
            return None
        return (
            f"{self.ranks_per_node} ranks share this host's {cores} CPU cores: they train, "
            "each step slower than with one rank per core."
        )

    def to_dict(self) -> dict[str, object]:
        peak = self.peak_flops
        return {
            "instance": self.name,
            "description": self.target.description,
            "device_type": self.device_type,
            "backend": self.backend,
            "lnc": self.lnc,
            "ranks_per_node": self.ranks_per_node,
            "memory_per_rank_gib": round(self.memory_per_rank_bytes / GIB, 2),
            "peak_tflops_per_rank": None if peak is None else round(peak / 1e12, 1),
            "usd_per_hour": self.target.price_per_hour,
            "efa": self.target.efa,
        }


def get_topology(
    name: str,
    *,
    lnc: int | None = None,
    ranks_per_node: int | None = None,
) -> Topology:
    """Resolve a Target's name (plus LNC for Trainium, ranks per node) to a checked Topology."""
    target = get_target(name)
    lnc = target.check_lnc(lnc)
    ranks = target.default_ranks(lnc) if ranks_per_node is None else ranks_per_node
    target.check_ranks(ranks, lnc)
    return Topology(target, lnc, ranks, target.memory_per_rank(lnc, ranks))
