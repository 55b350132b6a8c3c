"""Lazy access to the Neuron Kernel Interface (NKI) kernels behind the ops, via TorchNeuron.

Nothing here imports `nki`, `nkilib` or `torch_neuronx` at module import: those packages exist
only on a Trainium host (the PyPI copies are placeholders), and this package must import on any
machine. The ops call `launch(name, lnc, **kwargs)` on a `neuron` device.

How a kernel is launched on TorchNeuron's `neuron` tensors (TorchNeuron's Python source,
`torch_neuronx/nki_hop.py`, public mirror `parmoham-aws/test-repo-parmoham`):
`torch_neuronx.wrap_nki(kernel)[grid](**kwargs)`. A raw `kernel[grid](...)` call with torch
tensors belongs to the torch-xla integration. The caller's grid is a sequence (`tuple(map(int,
grid))`), and every non-tensor argument becomes a compile-time constant that must be hashable
(`torch_neuronx/nki_kernel.py`), so mutable spec objects stay inside our own launchers.
`torch_neuronx` is imported here explicitly: with `TORCH_DEVICE_BACKEND_AUTOLOAD=0` nothing
else would import it, and the run would not reach the neuron device at all.
"""

from __future__ import annotations

import importlib
import os
from collections.abc import Callable
from importlib import metadata
from types import ModuleType
from typing import Any

from qwentitan.kernels.errors import KernelError

# The oldest nki-library with every kernel below: rope_hf, attention_bwd, moe_cte (MoECTESpec)
# and experimental/moe/bwd/blockwise_mm_bwd first appear on aws-neuron/nki-library's release
# branch 2.28 (branch 2.27 has attention_cte only). The library's branches follow the Neuron
# compiler releases and neuronx-cc bundles its own nkilib (nki-library README.md), so this is
# also the Neuron SDK 2.28 bundle.
MIN_NKI_LIBRARY = "2.28"

# Kernel name -> (module, attribute) in aws-neuron/nki-library, src/nkilib_src/<module as path>.py.
_NKILIB_KERNELS = {
    "rope_hf": ("nkilib.core.embeddings.rope_hf", "rope_hf"),
    "attention_cte": ("nkilib.core.attention.attention_cte", "attention_cte"),
    "attention_bwd": ("nkilib.core.attention.attention_bwd", "attention_bwd"),
}
# Our top-level launchers around nki-library's MoE entry points (see _moe_launcher).
_MOE_KERNELS = ("moe_blockwise_fwd", "moe_blockwise_bwd")
KERNEL_NAMES = (*_NKILIB_KERNELS, *_MOE_KERNELS)

# ShardOption members the MoE backward may take, best first. nki-library 2.28, 2.29 and main
# (April 2026) define AUTO, SHARD_ON_HIDDEN, SHARD_ON_INTERMEDIATE, BASELINE_LNC1
# (experimental/moe/bwd/moe_bwd_parameters.py) and default to SHARD_ON_HIDDEN, which is how
# their dropless backward shards (MOEBwdParameters.validate_sharding splits H over the LNC
# shards). SHARD_ON_FREE exists in none of them; it is kept only for a build that offers it.
SHARD_OPTION_PREFERENCE = ("SHARD_ON_HIDDEN", "SHARD_ON_FREE")

_cache: dict[str, Any] = {}


def logical_core_count() -> int:
    """LNC of this process: `NEURON_LOGICAL_NC_CONFIG` (1 or 2, default 2 on trn2)."""
    raw = os.environ.get("NEURON_LOGICAL_NC_CONFIG", "2")
    if raw not in ("1", "2"):
        raise KernelError(
            f"NEURON_LOGICAL_NC_CONFIG is {raw!r}; set it to 1 or 2 (every NKI launch uses it "
            "as its LNC)."
        )
    return int(raw)


def import_torch_neuronx() -> ModuleType:
    """TorchNeuron's `torch_neuronx`, imported explicitly (it registers the `neuron` device)."""
    try:
        import torch_neuronx
    except ImportError as exc:
        raise KernelError(
            f"the neuron device needs TorchNeuron (torch-neuronx), which cannot be imported here "
            f"({exc}); install torch-neuronx from the Neuron pip repository on the Trainium host "
            "or run on cpu/cuda, where the reference twins are used."
        ) from exc
    return torch_neuronx


def load_kernel(name: str) -> Any:
    """The kernel `name` wrapped by `torch_neuronx.wrap_nki`; imported on first use."""
    if name not in KERNEL_NAMES:
        raise KernelError(f"unknown NKI kernel {name!r}; use one of {', '.join(KERNEL_NAMES)}.")
    if name not in _cache:
        _cache[name] = import_torch_neuronx().wrap_nki(_import_kernel(name))
    return _cache[name]


def launch(name: str, lnc: int, **kwargs: Any) -> Any:
    """Run kernel `name` on `lnc` logical cores (grid `(lnc,)`) with keyword arguments."""
    return load_kernel(name)[(lnc,)](**kwargs)


def installed_nki_library() -> str:
    """Which distribution provides `nkilib` here and its version, for messages."""
    for dist, form in (("nki-library", "{}"), ("neuronx-cc", "bundled in neuronx-cc {}")):
        try:
            return form.format(metadata.version(dist))
        except metadata.PackageNotFoundError:
            continue
    return "unknown version"


def _too_old(what: str, kernel: str) -> KernelError:
    switch = "experts" if kernel.startswith("moe") else kernel.split("_")[0]
    return KernelError(
        f"{what}, so this nki-library ({installed_nki_library()}) is too old for the NKI path; "
        f"install nki-library {MIN_NKI_LIBRARY} or newer (Neuron SDK {MIN_NKI_LIBRARY}+) or fall "
        f"back to the reference twin with QWENTITAN_KERNELS={switch}=reference."
    )


def _import_kernel(name: str) -> Any:
    try:
        if name in _NKILIB_KERNELS:
            module, attribute = _NKILIB_KERNELS[name]
            return getattr(importlib.import_module(module), attribute)
        return _moe_launcher(name)
    except ImportError as exc:
        raise _too_old(f"the NKI kernel {name!r} cannot be imported ({exc})", name) from exc


def pick_shard_option(shard_option: type) -> Any:
    """The best member of the installed `ShardOption` enum, or KernelError naming the minimum."""
    for member in SHARD_OPTION_PREFERENCE:
        if member in shard_option.__members__:
            return shard_option[member]
    offered = ", ".join(shard_option.__members__)
    raise _too_old(
        f"blockwise_mm_bwd needs ShardOption.{SHARD_OPTION_PREFERENCE[0]} but this ShardOption "
        f"offers {offered}",
        "moe_blockwise_bwd",
    )


def _moe_launcher(name: str) -> Callable[..., Any]:
    """A top-level `@nki.jit` launcher around nki-library's MoE entry point.

    nki-library declares `moe_cte` a trace-mode sub-kernel (`@nki.jit(mode="trace")`) and
    `blockwise_mm_bwd` a jit kernel of its own; inside our launcher both run through `.func`,
    the plain function, so no second jit starts inside the trace. Only tensors and ints cross
    the wrap_nki boundary: the unhashable `MoECTESpec` is built inside the trace.
    """
    import nki

    if name == "moe_blockwise_fwd":
        from nkilib.core.moe.moe_cte.moe_cte import (
            MoECTEImplementation,
            MoECTESpec,
            ShardOnIConfig,
            moe_cte,
        )
        from nkilib.core.utils.common_types import ExpertAffinityScaleMode

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
            # shard_on_i with checkpoint_activation returns (output, gate_up_activations_T,
            # down_activations) (ShardOnIConfig's docstring); POST_SCALE because the backward
            # kernel applies the affinity on H, after the down projection.
            spec = MoECTESpec(
                implementation=MoECTEImplementation.shard_on_i,
                shard_on_I=ShardOnIConfig(checkpoint_activation=True),
            )
            return moe_cte.func(
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

    from nkilib.experimental.moe.bwd.blockwise_mm_backward import blockwise_mm_bwd
    from nkilib.experimental.moe.bwd.moe_bwd_parameters import (
        ActFnType,
        AffinityOption,
        ShardOption,
    )

    shard_option = pick_shard_option(ShardOption)

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
        return blockwise_mm_bwd.func(
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
            shard_option=shard_option,
            affinity_option=AffinityOption.AFFINITY_ON_H,
            activation_type=ActFnType.SiLU,
        )

    return moe_blockwise_bwd
