"""The `moe-kernels` path: torchtitan Qwen3 modules whose compute runs through qwentitan.kernels.

Three torchtitan modules get a subclass whose forward calls a `qwentitan::` op (NKI on a
`neuron` device, the PyTorch reference twin elsewhere); parameters, buffers and state-dict keys
stay torchtitan's, so checkpoints and the HF adapter are unchanged. `apply_kernel_replacements`
swaps them into a Qwen3 model config by module path before the model is built.

Which modules are swapped, and whether each runs its NKI kernel or falls back to the reference
twin on neuron (`use_nki` of each Config), follows `qwentitan.kernels.KernelChoices`: by default
RoPE and the experts use NKI and attention stays torchtitan's (TorchNeuron already runs SDPA on
NKI flash kernels); `QWENTITAN_KERNELS=experts=reference` switches one kernel to its twin.

Semantics that differ from torchtitan's defaults, because the NKI kernels work this way:
- the kernel attention is causal over the whole row (attention_cte has no document mask), as
  torchtitan's SDPA is; RoPE follows torchtitan's per-document `positions` (restarting at each
  packed document) by handing rope_hf, which reads its table from row 0 on, one table per
  sample gathered at its positions ([batch, seq, 2 * head_dim], one launch for the batch);
- expert weights are re-laid out each forward into the kernel's (experts, hidden, 2, inter) and
  (experts, inter, hidden) forms; the experts compute in the input's dtype, which is passed to
  moe_cte and blockwise_mm_bwd as their `compute_dtype` (both default to bfloat16). torchtitan's
  GroupedExperts always casts to bfloat16; `compute_dtype=torch.bfloat16` reproduces that.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

import torch
from torch.distributed.tensor import DTensor
from torchtitan.models.common.attention import ScaledDotProductAttention
from torchtitan.models.common.moe import GroupedExperts
from torchtitan.models.common.rope import CosSinRoPE

# Registers the qwentitan:: ops. qwentitan-kernels is the `kernels` extra: `model_spec` refuses
# the moe-kernels path in one sentence before importing this module when it is missing.
import qwentitan.kernels as kernels


def _fields(config: Any) -> dict[str, Any]:
    return {f.name: getattr(config, f.name) for f in dataclasses.fields(config) if f.init}


class KernelRoPE(CosSinRoPE):
    """torchtitan's cos/sin RoPE applied by `qwentitan::rope` (nkilib rope_hf on neuron)."""

    @dataclasses.dataclass(kw_only=True, slots=True)
    class Config(CosSinRoPE.Config):
        use_nki: bool = True  # False: the reference twin also on neuron (fallback switch)

    def __init__(self, config: Config):
        super().__init__(config)
        self.use_nki = config.use_nki

    def forward(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        positions: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        if positions is None:
            return torch.ops.qwentitan.rope(query, key, self.cache, self.use_nki)
        # torchtitan's loaders restart positions at every packed document, and its RoPE
        # gathers the cache at them. rope_hf reads its table from row 0 on (gather-free) and
        # takes one table per sample, so the batch gets its gathered tables in one launch.
        if isinstance(positions, DTensor):
            positions = positions.to_local()
        rows = positions.expand(query.shape[0], -1) if positions.dim() == 1 else positions
        return torch.ops.qwentitan.rope(query, key, self.cache[rows], self.use_nki)


class KernelCausalAttention(ScaledDotProductAttention):
    """Causal GQA by `qwentitan::causal_attention` (nkilib attention_cte/attention_bwd on neuron)."""

    @dataclasses.dataclass(kw_only=True, slots=True)
    class Config(ScaledDotProductAttention.Config):
        use_nki: bool = True  # False: the reference twin also on neuron (fallback switch)

    def __init__(self, config: Config):
        super().__init__(config)
        self.use_nki = config.use_nki

    def forward(
        self,
        q_BLNH: torch.Tensor,
        k_BLNH: torch.Tensor,
        v_BLNH: torch.Tensor,
        *,
        attention_masks: Any = None,
        scale: float | None = None,
        enable_gqa: bool = False,
        is_causal: bool = True,
        **kwargs: Any,
    ) -> torch.Tensor:
        if attention_masks is not None or not is_causal:
            raise kernels.KernelError(
                "the kernel attention is causal over the whole sequence and takes no attention "
                "masks; build the model with apply_kernel_replacements and call it without masks."
            )
        scale = q_BLNH.shape[-1] ** -0.5 if scale is None else scale
        return torch.ops.qwentitan.causal_attention(q_BLNH, k_BLNH, v_BLNH, scale, self.use_nki)[0]


class KernelGroupedExperts(GroupedExperts):
    """torchtitan's SwiGLU experts computed by `qwentitan::grouped_experts` in padded blocks.

    Rows arrive sorted by expert from torchtitan's token dispatcher, which also applies the
    routing scores when it combines; so every row has affinity 1 for its own expert here.
    """

    @dataclasses.dataclass(kw_only=True, slots=True)
    class Config(GroupedExperts.Config):
        block_size: int = 256  # moe_cte needs a multiple of 256; blockwise_mm_bwd <= 1024
        # None: the input's dtype, as the NKI kernel computes. torchtitan's GroupedExperts always
        # casts to bfloat16 (a CUDA grouped_mm limit); set torch.bfloat16 to reproduce that.
        compute_dtype: torch.dtype | None = None
        use_nki: bool = True  # False: the reference twin also on neuron (fallback switch)

    def __init__(self, config: Config):
        super().__init__(config)
        self.block_size = config.block_size
        self.compute_dtype = config.compute_dtype
        self.use_nki = config.use_nki

    def forward(self, x_RD: torch.Tensor, num_tokens_per_expert_E: torch.Tensor) -> torch.Tensor:
        w1, w2, w3 = (
            w.to_local() if isinstance(w, DTensor) else w
            for w in (self.w1_EFD, self.w2_EDF, self.w3_EFD)
        )
        dtype = self.compute_dtype or x_RD.dtype
        rows = x_RD.shape[0]
        # Under EP this rank holds a slice of the experts (the Config counts them all), and the
        # dispatcher gives one token count per local expert.
        num_experts = w1.shape[0]
        expert_of_row = torch.repeat_interleave(
            torch.arange(num_experts, device=x_RD.device),
            num_tokens_per_expert_E.to(x_RD.device),
            output_size=rows,
        )
        token_position_to_id, block_to_expert = kernels.block_routing(
            expert_of_row, num_experts, self.block_size
        )
        affinities = torch.zeros(rows, num_experts, dtype=dtype, device=x_RD.device)
        affinities = affinities.scatter(1, expert_of_row[:, None], 1.0)
        gate_up = torch.stack([w1.transpose(1, 2), w3.transpose(1, 2)], dim=2).to(dtype)
        down = w2.transpose(1, 2).to(dtype)
        out = kernels.grouped_experts(
            x_RD.to(dtype),
            affinities,
            gate_up,
            down,
            token_position_to_id,
            block_to_expert,
            self.block_size,
            use_nki=self.use_nki,
        )
        return out.type_as(x_RD)


def _replace_rope(config: Any, use_nki: bool = True) -> KernelRoPE.Config:
    if not isinstance(config, CosSinRoPE.Config):
        raise kernels.KernelError(
            f"the kernel rope replaces cos/sin RoPE (rotate-half, as Qwen3 uses), got "
            f"{type(config).__qualname__}; point the rule at a CosSinRoPE config."
        )
    return KernelRoPE.Config(**_fields(config), use_nki=use_nki)


def _replace_attention(config: Any, use_nki: bool = True) -> KernelCausalAttention.Config:
    return KernelCausalAttention.Config(
        param_init=config.param_init, sharding_config=config.sharding_config, use_nki=use_nki
    )


def _replace_experts(
    config: Any, block_size: int = 256, use_nki: bool = True
) -> KernelGroupedExperts.Config:
    if not isinstance(config, GroupedExperts.Config):
        raise kernels.KernelError(
            f"the kernel experts replace GroupedExperts, got {type(config).__qualname__}; "
            "point the rule at moe.routed_experts.inner_experts."
        )
    return KernelGroupedExperts.Config(**_fields(config), block_size=block_size, use_nki=use_nki)


_OPS = {"rope": "rope", "attention": "causal_attention", "experts": "grouped_experts"}
_PATTERNS = {
    "rope": "layers.*.attention.rope",
    "attention": "layers.*.attention.inner_attention",
    "experts": "layers.*.moe.routed_experts.inner_experts",
}


def default_rules(block_size: int = 256, choices: Any = None) -> list:
    """The replacements of the moe-kernels path for every layer, as `choices` asks.

    `choices` is a `qwentitan.kernels.KernelChoices`; None reads it from QWENTITAN_KERNELS
    (defaults: NKI RoPE and experts, torchtitan's attention). A kernel chosen `reference` is
    still replaced, with `use_nki=False`; each replaced module is logged as
    `nki_<kernel>  <path>` or `reference_<kernel>  <path>`.
    """
    choices = kernels.KernelChoices.from_env() if choices is None else choices
    replace = {
        "rope": _replace_rope,
        "attention": _replace_attention,
        "experts": lambda config, use_nki: _replace_experts(config, block_size, use_nki),
    }
    rules = []
    for kernel, choice in choices.items():
        if choice == "torchtitan":
            continue
        use_nki = choice == "nki"
        rules.append(
            kernels.ReplacementRule(
                _PATTERNS[kernel],
                lambda config, fn=replace[kernel], use_nki=use_nki: fn(config, use_nki),
                f"{choice}_{kernel}",
                op=_OPS[kernel],
                use_nki=use_nki,
            )
        )
    return rules


_KERNEL_OF_CONFIG = {
    KernelRoPE.Config: "rope",
    KernelCausalAttention.Config: "attention",
    KernelGroupedExperts.Config: "experts",
}


def rules_in(model_config: Any) -> list:
    """The rules a model config was built with, read back from the kernel modules it holds.

    One rule per kernel found, as `default_rules` makes it (NKI if any of its modules runs the
    NKI kernel, else the reference twin), so `qwentitan.kernels.check_kernels(rules_in(config))`
    launches the ops this model runs by the route it runs them. Empty without kernel modules.
    """
    found: dict[str, bool] = {}
    seen: set[int] = set()
    todo = [model_config]
    while todo:
        node = todo.pop()
        if id(node) in seen:
            continue
        seen.add(id(node))
        kernel = _KERNEL_OF_CONFIG.get(type(node))
        if kernel is not None:
            found[kernel] = found.get(kernel, False) or node.use_nki
        if dataclasses.is_dataclass(node) and not isinstance(node, type):
            todo += [getattr(node, f.name, None) for f in dataclasses.fields(node)]
        elif isinstance(node, (list, tuple)):
            todo += node
        elif isinstance(node, dict):
            todo += node.values()
    if not found:
        return []
    choices = {kernel: "torchtitan" for kernel in _PATTERNS}
    choices.update({kernel: "nki" if nki else "reference" for kernel, nki in found.items()})
    return default_rules(choices=kernels.KernelChoices(**choices))


def apply_kernel_replacements(model_config: Any, rules: Sequence | None = None) -> Any:
    """A new torchtitan Qwen3 model config with the kernel modules swapped in (input untouched).

    `rules` defaults to `default_rules()`, which follows QWENTITAN_KERNELS. Logs one line per
    replaced module; a rule that matches nothing raises.
    """
    return kernels.apply_replacements(model_config, default_rules() if rules is None else rules)
