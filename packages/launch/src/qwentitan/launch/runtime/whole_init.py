"""Step-0 weights that do not depend on the layout, on devices where DTensor cannot split a
random init across ranks.

torchtitan initialises a parallelized model on its shards. DTensor's RNG tracker makes each
rank's shard the slice of one draw of the full tensor, but only on CUDA-like devices
(`torch.distributed.tensor._random.is_rng_supported_mesh`); on CPU every rank fills its shard
from the same seed, so under FSDP 2 or TP 2 the model is not the model one rank trains.

`whole_init(model_parts, model_config, seed, dtype)` removes the cause on such a device. The
Trainer calls it once torchtitan built and initialised its model parts (each ran its own init,
which ties weights and builds buffers where torchtitan wants them): every part then takes the
values of its parameters from the whole model, built unsharded on the CPU and initialised as one
rank does, seeded with `debug.seed` (which `set_determinism` gives torch on every rank): its part
of each tensor, a DTensor's shard cut by `compute_local_shape_and_global_offset`. Every layout,
one rank included, then starts from the weights one rank would draw. It costs one unsharded
model per rank for a moment at start-up, which a CPU rehearsal holds easily. The copy comes
before the checkpoint load (in `train()`), so a resumed run still starts from its checkpoint.
"""

from __future__ import annotations

from typing import Any

import torch
from torch.distributed.tensor import DTensor
from torch.distributed.tensor._utils import compute_local_shape_and_global_offset
from torchtitan.tools.utils import set_default_dtype

__all__ = ["copy_part", "whole_init", "whole_model_state"]

# Module names that wrappers (activation checkpointing, torch.compile) put into a parameter's path.
_WRAPPERS = ("_checkpoint_wrapped_module", "_orig_mod")


def whole_init(
    model_parts: list[torch.nn.Module], model_config: Any, seed: int | None, dtype: torch.dtype
) -> None:
    """Give every part of `model_parts` (initialised by torchtitan) the weights of the whole
    `model_config` model, seeded with `seed`, as described in the module doc. Without a seed
    there is nothing to reproduce, and torchtitan's own init is kept."""
    if seed is None:
        return
    whole = whole_model_state(model_config, seed, dtype)
    for part in model_parts:
        copy_part(part, whole)


def whole_model_state(model_config: Any, seed: int, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """The parameters of `model_config` built whole on the CPU and initialised as one rank does
    (seeded with `seed`, default dtype `dtype`), by name; the caller's RNG untouched."""
    with torch.device("meta"), set_default_dtype(dtype):
        whole = model_config.build()
    whole.to_empty(device="cpu")
    with torch.random.fork_rng(devices=[]), torch.no_grad():
        torch.manual_seed(seed)
        whole.init_weights(buffer_device=None)
    return dict(whole.named_parameters())


def copy_part(part: torch.nn.Module, whole: dict[str, torch.Tensor]) -> None:
    """Copy into `part` (a model or pipeline stage, sharded or not) its piece of every parameter
    of the whole model."""
    with torch.no_grad():
        for name, param in part.named_parameters():
            full = whole[".".join(n for n in name.split(".") if n not in _WRAPPERS)]
            if isinstance(param, DTensor):
                shape, offset = compute_local_shape_and_global_offset(
                    param.shape, param.device_mesh, param.placements
                )
                full = full[tuple(slice(o, o + n) for o, n in zip(offset, shape, strict=True))]
                param = param.to_local()
            param.copy_(full)
