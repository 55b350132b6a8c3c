"""The `hf` path: transformers v5's own Qwen3 model, wrapped so torchtitan's Trainer, FSDP2
and checkpointer drive it, with weights from a model folder when one is given.

torchtitan's experimental transformers backend reads its config from the Hub, patches
transformers' init, and never loads weights; this wrapper is built from a Flavor, needs no
network, and loads the folder's safetensors in ``init_states`` (the step torchtitan runs right
after materialising the meta-device model), so it works under FSDP too.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
from torch.distributed.tensor import DTensor
from torch.distributed.tensor._utils import compute_local_shape_and_global_offset
from torchtitan.config import TORCH_DTYPE_MAP
from torchtitan.distributed.compile import apply_compile
from torchtitan.distributed.fsdp import disable_fsdp_gradient_division
from torchtitan.protocols.model import BaseModel
from torchtitan.protocols.model_spec import ModelSpec
from torchtitan.protocols.state_dict_adapter import StateDictAdapter
from transformers import AutoModelForCausalLM

from qwentitan.checkpoint import HFFolder
from qwentitan.modeling.counts import flops_per_token
from qwentitan.modeling.errors import ModelingError
from qwentitan.modeling.flavors import Flavor
from qwentitan.modeling.hf_config import flavor_to_hf_config
from qwentitan.modeling.hf_weights import (
    hub_to_memory,
    memory_keys,
    memory_to_hub,
    open_hub_folder,
    read_memory_tensor,
)

_ATTN_IMPLEMENTATIONS = {"sdpa": "sdpa", "flex": "flex_attention"}
_PREFIX = "model."  # HFQwen3Model keeps the transformers model as its child `model`


class HFQwen3Model(BaseModel):
    """``AutoModelForCausalLM`` for a flavor, behind torchtitan's model protocol.

    ``forward(tokens, positions=None)`` returns logits [B, L, vocab] like torchtitan's decoders;
    ``layers`` is the transformers decoder-layer list so torchtitan's activation checkpointing
    and per-block compile find it.
    """

    @dataclass(kw_only=True, slots=True)
    class Config(BaseModel.Config):
        flavor: Flavor
        hf_folder: str | None = None
        attn_implementation: str = "sdpa"

        def update_from_config(self, *, config: Any, **kwargs: Any) -> None:
            parallelism = config.parallelism
            unsupported = {
                "tensor_parallel_degree": parallelism.tensor_parallel_degree,
                "pipeline_parallel_degree": parallelism.pipeline_parallel_degree,
                "context_parallel_degree": parallelism.context_parallel_degree,
                "expert_parallel_degree": parallelism.expert_parallel_degree,
            }
            if bad := [f"{k}={v}" for k, v in unsupported.items() if v > 1]:
                raise ModelingError(
                    f"The hf path shards with FSDP only, but the job asks for {', '.join(bad)}; "
                    "set them to 1 or use path 'native'."
                )
            if parallelism.spmd_backend != "partial_dtensor":
                # spmd_types (torchtitan 0.3.0's default) and full_dtensor need every parameter
                # as a DTensor on the full mesh, placed by torchtitan's own Module sharding
                # configs, which a Transformers model does not have
                raise ModelingError(
                    f"The hf path trains under parallelism.spmd_backend 'partial_dtensor', not "
                    f"{parallelism.spmd_backend!r}; set it in the job's ParallelismConfig."
                )
            training = getattr(config, "training", None)
            if training is not None and training.seq_len > self.flavor.max_position_embeddings:
                raise ModelingError(
                    f"training.seq_len {training.seq_len} exceeds flavor {self.flavor.name!r}'s "
                    f"{self.flavor.max_position_embeddings} positions; shorten seq_len."
                )

        def get_nparams_and_flops(self, model: nn.Module, seq_len: int) -> tuple[int, int]:
            nparams = sum(p.numel() for p in model.parameters())
            return nparams, int(flops_per_token(self.flavor, seq_len))

    # Set by torchtitan's trainer when a chunked loss applies lm_head itself.
    _skip_lm_head: bool = False

    def __init__(self, config: Config):
        super().__init__()
        self.config = config
        hf_config = flavor_to_hf_config(config.flavor)
        hf_config._attn_implementation = config.attn_implementation
        self.model = AutoModelForCausalLM.from_config(hf_config, dtype=torch.get_default_dtype())

    @property
    def layers(self) -> nn.ModuleList:
        return self.model.model.layers

    @property
    def lm_head(self) -> nn.Linear:
        return self.model.lm_head

    def verify_module_protocol(self) -> None:
        # transformers' submodules are plain nn.Modules; their init is transformers' own.
        pass

    def forward(
        self,
        tokens: torch.Tensor,
        positions: torch.Tensor | None = None,
        attention_masks: Any = None,
    ) -> torch.Tensor:
        if attention_masks is not None:
            raise ModelingError(
                "The hf path builds its own causal mask; use attn_backend 'sdpa' or 'flex' "
                "without trainer-built attention masks."
            )
        # No KV cache: built on every step, it adds ops that selective AC's recomputation
        # does not find. The all-ones mask keeps plain causal attention over the window, as
        # torchtitan's SDPA; without one, transformers would mask each packed document found
        # in the restarting positions.
        hidden = self.model.model(
            input_ids=tokens,
            position_ids=positions,
            attention_mask=torch.ones_like(tokens),
            use_cache=False,
        ).last_hidden_state
        return hidden if self._skip_lm_head else self.model.lm_head(hidden)

    def init_states(self, *, buffer_device: torch.device | None = None) -> None:
        """transformers' own init (weights, RoPE inv_freq, tying), then the folder's weights."""
        with torch.no_grad():
            self.model.init_weights()
            if self.config.hf_folder is not None:
                self.load_hub_folder(open_hub_folder(self.config.hf_folder))

    def load_hub_folder(self, hub: HFFolder) -> None:
        """Copy a Hub-layout checkpoint into this model, exactly: every key, every shape, or an
        error. Plain parameters are read whole; FSDP-sharded (DTensor) ones read only this
        rank's shard, so no rank ever holds the whole checkpoint."""
        flavor = self.config.flavor
        params = dict(self.model.named_parameters())  # tied weights appear once
        found = memory_keys(hub.tensors, flavor)
        missing, unexpected = sorted(params.keys() - found), sorted(found - params.keys())
        if missing or unexpected:
            raise ModelingError(
                f"The checkpoint in {hub.path} does not fit flavor {flavor.name!r}: missing "
                f"{missing[:5]}, unexpected {unexpected[:5]}; pass the flavor it was saved from."
            )
        with torch.no_grad():
            for name, param in params.items():
                self._check_shape(hub, name, tuple(param.shape))
                if isinstance(param, DTensor):
                    shape, offset = compute_local_shape_and_global_offset(
                        param.shape, param.device_mesh, param.placements
                    )
                    target = param.to_local()
                else:
                    shape, offset, target = tuple(param.shape), (0,) * param.dim(), param
                region = tuple(slice(o, o + n) for o, n in zip(offset, shape, strict=True))
                target.copy_(read_memory_tensor(hub, name, flavor, region, tuple(shape)))

    def _check_shape(self, hub: HFFolder, name: str, expected: tuple[int, ...]) -> None:
        f = self.config.flavor
        if name.endswith("mlp.experts.gate_up_proj"):
            gate = hub.shape(name.removesuffix("gate_up_proj") + "0.gate_proj.weight")
            actual = (f.num_experts, 2 * gate[0], gate[1])
        elif name.endswith("mlp.experts.down_proj"):
            actual = (
                f.num_experts,
                *hub.shape(name.removesuffix("down_proj") + "0.down_proj.weight"),
            )
        else:
            actual = hub.shape(name)
        if actual != expected:
            raise ModelingError(
                f"Tensor {name} has shape {actual} in {hub.path} but {expected} in flavor "
                f"{f.name!r}; pass the flavor the folder was saved from."
            )

    def hub_state_dict(self) -> dict[str, torch.Tensor]:
        """This model's weights in the Hub layout (per-expert tensors, tied head omitted)."""
        return memory_to_hub(self.model.state_dict(), self.config.flavor)


class HFQwen3StateDictAdapter(StateDictAdapter):
    """torchtitan's HF conversion hook for the hf path: wrapper keys <-> Hub keys and layout.

    Used by torchtitan's checkpointer for ``initial_load_in_hf`` and ``last_save_in_hf``.
    """

    def __init__(self, model_config: HFQwen3Model.Config, hf_assets_path: str | None):
        super().__init__(model_config, hf_assets_path)
        self.flavor = model_config.flavor

    def to_hf(self, state_dict: dict[str, Any]) -> dict[str, Any]:
        unprefixed = {k.removeprefix(_PREFIX): v for k, v in state_dict.items()}
        return memory_to_hub(unprefixed, self.flavor)

    def from_hf(self, hf_state_dict: dict[str, Any]) -> dict[str, Any]:
        memory = hub_to_memory(hf_state_dict, self.flavor)
        if self.flavor.tie_word_embeddings:
            # the wrapper's state_dict lists the tied head under both names
            memory["lm_head.weight"] = memory["model.embed_tokens.weight"]
        return {_PREFIX + k: v for k, v in memory.items()}


def parallelize_hf_qwen3(
    model: HFQwen3Model,
    *,
    parallel_dims: Any,
    training: Any,
    parallelism: Any,
    compile_config: Any,
    ac_config: Any,
    dump_folder: str,
    skip_dp: bool = False,
) -> HFQwen3Model:
    """Activation checkpointing, per-layer compile and FSDP2 for the hf path (the same order
    torchtitan's parallelize_qwen3 uses). TP / PP / CP / EP are refused in update_from_config."""
    if ac_config is not None:
        ac_config.build(dump_folder=dump_folder).apply(model)
    if compile_config.enable and "model" in compile_config.components:
        apply_compile(model, compile_config=compile_config, parallel_dims=parallel_dims)
    if skip_dp or not (parallel_dims.fsdp_enabled or parallel_dims.dp_replicate_enabled):
        return model
    mp_policy = MixedPrecisionPolicy(
        param_dtype=TORCH_DTYPE_MAP[training.mixed_precision_param],
        reduce_dtype=TORCH_DTYPE_MAP[training.mixed_precision_reduce],
    )
    # partial_dtensor (update_from_config asks for it) keeps the flattened "fsdp" mesh, as in
    # torchtitan's parallelize_qwen3 for that backend
    names = ["dp_replicate", "fsdp"] if parallel_dims.dp_replicate_enabled else ["fsdp"]
    mesh = parallel_dims.get_mesh(names)
    for layer in model.layers:
        fully_shard(layer, mesh=mesh, mp_policy=mp_policy)
    # the root group holds embeddings, final norm and head (tied ones together)
    fully_shard(model, mesh=mesh, mp_policy=mp_policy, reshard_after_forward=False)
    # torchtitan's trainer already divides the loss by the global token count; FSDP's own
    # division by the world size on top would shrink every gradient by it (torchtitan's
    # parallelize functions turn it off the same way).
    disable_fsdp_gradient_division(model)
    return model


def hf_model_spec(flavor: Flavor, *, hf_folder: str | Path | None, attn_backend: str) -> ModelSpec:
    if attn_backend not in _ATTN_IMPLEMENTATIONS:
        raise ModelingError(
            f"The hf path runs attention backends {', '.join(_ATTN_IMPLEMENTATIONS)}, not "
            f"{attn_backend!r}; pick one of those."
        )
    config = HFQwen3Model.Config(
        flavor=flavor,
        hf_folder=None if hf_folder is None else str(hf_folder),
        attn_implementation=_ATTN_IMPLEMENTATIONS[attn_backend],
    )
    return ModelSpec(
        name="qwen3-hf",
        flavor=flavor.name,
        model=config,
        parallelize_fn=parallelize_hf_qwen3,
        pipelining_fn=None,
        # transformers' Qwen3-MoE has no expert-bias balancing to update (and torchtitan's hook
        # asserts its own ModuleDict of layers)
        post_optimizer_build_fn=None,
        state_dict_adapter=HFQwen3StateDictAdapter,
    )
