"""A fake `torch_neuronx` with only what the kernel side uses: `wrap_nki`.

Written from TorchNeuron's Python source (`torch_neuronx/nki_hop.py` and
`torch_neuronx/nki_kernel.py`, public mirror `parmoham-aws/test-repo-parmoham`):
- `wrap_nki(kernel)` reads the jit kernel's `.sign` and `.func` and returns a caller whose
  grid starts empty;
- `caller[grid]` converts the grid with `tuple(map(int, grid))`: a bare int is not a grid;
- a call merges positional and keyword arguments by the kernel's parameter names, fills the
  defaults, and hands tensors to the kernel while every other argument becomes a compile-time
  constant that must be hashable (it keys the kernel cache), so a mutable dataclass such as
  nki-library's `MoECTESpec` cannot cross this boundary.
Tensors on cpu stand for `neuron` tensors here; the kernel runs once through the fake `nki`.
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence
from typing import Any

import torch

from . import nki


def _constant_key(value: Any, name: str) -> Any:
    if isinstance(value, (str, torch.Tensor)):
        return value if isinstance(value, str) else (tuple(value.shape), value.dtype)
    if isinstance(value, Sequence):
        return tuple(_constant_key(v, f"{name}[{i}]") for i, v in enumerate(value))
    if isinstance(value, dict):
        return tuple((k, _constant_key(v, f"{name}[{k}]")) for k, v in sorted(value.items()))
    if not isinstance(value, Hashable):
        raise TypeError(
            f"wrap_nki: argument {name!r} of type {type(value).__name__} is not hashable"
        )
    return value


class NKIHOPCaller:
    def __init__(self, kernel: nki.JitKernel, grid: tuple[int, ...] = ()) -> None:
        self.kernel = kernel
        self.grid = grid
        self.arg_names = list(kernel.sign.parameters)
        self.defaults = {
            name: p.default
            for name, p in kernel.sign.parameters.items()
            if p.default is not p.empty
        }

    def __getitem__(self, grid: Any) -> NKIHOPCaller:
        return NKIHOPCaller(self.kernel, tuple(map(int, grid)))

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        merged = {**dict(zip(self.arg_names, args, strict=False)), **kwargs}
        unknown = set(merged) - set(self.arg_names)
        if unknown:
            raise TypeError(f"{self.kernel.__name__} got unexpected arguments {sorted(unknown)}")
        for name in self.arg_names:
            if name not in merged:
                if name not in self.defaults:
                    raise TypeError(f"{self.kernel.__name__} is missing argument {name!r}")
                merged[name] = self.defaults[name]
        hash(tuple(_constant_key(merged[name], name) for name in self.arg_names))
        return nki.run_traced(self.kernel, self.grid, merged)


def wrap_nki(nki_kernel: Any, **_kwargs: Any) -> NKIHOPCaller:
    if not isinstance(nki_kernel, nki.JitKernel):
        raise AttributeError("wrap_nki takes an nki.jit kernel (it reads .sign and .func)")
    return NKIHOPCaller(nki_kernel)
