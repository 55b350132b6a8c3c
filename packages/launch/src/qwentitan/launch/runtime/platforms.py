"""Where training runs: `cpu`, `cuda` or `neuron`, and what each one can do.

`current_platform()` is the one place that chooses; every other module asks the `Platform` it
returns (device module, memory, how many ranks this host holds) instead of probing torch itself.
The facts of the machine kind (device type, backend, peak FLOPs, attention, which sequence
lengths work) are its `Target`'s (`target.py`), which the Platform only passes on.
"""

from __future__ import annotations

import importlib
import importlib.util
import os
import types
from dataclasses import dataclass, field
from typing import Any

import psutil
import torch

from qwentitan.launch.base.errors import LaunchError
from qwentitan.launch.base.target import NEURON_TARGET, TARGETS, Target, runtime_lnc

__all__ = [
    "PLATFORM_NAMES",
    "CpuDeviceModule",
    "MemoryStats",
    "Platform",
    "current_platform",
    "get_platform",
]

PLATFORM_NAMES = ("cpu", "cuda", "neuron")

# Environment variable that forces a platform (for example `cpu` on a GPU host).
PLATFORM_ENV = "QWENTITAN_PLATFORM"


@dataclass(frozen=True, slots=True)
class MemoryStats:
    """Memory of one rank, in bytes: what it holds now, its peak, and what the device has."""

    current_bytes: int
    peak_bytes: int
    capacity_bytes: int
    kind: str  # "RSS" (cpu), "CUDA" or "HBM" (neuron)
    device_peak_bytes: int | None = None
    """Neuron only: the peak of the rank's whole core memory (tensors, scratchpad, code) from
    sysfs, where this host exposes it; None elsewhere."""


class CpuDeviceModule:
    """The `torch.cuda`-like module torchtitan expects, for a host with no accelerator.

    torch has no device module for `cpu` with these calls, and torchtitan 0.3.0 calls them
    (`tools/utils.py`, `components/metrics.py`, `distributed/utils.py`). Each process is one rank
    that sees a single device, index 0. Memory is the process's resident set size (RSS); its
    peak is sampled whenever it is read, since the kernel's lifetime peak cannot be reset.
    """

    def __init__(self) -> None:
        self._process = psutil.Process()
        self._peak_rss = 0

    # device selection: one CPU "device" per process
    def is_available(self) -> bool:
        return True

    def device_count(self) -> int:
        return 1

    def current_device(self) -> int:
        return 0

    def set_device(self, device: Any) -> None:
        pass

    def synchronize(self, device: Any = None) -> None:
        pass

    def get_device_name(self, device: Any = None) -> str:
        return "cpu"

    def get_device_properties(self, device: Any = None) -> types.SimpleNamespace:
        return types.SimpleNamespace(name="cpu", total_memory=psutil.virtual_memory().total)

    # memory, in torch.cuda.memory_stats() keys
    def rss(self) -> int:
        return self._process.memory_info().rss

    def reset_peak_memory_stats(self, device: Any = None) -> None:
        self._peak_rss = self.rss()

    def empty_cache(self) -> None:
        pass

    def memory_stats(self, device: Any = None) -> dict[str, int]:
        current = self.rss()
        self._peak_rss = max(self._peak_rss, current)
        return {
            "active_bytes.all.current": current,
            "active_bytes.all.peak": self._peak_rss,
            "reserved_bytes.all.current": current,
            "reserved_bytes.all.peak": self._peak_rss,
            "num_alloc_retries": 0,
            "num_ooms": 0,
        }


@dataclass(frozen=True, slots=True)
class Platform:
    """What this host offers a training process: its `Target`'s facts plus the live device."""

    name: str
    target: Target
    max_ranks: int
    """Training processes this host holds: one per core on CPU, one per device otherwise."""
    lnc: int | None = None
    _device_module: Any = field(default=None, repr=False, compare=False)

    @property
    def device_type(self) -> str:
        return self.target.device_type

    @property
    def backend(self) -> str:
        """torch.distributed process-group backend: gloo, nccl or neuron."""
        return self.target.backend

    @property
    def attention(self) -> str:
        return self.target.attention

    @property
    def peak_flops(self) -> float | None:
        """Peak dense BF16 FLOP/s of one rank, where published; None on CPU (MFU not reported)."""
        return self.target.peak_flops(self.lnc or 1)

    @property
    def seq_len_multiple(self) -> int:
        return self.target.seq_len_multiple(self.lnc or 1)

    @property
    def device_module(self) -> Any:
        """`torch.cuda`, `torch.neuron`, or a `CpuDeviceModule`: what torchtitan calls."""
        if self._device_module is not None:
            return self._device_module
        return getattr(torch, self.device_type)

    @property
    def supports_cuda_graphs(self) -> bool:
        return self.device_type == "cuda"

    def memory_stats(self) -> MemoryStats:
        """This process's memory: RSS on CPU, allocator statistics on an accelerator (on Neuron,
        what the runtime handed TorchNeuron's allocator: see `neuron_runtime`)."""
        stats = self.device_module.memory_stats()
        capacity = self.device_module.get_device_properties(0).total_memory
        kind = {"cpu": "RSS", "cuda": "CUDA"}.get(self.device_type, "HBM")
        return MemoryStats(
            current_bytes=int(stats.get("reserved_bytes.all.current", -1)),
            peak_bytes=int(stats.get("reserved_bytes.all.peak", -1)),
            capacity_bytes=int(capacity),
            kind=kind,
            device_peak_bytes=self._sysfs_peak() if self.device_type == "neuron" else None,
        )

    def _sysfs_peak(self) -> int | None:
        from qwentitan.launch.runtime.neuron_runtime import sysfs_peak_bytes

        # TorchNeuron's process-group setup leaves one core here (the rank's LOCAL_RANK).
        core = os.environ.get("NEURON_RT_VISIBLE_CORES", "")
        return sysfs_peak_bytes(int(core), lnc=self.lnc or 1) if core.isdigit() else None

    def check_ranks(self, ranks: int) -> None:
        """`train --ranks`: the Target's rule for its kind (on CPU, the same limit `plan` uses)."""
        if self.device_type == "cpu":
            self.target.check_ranks(ranks, flag="--ranks")
            return
        if ranks < 1:
            raise LaunchError(f"--ranks {ranks} is not a positive number; pass --ranks 1 or more.")
        if ranks > self.max_ranks:
            raise LaunchError(
                f"--ranks {ranks} is more than this {self.name} host holds ({self.max_ranks} "
                f"{self.device_type} devices); pass --ranks {self.max_ranks} or fewer."
            )

    def check_seq_len(self, seq_len: int, max_seq_len: int) -> None:
        """Refuse a sequence length this platform or the model's RoPE table cannot take."""
        self.target.check_seq_len(seq_len, self.lnc or 1, max_seq_len)


def _torch_neuron() -> Any:
    """`torch.neuron`, importing TorchNeuron first where it is installed; None without it.

    TorchNeuron registers `torch.neuron` when `torch_neuronx` is imported, which PyTorch's
    backend autoload does unless TORCH_DEVICE_BACKEND_AUTOLOAD=0 (TorchNeuron's own torchtitan
    tutorial sets it: docs/torchtitan/qwen3/train-qwen3.md in its source, public mirror
    parmoham-aws/test-repo-parmoham). Without this import a trn2 host would train on its CPU.
    """
    if getattr(torch, "neuron", None) is None:
        try:
            installed = importlib.util.find_spec("torch_neuronx") is not None
        except ValueError:  # sys.modules holds None for it: its import is blocked on purpose
            installed = False
        if installed:
            importlib.import_module("torch_neuronx")
    return getattr(torch, "neuron", None)


def get_platform(name: str) -> Platform:
    """The platform called `name` (`cpu`, `cuda`, `neuron`), as this host would run it."""
    if name == "cpu":
        cpu = TARGETS["cpu"]
        return Platform("cpu", cpu, cpu.max_ranks(), _device_module=_CPU_DEVICE_MODULE)
    if name == "cuda":
        cuda = TARGETS["cuda"]
        return Platform("cuda", cuda, cuda.max_ranks())
    if name == "neuron":
        from qwentitan.launch.runtime.neuron_runtime import NeuronDeviceModule

        module = _torch_neuron()
        return Platform(
            name="neuron",
            target=TARGETS[NEURON_TARGET],
            max_ranks=module.device_count() if module is not None else 0,
            lnc=runtime_lnc(),
            # TorchNeuron's memory_stats() is nested; torchtitan reads torch.cuda's flat keys.
            _device_module=NeuronDeviceModule(module) if module is not None else None,
        )
    raise LaunchError(
        f"Unknown platform {name!r}; choose one of {', '.join(PLATFORM_NAMES)} "
        f"(for example {PLATFORM_ENV}=cpu)."
    )


def current_platform() -> Platform:
    """The platform this process trains on: $QWENTITAN_PLATFORM, else neuron, cuda, cpu."""
    forced = os.environ.get(PLATFORM_ENV)
    if forced:
        return get_platform(forced)
    neuron = _torch_neuron()
    if neuron is not None and neuron.is_available():
        return get_platform("neuron")
    if torch.cuda.is_available():
        return get_platform("cuda")
    return get_platform("cpu")


# One per process, so the peak RSS it samples is shared by every caller.
_CPU_DEVICE_MODULE = CpuDeviceModule()
