"""A fake `nki` package: `nki.jit` kernels run the way TorchNeuron runs them, on cpu tensors.

What it stands for (public sources, read for these rules):
- an `@nki.jit` kernel object keeps the Python function in `.func` and its signature in
  `.sign`; TorchNeuron's `wrap_nki` reads both (TorchNeuron `torch_neuronx/nki_hop.py`,
  public mirror `parmoham-aws/test-repo-parmoham`);
- calling a jit kernel with torch tensors is how SDK 2.33 runs NKI from torch-neuronx ("How to
  work with NKI kernels from torch-neuronx", torch/guides/how-to-work-with-nki); the April
  TorchNeuron source launches only through `wrap_nki` (its tests, tests/nki/), so the fake takes
  a direct call only when the installed fake torch_neuronx is a documented release;
- a jit kernel called inside another kernel's trace runs inside that trace: nki-library does it
  (`moe_cte` calls `blockwise_mm_baseline_shard_intermediate`, core/moe/moe_cte/moe_cte.py and
  bwmm_shard_on_I.py; `attention_block_tkg` calls `output_projection_tkg`,
  experimental/transformer/attention_block_tkg.py), and `mode="trace"` kernels are launched
  top-level by its own tests (test/integration/nkilib/core/moe/moe_cte/test_moe_cte.py);
- a direct call takes its LNC from `NEURON_LOGICAL_NC_CONFIG` (default 1) while neuronx-cc takes
  2 on trn2 unless that variable says otherwise; a mismatch is compiler error NCC_EVRF066
  (nki.jit API page of SDK 2.33, compiler/error-codes/EVRF066); through `wrap_nki` the grid's
  first entry is the LNC;
- non-tensor arguments are compile-time constants that must be hashable, else RuntimeError
  (`_return_shape_dtype_or_hashable` in TorchNeuron `torch_neuronx/nki_kernel.py`).
"""

from __future__ import annotations

import inspect
import os
import sys
import threading
from collections.abc import Callable, Hashable, Sequence
from typing import Any

import torch

from . import language  # noqa: F401  (`import nki.language` reads it as an attribute)

_state = threading.local()


class NKIError(RuntimeError):
    """What the fake compiler raises for a call the real one would not take."""


def _tracing() -> tuple[int, ...] | None:
    return getattr(_state, "grid", None)


def num_programs() -> int:
    """The launch grid's first axis inside a trace (the LNC shards), as `nl.num_programs(0)`."""
    grid = _tracing()
    if grid is None:
        raise NKIError("num_programs() outside a kernel trace")
    return grid[0] if grid else 1


def constant_key(value: Any, name: str) -> Any:
    """torch_neuronx/nki_kernel.py `_return_shape_dtype_or_hashable`: tensors by shape and dtype."""
    if isinstance(value, torch.Tensor):
        return (tuple(value.shape), value.dtype)
    if isinstance(value, str):
        return value
    if isinstance(value, Sequence):
        return tuple(constant_key(v, f"{name}[{i}]") for i, v in enumerate(value))
    if isinstance(value, dict):
        return tuple((k, constant_key(v, f"{name}[{k}]")) for k, v in sorted(value.items()))
    if not isinstance(value, Hashable):
        raise RuntimeError(f"NKI parameter {name!r} of type {type(value).__name__} is not hashable")
    return value


def _compiler_lnc() -> int:
    return int(os.environ.get("NEURON_LOGICAL_NC_CONFIG", "2"))


class JitKernel:
    def __init__(self, func: Callable, mode: str | None = None, grid: tuple[int, ...] = ()):
        self.func = func
        self.sign = inspect.signature(func)
        self.mode = mode
        self.grid = grid
        self.__name__ = func.__name__
        self.calls: list[dict[str, Any]] = []  # launches
        self.nested_calls: list[dict[str, Any]] = []  # calls inside another kernel's trace

    def __getitem__(self, lnc: int) -> JitKernel:
        # The bracket LNC (being deprecated, EVRF066) takes one int.
        copy = JitKernel(self.func, self.mode, (int(lnc),))
        copy.calls, copy.nested_calls = self.calls, self.nested_calls
        return copy

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        arguments = self.sign.bind(*args, **kwargs)
        arguments.apply_defaults()
        if _tracing() is not None:  # nested: runs inside the caller's trace
            self.nested_calls.append(dict(arguments.arguments))
            return self.func(**arguments.arguments)
        if not any(isinstance(a, torch.Tensor) for a in arguments.arguments.values()):
            raise NKIError(f"{self.__name__}: the fake nki runs kernels on torch tensors only")
        host = sys.modules.get("torch_neuronx")
        if not getattr(host, "HANDLES_JIT_CALLS", False):
            raise NKIError(
                f"{self.__name__} was called directly with torch tensors, but this torch-neuronx "
                "launches NKI kernels only through torch_neuronx.wrap_nki(kernel)[grid](...)"
            )
        kernel_lnc = (
            self.grid[0] if self.grid else int(os.environ.get("NEURON_LOGICAL_NC_CONFIG", "1"))
        )
        if kernel_lnc != _compiler_lnc():
            raise NKIError(
                f"NCC_EVRF066: NKI kernel '{self.__name__}' is configured with LNC={kernel_lnc}, "
                f"but neuronx-cc is using LNC={_compiler_lnc()}"
            )
        for name, value in arguments.arguments.items():
            constant_key(value, name)
        return run_traced(self, (kernel_lnc,), dict(arguments.arguments))


def jit(func: Callable | None = None, *, mode: str | None = None, **_options: Any) -> Any:
    """`@nki.jit`, `@nki.jit()` and `@nki.jit(mode="trace")`."""
    if func is None:
        return lambda f: JitKernel(f, mode)
    return JitKernel(func, mode)


def run_traced(kernel: JitKernel, grid: tuple[int, ...], arguments: dict[str, Any]) -> Any:
    """Trace and run `kernel` once on `grid` (what TorchNeuron ends up doing)."""
    lnc = grid[0] if grid else 1
    if lnc != _compiler_lnc():
        raise NKIError(f"{kernel.__name__} launched with LNC {lnc} != NEURON_LOGICAL_NC_CONFIG")
    kernel.calls.append(arguments)
    _state.grid = grid
    try:
        return kernel.func(**arguments)
    finally:
        _state.grid = None
