"""A fake `nki` package: `nki.jit` kernels that refuse the calls the real compiler refuses.

What it stands for (public sources, read for these rules):
- an `@nki.jit` kernel object keeps the Python function in `.func` and its signature in
  `.sign`; TorchNeuron's `wrap_nki` reads both (TorchNeuron `torch_neuronx/nki_hop.py`,
  public mirror `parmoham-aws/test-repo-parmoham`; nki-library unwraps `.func` in
  `test/utils/param_extractor.py`);
- `@nki.jit(mode="trace")` marks a sub-kernel meant to run inside another kernel's trace
  (nki-library `src/nkilib_src/nkilib/core/moe/moe_cte/moe_cte.py`), so a launcher calls its
  `.func`, never the jit object itself: a second jit inside a trace is refused here;
- the launch grid's first entry is the LNC and must equal `NEURON_LOGICAL_NC_CONFIG`, else the
  runtime fails (nki.jit API page of the Neuron docs, `nki/api/generated/nki.jit`); an empty
  grid means LNC=1;
- a raw call of a kernel with torch tensors belongs to the XLA integration; on TorchNeuron's
  `neuron` device the documented route is `torch_neuronx.wrap_nki(kernel)[grid](...)`, so a
  direct call with torch tensors is refused here.
"""

from __future__ import annotations

import inspect
import os
import threading
from collections.abc import Callable
from typing import Any

import torch

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


class JitKernel:
    def __init__(self, func: Callable, mode: str | None = None) -> None:
        self.func = func
        self.sign = inspect.signature(func)
        self.mode = mode
        self.__name__ = func.__name__
        self.calls: list[dict[str, Any]] = []

    def __getitem__(self, grid: Any) -> Callable[..., Any]:
        return lambda *args, **kwargs: self._direct_call(args, kwargs)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self._direct_call(args, kwargs)

    def _direct_call(self, args: tuple, kwargs: dict) -> Any:
        if _tracing() is not None:
            raise NKIError(
                f"nested nki.jit: {self.__name__} was called as a jit kernel inside another "
                "kernel's trace; call its .func instead"
            )
        if any(isinstance(a, torch.Tensor) for a in (*args, *kwargs.values())):
            raise NKIError(
                f"{self.__name__} was called directly with torch tensors; on TorchNeuron launch "
                "it through torch_neuronx.wrap_nki(kernel)[grid](...)"
            )
        raise NKIError(f"{self.__name__}: the fake nki runs kernels only through wrap_nki")


def jit(func: Callable | None = None, *, mode: str | None = None, **_options: Any) -> Any:
    """`@nki.jit`, `@nki.jit()` and `@nki.jit(mode="trace")`."""
    if func is None:
        return lambda f: JitKernel(f, mode)
    return JitKernel(func, mode)


def run_traced(kernel: JitKernel, grid: tuple[int, ...], arguments: dict[str, Any]) -> Any:
    """Trace and run `kernel` once on `grid` (what TorchNeuron's HOP ends up doing)."""
    if _tracing() is not None:
        raise NKIError(f"nested nki.jit: {kernel.__name__} launched inside another trace")
    lnc = grid[0] if grid else 1
    if lnc != int(os.environ.get("NEURON_LOGICAL_NC_CONFIG", "1")):
        raise NKIError(f"{kernel.__name__} launched with LNC {lnc} != NEURON_LOGICAL_NC_CONFIG")
    kernel.calls.append(arguments)
    _state.grid = grid
    try:
        return kernel.func(**arguments)
    finally:
        _state.grid = None
