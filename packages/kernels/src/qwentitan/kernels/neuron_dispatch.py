"""Registering the NKI implementation of an op for the `neuron` device only.

TorchNeuron's `neuron` device is PyTorch's renamed PrivateUse1 backend
(`torch.utils.rename_privateuse1_backend("neuron")` in TorchNeuron's `torch_neuronx/__init__.py`,
public mirror `parmoham-aws/test-repo-parmoham`), so the NKI wrappers are registered under the
PrivateUse1 dispatch key: they run for neuron tensors and never elsewhere, while the reference
twin stays the implementation for cpu and cuda.

Every op ends in a `use_nki: bool` argument, the per-kernel fallback switch: with False the
neuron implementation runs the reference twin (plain PyTorch ops on the neuron device) instead
of the NKI kernel, so one failing kernel need not stop a run.

Where torch-neuronx has `nki_op` (SDK 2.33 and later), each op's NKI implementation is also
registered through it as `qwentitan_nki::<op>` and the neuron implementation calls that op: the
registration "How to work with NKI kernels from torch-neuronx" documents for NKI kernels in
PyTorch custom ops, eager and inside `torch.compile(backend="neuron")`. `nki_op` takes a name,
the function (its type annotations give the schema) and `mutates_args`, and uses the function
as the op's fake implementation too (the April TorchNeuron source, `torch_neuronx/nki_hop.py`,
builds it on `torch.library.custom_op`). Our NKI implementations allocate their outputs and
write no input, so `mutates_args=()`.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from types import ModuleType
from typing import Any

import torch

NKI_OP_NAMESPACE = "qwentitan_nki"
_NEURON_IMPLS = torch.library.Library("qwentitan", "IMPL")
_registered: dict[str, Callable] = {}
_nki_impls: dict[str, Callable] = {}
_nki_ops: dict[str, Any] = {}  # op name -> its NKI implementation registered with nki_op
# How to import torch_neuronx, set by nki_loader (which imports this module, not the reverse).
torch_neuronx_loader: Callable[[], ModuleType] | None = None


def register_neuron_impl(op_name: str, nki: Callable, reference: Callable) -> None:
    """For `qwentitan::<op_name>` on `neuron`: its NKI implementation (through the `nki_op` op
    where torch-neuronx has one, see `register_nki_ops`), or `reference(*args)` if not use_nki."""

    def neuron_impl(*args):
        *op_args, use_nki = args
        if not use_nki:
            return reference(*op_args)
        # Registered once per process, where this torch-neuronx has nki_op.
        if torch_neuronx_loader is not None and op_name in register_nki_ops(torch_neuronx_loader()):
            return _nki_ops[op_name](*op_args)
        return nki(*op_args)

    _registered[op_name] = neuron_impl
    _nki_impls[op_name] = nki
    _NEURON_IMPLS.impl(op_name, neuron_impl, "PrivateUse1")


_ANNOTATIONS = {"Tensor": torch.Tensor, "float": float, "int": int, "SymInt": int, "bool": bool}


def _typed_signature(op_name: str) -> inspect.Signature:
    """`qwentitan::<op_name>`'s arguments but `use_nki`, annotated, for nki_op's schema."""
    schema = getattr(torch.ops.qwentitan, op_name).default._schema
    params = [
        inspect.Parameter(a.name, inspect.Parameter.POSITIONAL_OR_KEYWORD,
                          annotation=_ANNOTATIONS[str(a.type)])
        for a in schema.arguments
        if a.name != "use_nki"
    ]  # fmt: skip
    returns = [_ANNOTATIONS[str(r.type)] for r in schema.returns]
    result = returns[0] if len(returns) == 1 else tuple[tuple(returns)]
    return inspect.Signature(params, return_annotation=result)


def register_nki_ops(torch_neuronx: ModuleType) -> list[str]:
    """Register every op's NKI implementation through `torch_neuronx.nki_op` as
    `qwentitan_nki::<op>`, once per process; the ops registered so (none without nki_op)."""
    nki_op = getattr(torch_neuronx, "nki_op", None)
    if nki_op is None:
        return []
    for op_name, nki in _nki_impls.items():
        if op_name in _nki_ops:
            continue

        def body(*args: Any, _nki: Callable = nki) -> Any:
            return _nki(*args)

        body.__signature__ = _typed_signature(op_name)  # type: ignore[attr-defined]
        body.__name__ = op_name
        _nki_ops[op_name] = nki_op(f"{NKI_OP_NAMESPACE}::{op_name}", body, mutates_args=())
    return sorted(_nki_ops)


def nki_op_registered(op_name: str) -> Any:
    """The `nki_op` registration of `op_name`'s NKI implementation, None where there is none."""
    return _nki_ops.get(op_name)


def neuron_impl(op_name: str) -> Callable:
    """The function registered for `qwentitan::<op_name>` on `neuron` (tests call it on cpu)."""
    return _registered[op_name]


def has_neuron_impl(op_name: str) -> bool:
    """Whether `qwentitan::<op_name>` has an implementation for the `neuron` device."""
    return torch._C._dispatch_has_kernel_for_dispatch_key(f"qwentitan::{op_name}", "PrivateUse1")
