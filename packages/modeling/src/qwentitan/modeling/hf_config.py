"""Flavor <-> Hugging Face config (Qwen3Config / Qwen3MoeConfig, or a model folder's config.json)."""

from __future__ import annotations

import dataclasses
import sys
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

from qwentitan.checkpoint import CheckpointError, Qwen3Layout, read_config
from qwentitan.modeling.errors import ModelingError
from qwentitan.modeling.flavors import FLAVORS, Flavor, get_flavor

if TYPE_CHECKING:
    from transformers import PretrainedConfig

_ARCHITECTURES = {"qwen3": "Qwen3ForCausalLM", "qwen3_moe": "Qwen3MoeForCausalLM"}


def flavor_to_hf_config(flavor: str | Flavor) -> PretrainedConfig:
    """The transformers config that builds ``flavor`` (Qwen3Config, or Qwen3MoeConfig for MoE)."""
    # Imported here: transformers costs every process that imports this package ~0.8 s, and
    # the native paths' ranks and the launcher's plan never build a transformers config.
    from transformers import Qwen3Config, Qwen3MoeConfig

    f = get_flavor(flavor)
    common: dict[str, Any] = dict(
        vocab_size=f.vocab_size,
        hidden_size=f.hidden_size,
        intermediate_size=f.intermediate_size,
        num_hidden_layers=f.num_hidden_layers,
        num_attention_heads=f.num_attention_heads,
        num_key_value_heads=f.num_key_value_heads,
        head_dim=f.head_dim,
        max_position_embeddings=f.max_position_embeddings,
        rms_norm_eps=f.rms_norm_eps,
        rope_parameters={"rope_type": "default", "rope_theta": f.rope_theta},
        tie_word_embeddings=f.tie_word_embeddings,
        hidden_act="silu",
        attention_bias=False,
    )
    if f.is_moe:
        config: PretrainedConfig = Qwen3MoeConfig(
            **common,
            num_experts=f.num_experts,
            num_experts_per_tok=f.num_experts_per_tok,
            moe_intermediate_size=f.moe_intermediate_size,
            norm_topk_prob=f.norm_topk_prob,
            decoder_sparse_step=1,
            mlp_only_layers=[],
        )
    else:
        config = Qwen3Config(**common)
    config.architectures = [_ARCHITECTURES[config.model_type]]
    return config


def _read_config_dict(source: PretrainedConfig | Mapping[str, Any] | str | Path) -> dict[str, Any]:
    transformers = sys.modules.get("transformers")  # not loaded: source is no PretrainedConfig
    if transformers is not None and isinstance(source, transformers.PretrainedConfig):
        return source.to_dict()
    if isinstance(source, Mapping):
        return dict(source)
    try:
        config, _ = read_config(source)  # the workspace's one config.json parser
    except CheckpointError as error:
        raise ModelingError(str(error)) from None
    return config


def _integer(cfg: Mapping[str, Any], key: str, where: str) -> int:
    if not isinstance(cfg.get(key), int):
        raise ModelingError(
            f"{where} lacks the integer field {key!r}; pass the complete config.json that came "
            "with the weights."
        )
    return cfg[key]


def _rope_theta(cfg: Mapping[str, Any], where: str) -> float:
    # transformers v5 writes rope_parameters; Hub files written by v4 carry rope_theta/rope_scaling.
    params = cfg.get("rope_parameters") or {}
    scaling = cfg.get("rope_scaling") or {}
    rope_type = (
        params.get("rope_type") or scaling.get("rope_type") or scaling.get("type") or "default"
    )
    if rope_type != "default":
        raise ModelingError(
            f"{where} uses RoPE scaling {rope_type!r}, which qwentitan's Qwen3 paths do not "
            "implement; remove rope_scaling to train at the native context length."
        )
    return float(params.get("rope_theta", cfg.get("rope_theta", 10000.0)))


def flavor_from_hf_config(
    source: PretrainedConfig | Mapping[str, Any] | str | Path, *, name: str | None = None
) -> Flavor:
    """The flavor described by a transformers config, a config dict, or a model folder.

    When the dimensions equal a flavor of the table, that flavor is returned (with its name);
    otherwise a new Flavor named ``name`` (default: ``"custom"``).
    """
    cfg = _read_config_dict(source)
    where = f"config {str(source)!r}" if isinstance(source, (str, Path)) else "this config"
    model_type = cfg.get("model_type")
    if model_type not in _ARCHITECTURES:
        archs = cfg.get("architectures") or [model_type]
        raise ModelingError(
            f"{where} describes {', '.join(map(str, archs))} (model_type {model_type!r}); "
            f"qwentitan.modeling supports only {' and '.join(_ARCHITECTURES.values())}."
        )
    unsupported = {
        "attention_bias": bool(cfg.get("attention_bias", False)),
        "use_sliding_window": bool(cfg.get("use_sliding_window", False)),
        "mlp_only_layers": bool(cfg.get("mlp_only_layers")),
        "decoder_sparse_step": cfg.get("decoder_sparse_step", 1) != 1,
        "hidden_act": cfg.get("hidden_act", "silu") != "silu",
    }
    if bad := [k for k, v in unsupported.items() if v]:
        raise ModelingError(
            f"{where} sets {', '.join(bad)} to a value the Qwen3 flavors do not use; "
            "only standard Qwen3 / Qwen3-MoE configs are supported."
        )
    try:
        # the dimensions as qwentitan.checkpoint reads them for conversion, so both agree
        layout = Qwen3Layout.from_config(cfg, where)
    except CheckpointError as error:
        raise ModelingError(str(error)) from None
    fields: dict[str, Any] = dict(
        hidden_size=layout.hidden_size,
        num_hidden_layers=layout.num_layers,
        num_attention_heads=layout.num_heads,
        num_key_value_heads=layout.num_kv_heads,
        head_dim=layout.head_dim,
        intermediate_size=layout.intermediate_size,
        vocab_size=layout.vocab_size,
        max_position_embeddings=_integer(cfg, "max_position_embeddings", where),
        rope_theta=_rope_theta(cfg, where),
        rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
        tie_word_embeddings=layout.tie_word_embeddings,
    )
    if model_type == "qwen3_moe":
        fields.update(
            num_experts=layout.num_experts,
            num_experts_per_tok=_integer(cfg, "num_experts_per_tok", where),
            moe_intermediate_size=layout.moe_intermediate_size,
            norm_topk_prob=bool(cfg.get("norm_topk_prob", False)),
        )
    for known in FLAVORS.values():
        if all(getattr(known, k) == v for k, v in fields.items()) and (
            known.is_moe == (model_type == "qwen3_moe")
        ):
            return known if name is None else dataclasses.replace(known, name=name)
    return Flavor(name=name or "custom", **fields)
