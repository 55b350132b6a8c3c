"""Lazy access to the Neuron Kernel Interface (NKI) kernels behind the ops.

Nothing here imports `nki`, `nkilib` or `torch_neuronx` at module import: those packages exist
only on a Trainium host (the PyPI copies are placeholders), and this package must import on any
machine. The ops call `load_kernel(name)` at their first call on a `neuron` device; tests
replace `load_kernel` with doubles that implement the documented kernel signatures.
"""

from __future__ import annotations

import importlib
import os
from collections.abc import Callable
from typing import Any

from qwentitan.kernels.errors import KernelError

# Kernel names -> (module, attribute) in nki-library (shared/reference/neuron.md, section 3).
_NKILIB_KERNELS = {
    "rope_hf": ("nkilib.core.embeddings.rope_hf", "rope_hf"),
    "attention_cte": ("nkilib.core.attention.attention_cte", "attention_cte"),
    "attention_bwd": ("nkilib.core.attention.attention_bwd", "attention_bwd"),
}
# The MoE entry points are trace-mode sub-kernels, so they get a top-level @nki.jit launcher.
_MOE_KERNELS = ("moe_blockwise_fwd", "moe_blockwise_bwd")
KERNEL_NAMES = (*_NKILIB_KERNELS, *_MOE_KERNELS)

_cache: dict[str, Any] = {}


def logical_core_count() -> int:
    """LNC of this process: `NEURON_LOGICAL_NC_CONFIG` (1 or 2, default 2 on trn2)."""
    raw = os.environ.get("NEURON_LOGICAL_NC_CONFIG", "2")
    if raw not in ("1", "2"):
        raise KernelError(
            f"NEURON_LOGICAL_NC_CONFIG is {raw!r}; set it to 1 or 2 (the launch [lnc] of every "
            "NKI kernel must equal it)."
        )
    return int(raw)


def load_kernel(name: str) -> Any:
    """The NKI kernel `name`, launchable as `kernel[lnc](**kwargs)`; imported on first use."""
    if name not in KERNEL_NAMES:
        raise KernelError(f"unknown NKI kernel {name!r}; use one of {', '.join(KERNEL_NAMES)}.")
    if name not in _cache:
        _cache[name] = _import_kernel(name)
    return _cache[name]


def _import_kernel(name: str) -> Any:
    try:
        if name in _NKILIB_KERNELS:
            module, attribute = _NKILIB_KERNELS[name]
            return getattr(importlib.import_module(module), attribute)
        return _moe_launcher(name)
    except ImportError as exc:
        raise KernelError(
            f"the NKI kernel {name!r} needs the Neuron SDK (nki, nki-library, neuronx-cc from the "
            f"Neuron pip repository), which is not installed here ({exc}); install it on the "
            "Trainium host or run on cpu/cuda, where the reference twin is used."
        ) from exc


def _moe_launcher(name: str) -> Callable[..., Any]:
    # Unverified on hardware: module paths and enum names follow nki-library at SDK 2.29-2.32.
    import nki
    from nkilib.core.moe.moe_cte.moe_cte import (
        ExpertAffinityScaleMode,
        MoECTEImplementation,
        MoECTESpec,
        ShardOnIConfig,
        moe_cte,
    )
    from nkilib.experimental.moe.bwd.blockwise_mm_backward import (
        ActFnType,
        AffinityOption,
        ShardOption,
        blockwise_mm_bwd,
    )

    if name == "moe_blockwise_fwd":

        @nki.jit
        def moe_blockwise_fwd(
            hidden_states,
            expert_affinities_masked,
            gate_up_proj_weight,
            down_proj_weight,
            token_position_to_id,
            block_to_expert,
            block_size,
        ):
            # POST_SCALE: the backward kernel assumes affinities applied after the down proj.
            spec = MoECTESpec(
                implementation=MoECTEImplementation.shard_on_i,
                shard_on_I=ShardOnIConfig(checkpoint_activation=True),
            )
            return moe_cte(
                hidden_states=hidden_states,
                expert_affinities_masked=expert_affinities_masked,
                gate_up_proj_weight=gate_up_proj_weight,
                down_proj_weight=down_proj_weight,
                token_position_to_id=token_position_to_id,
                block_to_expert=block_to_expert,
                block_size=block_size,
                spec=spec,
                is_tensor_update_accumulating=True,
                expert_affinities_scaling_mode=ExpertAffinityScaleMode.POST_SCALE,
            )

        return moe_blockwise_fwd

    @nki.jit
    def moe_blockwise_bwd(
        hidden_states,
        expert_affinities_masked,
        gate_up_proj_weight,
        down_proj_weight,
        gate_up_proj_act_checkpoint_T,
        down_proj_act_checkpoint,
        token_position_to_id,
        block_to_expert,
        output_hidden_states_grad,
        block_size,
        is_tensor_update_accumulating,
    ):
        # SHARD_ON_FREE: the S32 default SHARD_ON_HIDDEN needs AFFINITY_ON_I.
        return blockwise_mm_bwd(
            hidden_states=hidden_states,
            expert_affinities_masked=expert_affinities_masked,
            gate_up_proj_weight=gate_up_proj_weight,
            down_proj_weight=down_proj_weight,
            gate_up_proj_act_checkpoint_T=gate_up_proj_act_checkpoint_T,
            down_proj_act_checkpoint=down_proj_act_checkpoint,
            token_position_to_id=token_position_to_id,
            block_to_expert=block_to_expert,
            output_hidden_states_grad=output_hidden_states_grad,
            block_size=block_size,
            is_tensor_update_accumulating=is_tensor_update_accumulating,
            shard_option=ShardOption.SHARD_ON_FREE,
            affinity_option=AffinityOption.AFFINITY_ON_H,
            activation_type=ActFnType.SiLU,
        )

    return moe_blockwise_bwd
