"""The peak FLOP/s a rank's MFU divides by: the Target's catalogued figure, else torchtitan's GPU
table, else none (CPU: no MFU rather than a guess).

A Trainium rank's figure is its Target's (`Target.flops_per_core`, sourced in `base.target`) times
its LNC; a GPU's comes from torchtitan's own table (`get_peak_flops`), by the device name the host
reports, as torchtitan itself does. Kept here, not on the Target: reading the GPU's name needs
torch, and a Target is pure data.
"""

from __future__ import annotations

from qwentitan.launch.base.target import Target

__all__ = ["peak_flops"]


def peak_flops(target: Target, lnc: int) -> float | None:
    """Peak dense BF16 FLOP/s of one rank (LNC physical cores on Neuron); None on CPU."""
    if target.flops_per_core is not None:
        return target.flops_per_core * lnc
    if target.device_type == "cuda":
        import torch

        if torch.cuda.is_available():
            from torchtitan.tools.utils import get_peak_flops

            return get_peak_flops(torch.cuda.get_device_name())
    return None
