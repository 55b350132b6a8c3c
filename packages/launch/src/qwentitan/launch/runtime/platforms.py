"""The live device of a training process: `cpu`, `cuda` or `neuron`, as torch sees it here.

A `Platform` is only the adapter for the device module torchtitan calls (`torch.cuda`,
`torch.neuron`, or a stand-in on CPU): its memory figures and how many devices this host shows.
What a machine kind is (backend, peak FLOPs, attention, the sequence rule) is its `Target`'s
(`base.target`); which Target a run trains on is a config field (`Trainer.Config.target`), set by
the launcher. `host_device()` is the one probe of what this host has, for a config that names no
target.
"""

from __future__ import annotations

import importlib
import importlib.util
import math
import sys
from dataclasses import dataclass, field
from typing import Any, NamedTuple

import psutil
import torch

from qwentitan.launch.base import env_defaults
from qwentitan.launch.base.errors import LaunchError
from qwentitan.launch.base.target import NEURON_TARGET, TARGETS, cpu_cores

__all__ = [
    "PLATFORM_NAMES",
    "CpuDeviceModule",
    "MemoryStats",
    "Platform",
    "get_platform",
    "host_device",
    "host_target",
    "use_platform",
]

PLATFORM_NAMES = ("cpu", "cuda", "neuron")


# What a step line's `memory:` measures, by device type (`memory_stats`' peak reserved); the
# plan's `memory/rank` says it next to its estimate.
MEMORY_MEASURED = {
    "cpu": "the rank's peak RSS, its whole process with torch itself",
    "cuda": "the peak device memory the CUDA allocator reserved",
    "neuron": "the peak HBM the Neuron runtime gave TorchNeuron's allocator",
}


@dataclass(frozen=True, slots=True)
class MemoryStats:
    """Memory of one rank, in bytes: what it holds now, its peak, and what the device has
    (-1 for a figure the device module does not give)."""

    current_bytes: int
    peak_bytes: int
    capacity_bytes: int
    kind: str  # "RSS" (cpu), "CUDA" or "HBM" (neuron)
    device_peak_bytes: int | None = None
    """Neuron only: the peak of the rank's whole core memory (tensors, scratchpad, code) from
    sysfs, where this host exposes it; None elsewhere."""


class CpuProperties(NamedTuple):
    """What torchtitan reads of `get_device_properties` (name, total memory in bytes)."""

    name: str
    total_memory: int


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

    def get_device_properties(self, device: Any = None) -> CpuProperties:
        return CpuProperties(name="cpu", total_memory=psutil.virtual_memory().total)

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
    """The device module of this process, and what it reports (memory, devices)."""

    name: str
    """Device type: cpu, cuda or neuron."""
    max_ranks: int
    """Devices this host shows (on CPU, its cores)."""
    lnc: int = 1
    _device_module: Any = field(default=None, repr=False, compare=False)

    @property
    def device_type(self) -> str:
        return self.name

    @property
    def device_module(self) -> Any:
        """`torch.cuda`, `torch.neuron`, or a `CpuDeviceModule`: what torchtitan calls."""
        if self._device_module is not None:
            return self._device_module
        return getattr(torch, self.device_type)

    @property
    def memory_measured(self) -> str:
        """What `memory:` of a step line is on this device (torchtitan's max reserved)."""
        return MEMORY_MEASURED.get(self.device_type, MEMORY_MEASURED["neuron"])

    def memory_stats(self) -> MemoryStats:
        """This process's memory: RSS on CPU, allocator statistics on an accelerator (on Neuron,
        what the runtime handed TorchNeuron's allocator: see `neuron_runtime`)."""
        stats = self.device_module.memory_stats()
        capacity = self.device_module.get_device_properties(0).total_memory
        kind = {"cpu": "RSS", "cuda": "CUDA"}.get(self.device_type, "HBM")
        return MemoryStats(
            current_bytes=_known(stats.get("reserved_bytes.all.current")),
            peak_bytes=_known(stats.get("reserved_bytes.all.peak")),
            capacity_bytes=int(capacity),
            kind=kind,
            device_peak_bytes=self._sysfs_peak() if self.device_type == "neuron" else None,
        )

    def _sysfs_peak(self) -> int | None:
        from qwentitan.launch.runtime.neuron_runtime import sysfs_peak_bytes

        # TorchNeuron's process-group setup leaves one core here (the rank's LOCAL_RANK).
        core = env_defaults.visible_cores() or ""
        return sysfs_peak_bytes(int(core), lnc=self.lnc) if core.isdigit() else None


def _known(value: Any) -> int:
    """Bytes, or -1 where the device module does not know them (missing or NaN), never 0."""
    try:
        number = float(value)
    except (TypeError, ValueError):
        return -1
    return int(number) if math.isfinite(number) else -1


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


def get_platform(name: str, *, lnc: int = 1) -> Platform:
    """The platform called `name` (`cpu`, `cuda`, `neuron`), as this host would run it."""
    if name == "cpu":
        return Platform("cpu", cpu_cores(), _device_module=_CPU_DEVICE_MODULE)
    if name == "cuda":
        return Platform("cuda", TARGETS["cuda"].max_ranks())
    if name == "neuron":
        from qwentitan.launch.runtime.neuron_runtime import NeuronDeviceModule

        module = _torch_neuron()
        return Platform(
            name="neuron",
            max_ranks=module.device_count() if module is not None else 0,
            lnc=lnc,
            # TorchNeuron's memory_stats() is nested; torchtitan reads torch.cuda's flat keys.
            _device_module=NeuronDeviceModule(module) if module is not None else None,
        )
    raise LaunchError(f"Unknown platform {name!r}; choose one of {', '.join(PLATFORM_NAMES)}.")


def host_device() -> str:
    """The device this host trains on when nothing names one: neuron, else cuda, else cpu."""
    neuron = _torch_neuron()
    if neuron is not None and neuron.is_available():
        return "neuron"
    return "cuda" if torch.cuda.is_available() else "cpu"


def host_target() -> str:
    """The Target of this host: its device's (a Neuron host is taken as a trn2.48xlarge)."""
    device = host_device()
    return NEURON_TARGET if device == "neuron" else device


def use_platform(platform: Platform) -> None:
    """Make every loaded torchtitan module use `platform`'s device type and device module.

    The one patch qwentitan applies to torchtitan: torchtitan 0.3.0 has no seam for its device.
    It binds `device_type, device_module = get_device_info()` once, in `torchtitan.tools.utils`,
    and modules such as `components.metrics`, `distributed.utils` and
    `distributed.parallel_dims` import those two names by value; on a host without an
    accelerator that value is ("cuda", torch.cuda). So each loaded module holding the stale pair
    is rebound here, before the Trainer builds anything.
    """
    from torchtitan.tools import utils

    stale = {"device_type": utils.device_type, "device_module": utils.device_module}
    fresh = {"device_type": platform.device_type, "device_module": platform.device_module}
    for name, module in list(sys.modules.items()):
        if name.startswith("torchtitan") and module is not None:
            namespace = vars(module)
            for key, value in stale.items():
                if key in namespace and namespace[key] is value:
                    namespace[key] = fresh[key]


# One per process, so the peak RSS it samples is shared by every caller.
_CPU_DEVICE_MODULE = CpuDeviceModule()
