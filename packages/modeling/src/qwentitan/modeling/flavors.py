"""The Qwen3 flavor table: every model qwentitan trains, in Hugging Face config terms."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from qwentitan.modeling.errors import ModelingError

QWEN_VOCAB_SIZE = 151936  # rows of the Qwen BPE embedding (151,643 tokens + specials, padded)


@dataclass(frozen=True, kw_only=True)
class Flavor:
    """One Qwen3 architecture. Field names are those of transformers' Qwen3Config / Qwen3MoeConfig.

    Dense flavors have ``num_experts == 0``; for them the MoE fields are unused.
    """

    name: str
    hidden_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    intermediate_size: int
    vocab_size: int = QWEN_VOCAB_SIZE
    max_position_embeddings: int = 40960
    rope_theta: float = 1_000_000.0
    rms_norm_eps: float = 1e-6
    tie_word_embeddings: bool = False
    num_experts: int = 0
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0
    norm_topk_prob: bool = True
    hf_repo: str | None = None  # the Hub model this flavor reproduces, for humans; never fetched

    def __post_init__(self) -> None:
        if self.num_attention_heads % self.num_key_value_heads:
            raise ModelingError(
                f"Flavor {self.name!r} has {self.num_attention_heads} attention heads, not a "
                f"multiple of its {self.num_key_value_heads} KV heads; fix the head counts."
            )
        if self.num_experts and not 0 < self.num_experts_per_tok <= self.num_experts:
            raise ModelingError(
                f"Flavor {self.name!r} routes each token to {self.num_experts_per_tok} of "
                f"{self.num_experts} experts; top-k must lie in 1..num_experts."
            )
        if self.num_experts and self.moe_intermediate_size <= 0:
            raise ModelingError(
                f"Flavor {self.name!r} has experts but no moe_intermediate_size; set it."
            )

    @property
    def is_moe(self) -> bool:
        return self.num_experts > 0

    def replace(self, **changes: object) -> Flavor:
        """A copy with some fields changed (e.g. a shorter ``max_position_embeddings``)."""
        return dataclasses.replace(self, **changes)


def _dense(name: str, repo: str, **dims: object) -> Flavor:
    return Flavor(name=name, hf_repo=repo, head_dim=128, num_key_value_heads=8, **dims)


def _moe(name: str, repo: str | None, **dims: object) -> Flavor:
    return Flavor(name=name, hf_repo=repo, head_dim=128, num_key_value_heads=4, **dims)


# Dimensions from each model's config.json on the Hub (Qwen/Qwen3-*), the same numbers
# torchtitan's own qwen3 flavor table uses, with one exception: torchtitan gives 235B-A22B
# rope theta 5e6, the value of the later Qwen3-235B-A22B-*-2507 releases; the Qwen3-235B-A22B
# this flavor names (32K native context, YaRN to 128K) uses 1e6 like every other Qwen3.
# CPU flavor: the real architecture (qk-norm, GQA, tied embeddings) and the real Qwen vocabulary
# so the Qwen BPE tokenizer trains it; tiny-moe is the same with a top-k router and 8 experts.
_TINY_DENSE = Flavor(
    name="tiny-dense",
    hidden_size=64,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=32,
    intermediate_size=192,
    max_position_embeddings=2048,
    tie_word_embeddings=True,
)

_30B_A3B = _moe(
    "qwen3-30b-a3b",
    "Qwen/Qwen3-30B-A3B",
    hidden_size=2048,
    num_hidden_layers=48,
    num_attention_heads=32,
    intermediate_size=6144,
    moe_intermediate_size=768,
    num_experts=128,
    num_experts_per_tok=8,
)

_ALL = (
    _dense(
        "qwen3-0.6b",
        "Qwen/Qwen3-0.6B",
        hidden_size=1024,
        num_hidden_layers=28,
        num_attention_heads=16,
        intermediate_size=3072,
        tie_word_embeddings=True,
    ),
    _dense(
        "qwen3-1.7b",
        "Qwen/Qwen3-1.7B",
        hidden_size=2048,
        num_hidden_layers=28,
        num_attention_heads=16,
        intermediate_size=6144,
        tie_word_embeddings=True,
    ),
    _dense(
        "qwen3-4b",
        "Qwen/Qwen3-4B",
        hidden_size=2560,
        num_hidden_layers=36,
        num_attention_heads=32,
        intermediate_size=9728,
        tie_word_embeddings=True,
    ),
    _dense(
        "qwen3-8b",
        "Qwen/Qwen3-8B",
        hidden_size=4096,
        num_hidden_layers=36,
        num_attention_heads=32,
        intermediate_size=12288,
    ),
    _dense(
        "qwen3-14b",
        "Qwen/Qwen3-14B",
        hidden_size=5120,
        num_hidden_layers=40,
        num_attention_heads=40,
        intermediate_size=17408,
    ),
    _dense(
        "qwen3-32b",
        "Qwen/Qwen3-32B",
        hidden_size=5120,
        num_hidden_layers=64,
        num_attention_heads=64,
        intermediate_size=25600,
    ),
    _30B_A3B,
    _moe(
        "qwen3-235b-a22b",
        "Qwen/Qwen3-235B-A22B",
        hidden_size=4096,
        num_hidden_layers=94,
        num_attention_heads=64,
        intermediate_size=12288,
        moe_intermediate_size=1536,
        num_experts=128,
        num_experts_per_tok=8,
    ),
    # The trn2 recipe's reduced MoE: 30B-A3B's layer shape, 4 layers, half the experts, top-4.
    _30B_A3B.replace(
        name="qwen3-30b-a3b-4l",
        hf_repo=None,
        num_hidden_layers=4,
        num_experts=64,
        num_experts_per_tok=4,
    ),
    # CPU flavors: 40 steps of 2 ranks x 4 x 128 tokens train in under 3 minutes on 2 cores.
    _TINY_DENSE,
    # tiny-dense with its own output head: pipeline parallelism puts the embedding and the head
    # in different stages, so it cannot train a tied model (the mesh pilot's PP 2).
    _TINY_DENSE.replace(name="tiny-dense-untied", tie_word_embeddings=False),
    _TINY_DENSE.replace(
        name="tiny-moe",
        tie_word_embeddings=False,
        num_experts=8,
        num_experts_per_tok=2,
        moe_intermediate_size=64,
    ),
)

FLAVORS: dict[str, Flavor] = {f.name: f for f in _ALL}


def get_flavor(name: str | Flavor) -> Flavor:
    """The flavor called ``name`` (a Flavor passes through unchanged)."""
    if isinstance(name, Flavor):
        return name
    try:
        return FLAVORS[name]
    except KeyError:
        raise ModelingError(
            f"Unknown Qwen3 flavor {name!r}; choose one of: {', '.join(FLAVORS)}."
        ) from None
