"""Which initialisation functions a model config runs, and whether TorchNeuron handles them.

torchtitan's Trainer runs every module's `param_init` on the training device (`init_device =
device_type` unless `create_seed_checkpoint` or `enable_cpu_offload`), also when the weights
are then loaded from a checkpoint, so a seeded initial checkpoint does not keep an init op off
the device. TorchNeuron's own torchtitan patches replace `nn.init.trunc_normal_` by `normal_`
on neuron, citing PyTorch issues 145498 and 155588 (docs/torchtitan/gpt-oss/TorchTitan.diff in
the public TorchNeuron mirror `parmoham-aws/test-repo-parmoham`). torchtitan 0.3.0's Qwen3
already initialises with `normal_` (torchtitan/models/qwen3/__init__.py, `_LINEAR_INIT`), so
`check_neuron_init` only guards that this stays true for the configs we build.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable, Iterator
from typing import Any

from qwentitan.modeling.errors import ModelingError

# Init functions known to misbehave on TorchNeuron, with the fix to name.
NEURON_UNSAFE_INIT = {"trunc_normal_": "nn.init.normal_ with the same mean and std"}


def _functions(fn: Callable) -> Iterator[Callable]:
    """`fn` and the callables it wraps: partials, and closures such as torchtitan's fused-qkv
    init (`config_utils._fused_qkv_param_init`), which calls the base init per q/k/v slice."""
    seen: set[int] = set()
    todo = [fn]
    while todo:
        f = todo.pop()
        if id(f) in seen or not callable(f):
            continue
        seen.add(id(f))
        yield f
        if isinstance(f, functools.partial):
            todo.append(f.func)
        for cell in getattr(f, "__closure__", None) or ():
            try:
                todo.append(cell.cell_contents)
            except ValueError:  # an empty cell
                continue


def _walk(node: Any, path: str) -> Iterator[tuple[str, Any]]:
    if dataclasses.is_dataclass(node) and not isinstance(node, type):
        for field in dataclasses.fields(node):
            yield from _walk(
                getattr(node, field.name), f"{path}.{field.name}" if path else field.name
            )
    elif isinstance(node, (list, tuple)):
        for i, child in enumerate(node):
            yield from _walk(child, f"{path}.{i}" if path else str(i))
    elif isinstance(node, dict):
        for key, child in node.items():
            yield from _walk(child, f"{path}.{key}" if path else str(key))
    elif callable(node):
        yield path, node


def param_init_ops(model_config: Any) -> dict[str, list[str]]:
    """Every `param_init` entry of a model config tree: {path: names of the functions it runs}."""
    found: dict[str, list[str]] = {}
    for path, fn in _walk(model_config, ""):
        if ".param_init." in f".{path}" or path.startswith("param_init."):
            names = [getattr(f, "__name__", "") for f in _functions(fn)]
            found[path] = sorted({n for n in names if n.endswith("_") and not n.startswith("_")})
    return found


def check_neuron_init(model_config: Any) -> None:
    """Raise ModelingError if the config would run an init op TorchNeuron mishandles."""
    bad = {
        path: [n for n in names if n in NEURON_UNSAFE_INIT]
        for path, names in param_init_ops(model_config).items()
    }
    bad = {path: names for path, names in bad.items() if names}
    if bad:
        path, names = next(iter(bad.items()))
        raise ModelingError(
            f"{len(bad)} parameter inits of this model run {names[0]} (first: {path}), which "
            f"misbehaves on TorchNeuron; use {NEURON_UNSAFE_INIT[names[0]]} in their param_init."
        )
