"""Lazy access to the Neuron Kernel Interface (NKI) kernels behind the ops, via TorchNeuron.

Nothing here imports `nki`, `nkilib` or `torch_neuronx` at module import: those packages exist
only on a Trainium host (the PyPI copies are placeholders), and this package must import on any
machine. The ops call `launch(name, lnc, **kwargs)` on a `neuron` device.

Two routes launch a kernel on TorchNeuron's `neuron` tensors; `launch_route()` picks one per
process and `launch` logs it the first time each kernel runs:
- `nki.jit` (primary): call the `@nki.jit` kernel itself with neuron tensors; torch-neuronx
  handles the call, eager or inside `torch.compile(backend="neuron")` (Neuron SDK 2.33, "How to
  work with NKI kernels from torch-neuronx", torch/guides/how-to-work-with-nki and "Quickstart:
  Run an NKI kernel from torch-neuronx", torch/get-started/quickstart-nki-kernel). The LNC comes
  from `NEURON_LOGICAL_NC_CONFIG`, which must be set: unset, the kernel takes LNC 1 while
  neuronx-cc takes 2 on trn2, and the bracket `kernel[lnc]` that would override it is being
  deprecated (nki.jit API page of SDK 2.33; compiler error NCC_EVRF066).
- `wrap_nki`: `torch_neuronx.wrap_nki(kernel)[(lnc,)](**kwargs)`, the only route of the April
  2026 TorchNeuron source (torch-neuronx 0.1.0, `torch_neuronx/nki_hop.py`, public mirror
  `parmoham-aws/test-repo-parmoham`). No SDK 2.33 page names it, so it is taken only by a
  torch-neuronx older than the 2.13 / 2.14 releases SDK 2.33 documents, and only when that
  torch-neuronx has it.
Every non-tensor argument is a compile-time constant that must be hashable (it keys the kernel
cache, `torch_neuronx/nki_kernel.py`), so mutable spec objects stay inside our own launchers.
`torch_neuronx` is imported here explicitly: with `TORCH_DEVICE_BACKEND_AUTOLOAD=0` nothing
else would import it, and the run would not reach the neuron device at all.
"""

from __future__ import annotations

import importlib
import logging
import re
from collections.abc import Callable
from importlib import metadata
from types import ModuleType
from typing import Any

import torch

from qwentitan.kernels import neuron_dispatch
from qwentitan.kernels.env import LNC_ENV, lnc_setting
from qwentitan.kernels.errors import KernelError

logger = logging.getLogger("qwentitan.kernels")

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

ROUTE_NKI_JIT = "nki.jit"
ROUTE_WRAP_NKI = "wrap_nki"
# The torch-neuronx releases SDK 2.33 documents ("Install PyTorch for Neuron": 2.14.3.0 for
# torch 2.14, 2.13.3.0 for torch 2.13); they run a plain `@nki.jit` call on neuron tensors.
_DOCUMENTED_TORCH_NEURONX = (2, 13)

_cache: dict[str, Any] = {}
_logged: set[str] = set()


def logical_core_count() -> int:
    """LNC of this process: `NEURON_LOGICAL_NC_CONFIG` (1 or 2, default 2 on trn2)."""
    raw = lnc_setting()
    raw = "2" if raw is None else raw
    if raw not in ("1", "2"):
        raise KernelError(
            f"{LNC_ENV} is {raw!r}; set it to 1 or 2 (every NKI launch uses it as its LNC)."
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


def _release(version: str) -> tuple[int, int]:
    match = re.match(r"(\d+)\.(\d+)", version)
    return (int(match[1]), int(match[2])) if match else (0, 0)


def launch_route() -> str:
    """`nki.jit` (documented by SDK 2.33) or `wrap_nki` (older torch-neuronx that has it)."""
    torch_neuronx = import_torch_neuronx()
    version = str(getattr(torch_neuronx, "__version__", ""))
    if _release(version) >= _DOCUMENTED_TORCH_NEURONX or not hasattr(torch_neuronx, "wrap_nki"):
        return ROUTE_NKI_JIT
    return ROUTE_WRAP_NKI


def has_nki_op() -> bool:
    """Whether this host's torch-neuronx has `nki_op`, the custom-op registration SDK 2.33
    documents for NKI kernels inside `torch.compile(backend="neuron")`."""
    try:
        return hasattr(import_torch_neuronx(), "nki_op")
    except KernelError:
        return False


def register_nki_ops() -> list[str]:
    """Register the ops' NKI implementations through `nki_op` where torch-neuronx has it."""
    return neuron_dispatch.register_nki_ops(import_torch_neuronx())


neuron_dispatch.torch_neuronx_loader = import_torch_neuronx


def route_description() -> str:
    """What the replaced modules will launch through here, for the replacement log."""
    try:
        route = launch_route()
        registered = " as nki_op custom ops" if register_nki_ops() else ""
        return f"{route}{registered} on neuron, reference twin elsewhere"
    except KernelError:
        return "reference twin (no torch-neuronx here)"


def load_kernel(name: str) -> Any:
    """The `@nki.jit` kernel `name` (nki-library's, or our MoE launcher); imported on first use."""
    if name not in KERNEL_NAMES:
        raise KernelError(f"unknown NKI kernel {name!r}; use one of {', '.join(KERNEL_NAMES)}.")
    if name not in _cache:
        import_torch_neuronx()
        _cache[name] = _import_kernel(name)
    return _cache[name]


def launch(name: str, lnc: int, **kwargs: Any) -> Any:
    """Run kernel `name` on `lnc` logical cores with keyword arguments, by `launch_route()`."""
    kernel = load_kernel(name)
    route = launch_route()
    if route == ROUTE_WRAP_NKI:
        wrapped = _cache.setdefault(f"{name}/wrap_nki", import_torch_neuronx().wrap_nki(kernel))
        call = wrapped[(lnc,)]
    else:
        raw = lnc_setting()
        if raw != str(lnc):
            raise KernelError(
                f"the NKI kernel {name} runs at LNC {lnc} but {LNC_ENV} is "
                f"{'unset' if raw is None else repr(raw)}, and an @nki.jit call takes its LNC "
                f"from that variable; export {LNC_ENV}={lnc} before the run starts."
            )
        call = kernel
    if name not in _logged:
        _logged.add(name)
        logger.info("NKI kernel %s launched through %s at LNC %d", name, route, lnc)
    return call(**kwargs)


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


_NKI_DTYPES = {torch.float32: "float32", torch.bfloat16: "bfloat16", torch.float16: "float16"}


def nki_dtype_name(dtype: torch.dtype) -> str:
    """The `nki.language` name of a torch dtype, a hashable constant that crosses the launch."""
    if dtype not in _NKI_DTYPES:
        raise KernelError(
            f"the NKI kernels compute in float32, bfloat16 or float16, got {dtype}; cast the "
            "activations to one of them."
        )
    return _NKI_DTYPES[dtype]


def _moe_launcher(name: str) -> Callable[..., Any]:
    """A top-level `@nki.jit` launcher around nki-library's MoE entry point.

    It calls `moe_cte` (a trace-mode sub-kernel) and `blockwise_mm_bwd` (a jit kernel) as jit
    kernels inside its own trace, as nki-library does itself (`moe_cte` calls
    `blockwise_mm_baseline_shard_intermediate` of `bwmm_shard_on_I.py`, `attention_block_tkg`
    calls `output_projection_tkg`). Only tensors, ints and strings cross the launch: the
    unhashable `MoECTESpec` is built inside, and `compute_dtype` crosses as an `nki.language`
    name, since both kernels default it to bfloat16 whatever the activations are.
    """
    return _moe_forward_launcher() if name == "moe_blockwise_fwd" else _moe_backward_launcher()


def _moe_forward_launcher() -> Callable[..., Any]:
    """`moe_blockwise_fwd`: moe_cte, sharded on the intermediate dim, activations kept."""
    import nki
    import nki.language as nl
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
        compute_dtype,
    ):
        # shard_on_i with checkpoint_activation returns (output, gate_up_activations_T,
        # down_activations) (ShardOnIConfig's docstring); POST_SCALE because the backward
        # kernel applies the affinity on H, after the down projection.
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
            compute_dtype=getattr(nl, compute_dtype),
            is_tensor_update_accumulating=True,
            expert_affinities_scaling_mode=ExpertAffinityScaleMode.POST_SCALE,
        )

    return moe_blockwise_fwd


def moe_backward_sharding(bwd_parameters: ModuleType) -> dict[str, Any]:
    """The sharding keywords for `blockwise_mm_bwd`, chosen by the library's `ShardOption` enum.

    nki-library 2.28, 2.29 and main of April 2026 accept `shard_option` / `affinity_option` and
    never read them; from commit 092a49d (about SDK 2.32) the kernel forwards both to
    `MOEBwdParameters`, whose `validate()` asserts that its default `SHARD_ON_HIDDEN` goes with
    `AFFINITY_ON_I`, while the default affinity is `AFFINITY_ON_H`: called with its defaults it
    fails. That generation is the one whose enum has `SHARD_ON_FREE` (the older one has AUTO,
    SHARD_ON_HIDDEN, SHARD_ON_INTERMEDIATE, BASELINE_LNC1), so the enum decides, never a version
    string: shard on the matmuls' free dim, affinity on H, which is what the forward's
    POST_SCALE checkpoints (the down-projection activations) are for
    (experimental/moe/bwd/blockwise_mm_backward.py and moe_bwd_parameters.py of
    aws-neuron/nki-library at 092a49d and after).
    """
    shard = bwd_parameters.ShardOption
    if not hasattr(shard, "SHARD_ON_FREE"):
        return {}
    return {
        "shard_option": shard.SHARD_ON_FREE,
        "affinity_option": bwd_parameters.AffinityOption.AFFINITY_ON_H,
    }


def _moe_backward_launcher() -> Callable[..., Any]:
    """`moe_blockwise_bwd`: blockwise_mm_bwd with SiLU, from the forward's activations."""
    import nki
    import nki.language as nl
    from nkilib.experimental.moe.bwd import moe_bwd_parameters
    from nkilib.experimental.moe.bwd.blockwise_mm_backward import blockwise_mm_bwd

    sharding = moe_backward_sharding(moe_bwd_parameters)

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
        compute_dtype,
    ):
        # `sharding` (see moe_backward_sharding) is empty on a library that ignores the options.
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
            compute_dtype=getattr(nl, compute_dtype),
            is_tensor_update_accumulating=is_tensor_update_accumulating,
            activation_type=moe_bwd_parameters.ActFnType.SiLU,
            **sharding,
        )

    return moe_blockwise_bwd
