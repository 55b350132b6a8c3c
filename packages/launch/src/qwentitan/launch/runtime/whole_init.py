"""Step-0 weights that do not depend on the layout, on devices where DTensor cannot split a
random init across ranks.

torchtitan initialises a parallelized model on its shards. DTensor's RNG tracker makes each
rank's shard the slice of one draw of the full tensor, but only on CUDA-like devices
(`torch.distributed.tensor._random.is_rng_supported_mesh`); on CPU every rank fills its shard
from the same seed, so under FSDP 2 or TP 2 the model is not the model one rank trains.

`whole_init(config)` removes the cause on such a device: every model part first runs its own
init (which ties weights and builds buffers where torchtitan wants them), then takes the values
of its parameters from the whole model, built unsharded on the CPU and initialised as one rank
does, seeded with `debug.seed` (which `set_determinism` gives torch on every rank and stage
alike): its part of each tensor, a DTensor's shard cut by `compute_local_shape_and_global_offset`.
Every layout, one rank included, then starts from the weights one rank would draw. It costs
one unsharded model per rank for a moment at start-up, which a CPU rehearsal holds easily.
"""

from __future__ import annotations

import functools
import warnings
from collections.abc import Callable
from typing import Any

import torch
from torch.distributed.tensor import DTensor
from torch.distributed.tensor._utils import compute_local_shape_and_global_offset
from torchtitan.config import TORCH_DTYPE_MAP
from torchtitan.tools.utils import set_default_dtype

__all__ = ["copy_part", "whole_init", "whole_model_state"]

_DTENSOR_RANDOM = "DTensor random operators may not have complete support"
# Module names that wrappers (activation checkpointing, torch.compile) put into a parameter's path.
_WRAPPERS = ("_checkpoint_wrapped_module", "_orig_mod")


def whole_init(config: Any) -> None:
    """Make the model of `config` (a Trainer.Config) initialise as described in the module doc:
    its spec's `parallelize_fn` (which torchtitan also hands each pipeline stage) gives every
    part it returns an `init_weights` that copies from the whole model. Without a seed there is
    nothing to reproduce, and torchtitan's own init is kept."""
    seed = config.debug.seed
    spec = config.model_spec
    if seed is None or spec is None:
        return
    # Built again for each part (a pipeline rank may hold two), and dropped once copied.
    state = functools.partial(
        whole_model_state, spec.model, seed, TORCH_DTYPE_MAP[config.training.dtype]
    )
    spec.parallelize_fn = _initialised_from(spec.parallelize_fn, state)


def _initialised_from(
    parallelize_fn: Callable[..., Any], whole: Callable[[], dict[str, torch.Tensor]]
) -> Callable[..., Any]:
    @functools.wraps(parallelize_fn)
    def parallelize(model: torch.nn.Module, *args: Any, **kwargs: Any) -> torch.nn.Module:
        part = parallelize_fn(model, *args, **kwargs)
        own_init = part.init_weights

        def init_weights(**init_kwargs: Any) -> None:
            # The part's own random draws are replaced just below: torch's warning that they
            # are not split across ranks on this mesh is about values that are not kept, and
            # they leave the RNG as they found it.
            with warnings.catch_warnings(), torch.random.fork_rng(devices=[]):
                warnings.filterwarnings("ignore", _DTENSOR_RANDOM, UserWarning)
                own_init(**init_kwargs)
            copy_part(part, whole())

        part.init_weights = init_weights  # what torchtitan calls after `to_empty`
        return part

    return parallelize


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
