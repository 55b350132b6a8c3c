"""The `native` path: torchtitan's own Qwen3 model config, sized by a flavor."""

from __future__ import annotations

import dataclasses
from typing import Any

from torchtitan.models.common import CosSinRoPE, Embedding, Linear
from torchtitan.models.common.attention import ScaledDotProductAttention
from torchtitan.models.common.config_utils import get_attention_config

# torchtitan 0.3.0 keeps its per-layer builders and init tables private to its flavor table;
# reusing them (rather than re-deriving the layer configs) keeps our native model exactly
# torchtitan's. torchtitan is pinned (==0.3.0), so these names cannot move under us.
from torchtitan.models.qwen3 import (  # type: ignore[attr-defined]
    _EMBEDDING_INIT,
    _EMBEDDING_SKIP_INIT,
    _LINEAR_INIT,
    _build_qwen3_layers,
    _build_qwen3_moe_layers,
    _qwen3_norm,
)
from torchtitan.models.qwen3.model import Qwen3Model

from qwentitan.modeling.errors import ModelingError
from qwentitan.modeling.flavors import Flavor, get_flavor

ATTN_BACKENDS = ("sdpa", "flex", "varlen")


def _inner_attention(attn_backend: str):
    # torchtitan's get_attention_config refuses "sdpa" for language models because SDPA cannot
    # mask packed documents. We still need it: FlexAttention has no CPU backward. SDPA runs
    # plain causal attention over the whole sequence, which the trainer supports (it builds
    # masks only for flex/varlen).
    if attn_backend == "sdpa":
        return ScaledDotProductAttention.Config()
    if attn_backend in ATTN_BACKENDS:
        return get_attention_config(attn_backend)
    raise ModelingError(
        f"Unknown attention backend {attn_backend!r}; choose one of: {', '.join(ATTN_BACKENDS)}."
    )


def _fit_layer(layer: Any, f: Flavor, inner_attention: Any, *, float32_experts: bool) -> None:
    """One layer of torchtitan's Qwen3 builder as ``f`` has it: attention, norms, routing."""
    layer.attention.inner_attention = inner_attention
    for norm in (layer.attention_norm, layer.ffn_norm, layer.attention.qk_norm):
        norm.eps = f.rms_norm_eps
    if layer.moe is None:
        return
    layer.moe.router.route_norm = f.norm_topk_prob
    # Qwen3 routes by softmax top-k alone. torchtitan's default aux-loss-free balancing adds a
    # learned expert_bias to the routing scores, which Hugging Face checkpoints cannot carry:
    # an exported model would route differently from the trained one.
    layer.moe.load_balance_coeff = None
    if float32_experts:
        # The one float32 GroupedExperts: the checkpoint package's logit check uses it too,
        # and it cannot import this package (the arrow points the other way).
        from qwentitan.checkpoint.logits import float32_grouped_experts

        inner = layer.moe.routed_experts.inner_experts
        layer.moe.routed_experts.inner_experts = float32_grouped_experts().Config(
            **{k.name: getattr(inner, k.name) for k in dataclasses.fields(inner) if k.init}
        )


def native_model_config(
    flavor: str | Flavor, attn_backend: str = "sdpa", *, float32_experts: bool = False
) -> Qwen3Model.Config:
    """torchtitan's ``Qwen3Model.Config`` with the dimensions of ``flavor``.

    ``float32_experts``: the MoE experts compute in float32 instead of torchtitan 0.3.0's
    bfloat16 grouped matmuls (``GroupedExperts.forward`` casts every operand down). Nothing is
    gained from bfloat16 on a CPU, and in float32 two implementations can be compared tightly.
    """
    f = get_flavor(flavor)
    inner_attention = _inner_attention(attn_backend)
    rope = CosSinRoPE.Config(
        dim=f.head_dim, max_seq_len=f.max_position_embeddings, theta=f.rope_theta
    )
    shape = dict(
        fuse_qkv=True,
        n_layers=f.num_hidden_layers,
        dim=f.hidden_size,
        n_heads=f.num_attention_heads,
        n_kv_heads=f.num_key_value_heads,
        head_dim=f.head_dim,
        attn_backend="flex",  # replaced by inner_attention below
        rope=rope,
    )
    if f.is_moe:
        layers = _build_qwen3_moe_layers(
            **shape,
            moe_hidden_dim=f.moe_intermediate_size,
            num_experts=f.num_experts,
            top_k=f.num_experts_per_tok,
            moe_comm_backend="standard",
        )
    else:
        layers = _build_qwen3_layers(**shape, hidden_dim=f.intermediate_size)

    for layer in layers:
        _fit_layer(layer, f, inner_attention, float32_experts=float32_experts)

    norm = _qwen3_norm(f.hidden_size)
    norm.eps = f.rms_norm_eps
    return Qwen3Model.Config(
        vocab_size=f.vocab_size,
        dim=f.hidden_size,
        norm=norm,
        enable_weight_tying=f.tie_word_embeddings,
        tok_embeddings=Embedding.Config(
            num_embeddings=f.vocab_size,
            embedding_dim=f.hidden_size,
            # tied: the embedding is the lm_head weight, initialised once through lm_head
            param_init=_EMBEDDING_SKIP_INIT if f.tie_word_embeddings else _EMBEDDING_INIT,
        ),
        lm_head=Linear.Config(
            in_features=f.hidden_size, out_features=f.vocab_size, param_init=_LINEAR_INIT
        ),
        layers=layers,
    )
