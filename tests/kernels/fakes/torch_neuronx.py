"""A fake `torch_neuronx` with only what the kernel side uses: its version and `wrap_nki`.

`build(version, wrap_nki)` makes one. A release SDK 2.33 documents (2.13 / 2.14) runs a plain
`@nki.jit` call on neuron tensors (fake `nki.JitKernel.__call__`); whether it still has
`wrap_nki` no 2.33 page says, so the default stand-in has none. "0.1.0" stands for the April
2026 source (public mirror `parmoham-aws/test-repo-parmoham`), which launches through
`wrap_nki` only. Rules of `wrap_nki`, from that source:
- `wrap_nki(kernel)` reads the jit kernel's `.sign` and `.func` and returns a caller whose grid
  starts empty (`torch_neuronx/nki_hop.py`, `wrap_nki`);
- `caller[grid]` converts the grid with `tuple(map(int, grid))`: a bare int is not a grid
  (`NKIHOPCaller.__getitem__`);
- a call merges positional and keyword arguments, then builds the argument list from the
  kernel's parameter names only, so an unknown keyword is dropped silently, and fills a
  missing one from the defaults, a KeyError if it has none (`NKIHOPCaller.__call__`);
- every non-tensor argument becomes a compile-time constant that must be hashable, else
  RuntimeError (`torch_neuronx/nki_kernel.py`), so nki-library's mutable `MoECTESpec` cannot
  cross this boundary.
`nki_op(name, fn=None, mutates_args=())`, as "How to work with NKI kernels from torch-neuronx"
(SDK 2.33) describes it and the April source writes it (`nki_hop.py`): a PyTorch custom op named
`name` (`torch.library.custom_op`, its schema from `fn`'s type annotations, which it requires)
whose implementation and fake implementation are `fn`; usable as a decorator too.
Tensors on cpu stand for `neuron` tensors here; the kernel runs once through the fake `nki`.
"""

from __future__ import annotations

import types
from typing import Any

import torch

from . import nki


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
        given = {**dict(zip(self.arg_names, args, strict=False)), **kwargs}
        merged = {
            name: given[name] if name in given else self.defaults[name] for name in self.arg_names
        }
        for name, value in merged.items():
            nki.constant_key(value, name)
        return nki.run_traced(self.kernel, self.grid, merged)


def wrap_nki(nki_kernel: Any, **_kwargs: Any) -> NKIHOPCaller:
    if not isinstance(nki_kernel, nki.JitKernel):
        raise AttributeError("wrap_nki takes an nki.jit kernel (it reads .sign and .func)")
    return NKIHOPCaller(nki_kernel)


registered_ops: list[str] = []  # every op nki_op made in this process, in order


def nki_op(name: str, fn: Any = None, mutates_args: Any = ()) -> Any:
    def register(fn: Any) -> Any:
        op = torch.library.custom_op(name, fn, mutates_args=mutates_args)
        op.register_fake(fn)
        registered_ops.append(name)
        return op

    return register if fn is None else register(fn)


DOCUMENTED = "2.14.3.0"
APRIL_SOURCE = "0.1.0"


def build(
    version: str = DOCUMENTED, *, has_wrap_nki: bool = False, has_nki_op: bool = True
) -> types.ModuleType:
    """A fake torch_neuronx module of `version`, with `wrap_nki` and `nki_op` when asked."""
    module = types.ModuleType("torch_neuronx")
    module.__version__ = version
    module.HANDLES_JIT_CALLS = version != APRIL_SOURCE
    if has_wrap_nki:
        module.wrap_nki = wrap_nki
    if has_nki_op:
        module.nki_op = nki_op
    return module
