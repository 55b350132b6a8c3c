"""Flavor <-> Hugging Face config, and reading a model folder."""

import json

import pytest
from transformers import AutoConfig, Qwen3Config, Qwen3MoeConfig

from qwentitan.modeling import (
    FLAVORS,
    ModelingError,
    flavor_from_hf_config,
    flavor_to_hf_config,
    get_flavor,
)


@pytest.mark.parametrize("name", sorted(FLAVORS))
def test_every_flavor_round_trips_through_its_hf_config(name, tmp_path):
    config = flavor_to_hf_config(name)
    assert isinstance(config, Qwen3MoeConfig if FLAVORS[name].is_moe else Qwen3Config)
    assert flavor_from_hf_config(config) is FLAVORS[name]
    config.save_pretrained(tmp_path)  # a model folder's config.json, as transformers writes it
    assert flavor_from_hf_config(tmp_path) is FLAVORS[name]
    assert flavor_from_hf_config(tmp_path / "config.json") is FLAVORS[name]


def test_hf_config_carries_the_flavor_fields():
    c = flavor_to_hf_config("qwen3-235b-a22b")
    f = get_flavor("qwen3-235b-a22b")
    assert c.architectures == ["Qwen3MoeForCausalLM"]
    assert (c.hidden_size, c.num_hidden_layers, c.num_attention_heads) == (4096, 94, 64)
    assert (c.num_key_value_heads, c.head_dim, c.moe_intermediate_size) == (4, 128, 1536)
    assert (c.num_experts, c.num_experts_per_tok, c.norm_topk_prob) == (128, 8, True)
    assert c.rope_parameters["rope_theta"] == f.rope_theta
    assert flavor_to_hf_config("qwen3-0.6b").tie_word_embeddings is True


def test_hub_config_json_written_by_transformers_v4_is_read(tmp_path):
    # The Hub's Qwen3-30B-A3B config.json (v4 era: rope_theta / rope_scaling, num_experts).
    hub = {
        "architectures": ["Qwen3MoeForCausalLM"],
        "attention_bias": False,
        "decoder_sparse_step": 1,
        "head_dim": 128,
        "hidden_act": "silu",
        "hidden_size": 2048,
        "intermediate_size": 6144,
        "max_position_embeddings": 40960,
        "mlp_only_layers": [],
        "model_type": "qwen3_moe",
        "moe_intermediate_size": 768,
        "norm_topk_prob": True,
        "num_attention_heads": 32,
        "num_experts": 128,
        "num_experts_per_tok": 8,
        "num_hidden_layers": 48,
        "num_key_value_heads": 4,
        "rms_norm_eps": 1e-06,
        "rope_scaling": None,
        "rope_theta": 1000000.0,
        "tie_word_embeddings": False,
        "use_sliding_window": False,
        "vocab_size": 151936,
    }
    (tmp_path / "config.json").write_text(json.dumps(hub))
    assert flavor_from_hf_config(tmp_path).name == "qwen3-30b-a3b"
    # transformers' own reading of the same file agrees
    assert flavor_from_hf_config(AutoConfig.from_pretrained(tmp_path)).name == "qwen3-30b-a3b"


def test_unknown_dimensions_become_a_custom_flavor():
    config = flavor_to_hf_config(get_flavor("tiny-dense").replace(num_hidden_layers=3))
    found = flavor_from_hf_config(config, name="three-layers")
    assert (found.name, found.num_hidden_layers) == ("three-layers", 3)
    assert flavor_from_hf_config(config).name == "custom"


def test_unsupported_architecture_is_a_clear_error(tmp_path):
    (tmp_path / "config.json").write_text(
        json.dumps({"model_type": "llama", "architectures": ["LlamaForCausalLM"]})
    )
    with pytest.raises(ModelingError, match=r"LlamaForCausalLM.*supports only Qwen3ForCausalLM"):
        flavor_from_hf_config(tmp_path)


@pytest.mark.parametrize(
    ("change", "match"),
    [
        ({"rope_scaling": {"rope_type": "yarn", "factor": 4.0}}, "RoPE scaling 'yarn'"),
        ({"attention_bias": True}, "attention_bias"),
        ({"use_sliding_window": True}, "use_sliding_window"),
    ],
)
def test_qwen3_variants_the_paths_do_not_implement_are_refused(change, match):
    config = flavor_to_hf_config("tiny-dense").to_dict() | change
    if "rope_scaling" in change:
        del config["rope_parameters"]  # as in a v4-era file, where rope_scaling is the only source
    with pytest.raises(ModelingError, match=match):
        flavor_from_hf_config(config)


def test_missing_folder_is_a_clear_error(tmp_path):
    with pytest.raises(
        ModelingError, match=r"nowhere does not exist; pass the model's config\.json"
    ):
        flavor_from_hf_config(tmp_path / "nowhere")


@pytest.mark.parametrize("field", ["hidden_size", "max_position_embeddings"])
def test_a_config_without_a_dimension_is_named_not_a_key_error(field):
    config = flavor_to_hf_config("tiny-dense").to_dict()
    del config[field]
    with pytest.raises(ModelingError, match=f"lacks the integer field '{field}'"):
        flavor_from_hf_config(config)
