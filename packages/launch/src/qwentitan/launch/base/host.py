"""What this host has, asked when a run targets it (`Target` kinds `cpu` and `cuda`): CPU cores,
memory, CUDA devices and theirs. torch and psutil are imported only when asked.
"""

from __future__ import annotations

import os

__all__ = ["cpu_cores", "cuda_devices", "cuda_memory_bytes", "memory_bytes"]


def cpu_cores() -> int:
    """CPU cores this process may run on."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # macOS has no sched_getaffinity
        return os.cpu_count() or 1


def memory_bytes() -> int:
    """This host's RAM."""
    import psutil

    return psutil.virtual_memory().total


def cuda_devices() -> int:
    """CUDA devices torch sees (0 without CUDA)."""
    import torch

    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def cuda_memory_bytes(devices: int) -> int:
    """The smallest memory of the first `devices` CUDA devices."""
    import torch

    return min(torch.cuda.get_device_properties(i).total_memory for i in range(devices))
