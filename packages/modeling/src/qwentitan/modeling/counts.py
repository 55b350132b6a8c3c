"""Parameter and FLOP counts of a flavor, computed from its dimensions: the one formula used
everywhere (MFU in tracking, the README table, the launch plan)."""

from __future__ import annotations

from dataclasses import dataclass

from qwentitan.modeling.errors import ModelingError
from qwentitan.modeling.flavors import Flavor, get_flavor


@dataclass(frozen=True, slots=True)
class ParamCounts:
    """Parameter counts as the Qwen3 model cards define them.

    ``embedding``: the input embedding plus, when untied, the output head (the cards'
    "non-embedding" figure excludes both). ``active``: the cards' "activated" parameters of one
    token: everything except the experts it is not routed to and except the router gates
    (``router``), which the cards leave out: with them 30B-A3B activates 3.353B, which the card
    would print as 3.4B, not its 3.3B. FLOPs do count the router (see ``flops_per_token``).
    """

    total: int
    embedding: int
    non_embedding: int
    active: int
    active_non_embedding: int
    router: int


def _attention_params(f: Flavor) -> int:
    q_out = f.num_attention_heads * f.head_dim
    kv_out = f.num_key_value_heads * f.head_dim
    # q, k, v, o projections (no biases in Qwen3) + per-head q_norm and k_norm weights
    return f.hidden_size * (2 * q_out + 2 * kv_out) + 2 * f.head_dim


def param_counts(flavor: str | Flavor) -> ParamCounts:
    """Exact parameter counts of ``flavor`` (``total`` equals ``sum(p.numel())`` of the model)."""
    f = get_flavor(flavor)
    per_layer = _attention_params(f) + 2 * f.hidden_size  # + the two RMSNorms
    router = 0
    if f.is_moe:
        router = f.num_hidden_layers * f.hidden_size * f.num_experts
        expert = 3 * f.hidden_size * f.moe_intermediate_size  # gate, up, down
        all_experts = f.num_hidden_layers * (per_layer + f.num_experts * expert)
        routed_experts = f.num_hidden_layers * (per_layer + f.num_experts_per_tok * expert)
    else:
        all_experts = routed_experts = f.num_hidden_layers * (
            per_layer + 3 * f.hidden_size * f.intermediate_size
        )
    final_norm = f.hidden_size
    non_embedding = all_experts + router + final_norm
    active_non_embedding = routed_experts + final_norm
    embedding = f.vocab_size * f.hidden_size * (1 if f.tie_word_embeddings else 2)
    return ParamCounts(
        total=non_embedding + embedding,
        embedding=embedding,
        non_embedding=non_embedding,
        active=active_non_embedding + embedding,
        active_non_embedding=active_non_embedding,
        router=router,
    )


def flops_per_token(flavor: str | Flavor, seq_len: int) -> float:
    """Training FLOPs per token (forward + backward) at ``seq_len``.

    6 x the parameters that multiply this token's activations (active non-embedding, router
    gates, and the output head, a matmul even when tied; the input embedding is a lookup),
    plus attention's score and value matmuls, 12 x layers x heads x head_dim x seq_len.
    This is exactly torchtitan's Qwen3 ``get_nparams_and_flops`` (no causal halving), so MFU
    computed from it agrees with torchtitan's own logged figures.
    """
    if seq_len <= 0:
        raise ModelingError(f"flops_per_token needs a positive seq_len, got {seq_len}.")
    f = get_flavor(flavor)
    counts = param_counts(f)
    matmul_params = counts.active_non_embedding + counts.router + f.vocab_size * f.hidden_size
    attention = 12 * f.num_hidden_layers * f.num_attention_heads * f.head_dim * seq_len
    return float(6 * matmul_params + attention)
