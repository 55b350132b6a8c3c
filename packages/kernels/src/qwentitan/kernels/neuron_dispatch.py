"""Registering the NKI implementation of an op for the `neuron` device only.

TorchNeuron's `neuron` device is PyTorch's renamed PrivateUse1 backend, so the NKI wrappers are
registered under the PrivateUse1 dispatch key: they run for neuron tensors and never elsewhere,
while the reference twin stays the implementation for cpu and cuda.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

_NEURON_IMPLS = torch.library.Library("qwentitan", "IMPL")


def register_neuron_impl(op_name: str, fn: Callable) -> None:
    """Run `fn` for `qwentitan::<op_name>` when its tensors live on a `neuron` device."""
    _NEURON_IMPLS.impl(op_name, fn, "PrivateUse1")


def has_neuron_impl(op_name: str) -> bool:
    """Whether `qwentitan::<op_name>` has an implementation for the `neuron` device."""
    return torch._C._dispatch_has_kernel_for_dispatch_key(f"qwentitan::{op_name}", "PrivateUse1")
