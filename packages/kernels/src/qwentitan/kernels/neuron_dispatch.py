"""Registering the NKI implementation of an op for the `neuron` device only.

TorchNeuron's `neuron` device is PyTorch's renamed PrivateUse1 backend
(`torch.utils.rename_privateuse1_backend("neuron")` in TorchNeuron's `torch_neuronx/__init__.py`,
public mirror `parmoham-aws/test-repo-parmoham`), so the NKI wrappers are registered under the
PrivateUse1 dispatch key: they run for neuron tensors and never elsewhere, while the reference
twin stays the implementation for cpu and cuda.

Every op ends in a `use_nki: bool` argument, the per-kernel fallback switch: with False the
neuron implementation runs the reference twin (plain PyTorch ops on the neuron device) instead
of the NKI kernel, so one failing kernel need not stop a run.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

_NEURON_IMPLS = torch.library.Library("qwentitan", "IMPL")
_registered: dict[str, Callable] = {}


def register_neuron_impl(op_name: str, nki: Callable, reference: Callable) -> None:
    """For `qwentitan::<op_name>` on `neuron`: `nki(*args)`, or `reference(*args)` if not use_nki."""

    def neuron_impl(*args):
        *op_args, use_nki = args
        return (nki if use_nki else reference)(*op_args)

    _registered[op_name] = neuron_impl
    _NEURON_IMPLS.impl(op_name, neuron_impl, "PrivateUse1")


def neuron_impl(op_name: str) -> Callable:
    """The function registered for `qwentitan::<op_name>` on `neuron` (tests call it on cpu)."""
    return _registered[op_name]


def has_neuron_impl(op_name: str) -> bool:
    """Whether `qwentitan::<op_name>` has an implementation for the `neuron` device."""
    return torch._C._dispatch_has_kernel_for_dispatch_key(f"qwentitan::{op_name}", "PrivateUse1")
