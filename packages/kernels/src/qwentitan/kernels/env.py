"""The environment variables qwentitan.kernels reads, all of them, read here and nowhere else.

| variable | meaning | default |
|---|---|---|
| `QWENTITAN_KERNELS` | per-kernel choice over `KernelChoices`' defaults: comma-separated `kernel=choice` pairs, kernel in rope / attention / experts, choice in nki / reference / torchtitan, e.g. `experts=reference` | unset: NKI RoPE and experts, torchtitan's attention |
| `NEURON_LOGICAL_NC_CONFIG` | the logical NeuronCore config (LNC, 1 or 2) every NKI launch runs at; TorchNeuron and neuronx-cc read the same variable | unset: the kernels' shape rules take 2 (trn2's default), and an `@nki.jit` launch refuses to run |

Each value is read when asked for, never cached at import, so a process (or a test) that sets
a variable before the first kernel call is seen.
"""

from __future__ import annotations

import os
from collections.abc import Mapping

KERNEL_CHOICES_ENV = "QWENTITAN_KERNELS"
LNC_ENV = "NEURON_LOGICAL_NC_CONFIG"


def kernel_choices_text(environ: Mapping[str, str] | None = None) -> str:
    """`QWENTITAN_KERNELS` as set (empty when unset), from `environ` or this process."""
    return (os.environ if environ is None else environ).get(KERNEL_CHOICES_ENV, "")


def lnc_setting() -> str | None:
    """`NEURON_LOGICAL_NC_CONFIG` as set in this process, None when unset."""
    return os.environ.get(LNC_ENV)
