"""What a training process reads from TorchNeuron at run time: memory figures and CPU fallbacks.

Facts from TorchNeuron's Python source (public mirror `parmoham-aws/test-repo-parmoham`):

- `torch_neuronx/memory.py`: `memory_stats()` returns nested dicts, one per byte statistic, each
  with `current` / `peak` / `allocated` / `freed`. `allocated_bytes` is what the allocator got
  from the Neuron runtime (NRT); `reserved_bytes` (memory cached for reuse) is always 0 for now.
  torch.cuda's flat keys (`reserved_bytes.all.peak`) are absent, so a CUDA reader sees nothing.
  The torch-neuronx 2.34.0 release notes say the `torch.accelerator` memory functions now work,
  which may mean the flat shape instead: both are read, and any other shape is unknown.
- `torch_neuronx/__init__.py`: `get_fallback_ops()` lists the ops that ran on the CPU instead
  of the NeuronCore (TorchNeuron may do that for ops it does not implement).
- Per-core device-memory peak in sysfs, `/sys/devices/virtual/neuron_device/neuron<chip>/
  neuron_core<core>/stats/memory_usage/device_mem/peak` (the path TorchNeuron's own tests
  read, `tests/distributed/collective_ops/test_all_gather.py`, numbering cores per chip).
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any, Protocol

from qwentitan.launch.base.target import NEURON_TARGET, TARGETS

__all__ = [
    "UNKNOWN",
    "NeuronDeviceModule",
    "fallback_ops",
    "flat_memory_stats",
    "report_fallback_ops",
    "sysfs_peak_bytes",
]

log = logging.getLogger(__name__)

SYSFS_ROOT = Path("/sys/devices/virtual/neuron_device")
_PHYSICAL_CORES_PER_CHIP = TARGETS[NEURON_TARGET].cores_per_chip


class UnknownFigure(float):
    """A memory figure TorchNeuron did not give: NaN that prints as "unknown".

    torchtitan's memory monitor divides it (GiB, percent of capacity) and formats it into the
    console line, so arithmetic keeps it unknown; MLflow's metrics leave non-finite values out
    (`tracking.summary.step_values`), so it never reaches a chart as 0.
    """

    def __new__(cls) -> UnknownFigure:
        return super().__new__(cls, "nan")

    def _same(self, *_: Any) -> UnknownFigure:
        return self

    __add__ = __radd__ = __sub__ = __rsub__ = _same
    __mul__ = __rmul__ = __truediv__ = __rtruediv__ = _same

    def __format__(self, spec: str) -> str:
        return "unknown"

    __str__ = __repr__ = lambda self: "unknown"


UNKNOWN = UnknownFigure()


def flat_memory_stats(stats: dict[str, Any]) -> dict[str, float]:
    """TorchNeuron's statistics under the flat keys torchtitan reads (torch.cuda's).

    Two shapes are read: the nested one of TorchNeuron's `memory.py`
    (`stats["allocated_bytes"]["peak"]`) and torch.cuda's flat one
    (`stats["allocated_bytes.all.peak"]`). In the nested shape, what NRT handed the allocator is
    what CUDA calls reserved (held from the driver); TorchNeuron caches nothing yet, so its own
    `reserved_bytes` (0) is added, not used alone. A figure found in neither shape is `UNKNOWN`,
    never 0.
    """

    def figure(name: str, which: str) -> float:
        flat = stats.get(f"{name}.all.{which}")
        if isinstance(flat, (int, float)) and not isinstance(flat, bool):
            return int(flat)
        value = stats.get(name)
        if isinstance(value, dict) and isinstance(value.get(which), (int, float)):
            return int(value[which])
        return UNKNOWN

    out: dict[str, float] = {}
    for which in ("current", "peak"):
        allocated = figure("allocated_bytes", which)
        active = figure("active_bytes", which)
        reserved = figure("reserved_bytes", which)
        out[f"allocated_bytes.all.{which}"] = allocated
        out[f"active_bytes.all.{which}"] = allocated if active is UNKNOWN else active
        if f"reserved_bytes.all.{which}" in stats and reserved is not UNKNOWN:
            out[f"reserved_bytes.all.{which}"] = reserved  # torch.cuda's meaning already
        elif allocated is UNKNOWN:
            out[f"reserved_bytes.all.{which}"] = UNKNOWN
        else:
            out[f"reserved_bytes.all.{which}"] = allocated + (
                0 if reserved is UNKNOWN else reserved
            )
    for count in ("num_alloc_retries", "num_ooms"):
        value = stats.get(count)
        out[count] = int(value) if isinstance(value, (int, float)) else UNKNOWN
    return out


class NeuronDeviceModule:
    """`torch.neuron` with a `memory_stats()` torchtitan can read; everything else is TorchNeuron's."""

    def __init__(self, module: Any) -> None:
        self._module = module

    def __getattr__(self, name: str) -> Any:
        return getattr(self._module, name)

    def memory_stats(self, device: Any = None) -> dict[str, float]:
        return flat_memory_stats(self._module.memory_stats(device))


def sysfs_peak_bytes(logical_core: int, *, lnc: int, root: Path | None = None) -> int | None:
    """Device-memory peak of one logical core from sysfs, or None where it cannot be read.

    A logical core groups `lnc` physical cores that share its HBM; their peaks are read and the
    largest is returned, as the group's memory is one pool. The logical-to-physical numbering
    (logical core c = physical cores c*lnc ... c*lnc+lnc-1) is an assumption not yet checked on
    a trn2 host.
    """
    root = SYSFS_ROOT if root is None else root
    peaks = []
    for physical in range(logical_core * lnc, (logical_core + 1) * lnc):
        chip, core = divmod(physical, _PHYSICAL_CORES_PER_CHIP)
        path = root / f"neuron{chip}/neuron_core{core}/stats/memory_usage/device_mem/peak"
        try:
            peaks.append(int(path.read_text().strip()))
        except (OSError, ValueError):
            continue
    return max(peaks) if peaks else None


def fallback_ops() -> list[str] | None:
    """Ops TorchNeuron ran on the CPU so far, sorted; None where TorchNeuron is not loaded."""
    try:
        import torch_neuronx
    except ImportError:
        return None
    read = getattr(torch_neuronx, "get_fallback_ops", None)
    return sorted(str(op) for op in read()) if read is not None else None


class _Tagged(Protocol):
    def set_tags(self, tags: dict[str, str]) -> None: ...


def report_fallback_ops(run: _Tagged | None) -> list[str] | None:
    """Warn about CPU fallbacks on the console and tag the MLflow run with them (after step 1)."""
    ops = fallback_ops()
    if ops is None:
        return None
    if ops:
        log.warning(
            "%d ops ran on the CPU instead of the NeuronCore (slow, and a sign of a missing "
            "kernel): %s",
            len(ops),
            ", ".join(ops),
        )
    if run is not None:
        run.set_tags(
            {
                "neuron.fallback_ops": ",".join(ops) or "none",
                "neuron.fallback_op_count": str(len(ops)),
            }
        )
    return ops
