"""verify --logits on Qwen3-MoE conversions: float32 on both sides, tolerance 1e-5 of the
largest |logit|, over expert counts, top-k, norm_topk_prob and sharding."""

import pytest
import torch
from transformers import AutoModelForCausalLM, Qwen3MoeConfig

from qwentitan.checkpoint import to_dcp, verify
from qwentitan.checkpoint.logits import RELATIVE_TOLERANCE, prompt

VOCAB = 64
# (experts, top-k, norm_topk_prob, layers, save_pretrained's max_shard_size: sharded or not)
SHAPES = [
    pytest.param(3, 1, True, 1, "10GB", id="E3-k1-norm-1layer-unsharded"),
    pytest.param(5, 2, False, 2, "8KB", id="E5-k2-nonorm-sharded"),
    pytest.param(6, 3, True, 2, "10GB", id="E6-k3-norm-unsharded"),
    pytest.param(7, 4, False, 1, "8KB", id="E7-k4-nonorm-1layer-sharded"),
]


def _moe(experts: int, top_k: int, norm: bool, layers: int) -> AutoModelForCausalLM:
    config = Qwen3MoeConfig(
        vocab_size=VOCAB,
        hidden_size=16,
        intermediate_size=24,
        num_hidden_layers=layers,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=8,
        max_position_embeddings=32,
        moe_intermediate_size=8,
        num_experts=experts,
        num_experts_per_tok=top_k,
        norm_topk_prob=norm,
        tie_word_embeddings=False,
        # Weights large enough that the logits spread over several units: torchtitan's bf16
        # grouped experts would miss the tolerance here by two orders of magnitude.
        initializer_range=0.3,
    )
    torch.manual_seed(experts)
    return AutoModelForCausalLM.from_config(config).eval()


@pytest.mark.parametrize(("experts", "top_k", "norm", "layers", "shard_size"), SHAPES)
def test_verify_logits_moe_identical_within_1e5_of_largest_logit(
    tmp_path, experts, top_k, norm, layers, shard_size
):
    model = _moe(experts, top_k, norm, layers)
    model.save_pretrained(tmp_path / "hf", max_shard_size=shard_size)
    sharded = (tmp_path / "hf" / "model.safetensors.index.json").is_file()
    assert sharded == (shard_size == "8KB")
    to_dcp(tmp_path / "hf", tmp_path / "dcp")

    report = verify(tmp_path / "hf", tmp_path / "dcp", logits=True)
    assert report.ok, report.format()
    with torch.no_grad():
        largest = float(model(prompt(VOCAB)).logits.abs().max())
    assert report.logits_tolerance == pytest.approx(RELATIVE_TOLERANCE * largest)
    assert RELATIVE_TOLERANCE <= 1e-5
    assert report.logits_max_abs_diff <= report.logits_tolerance


def test_verify_logits_catches_one_changed_expert_value(tmp_path):
    model = _moe(5, 2, True, 1)
    model.save_pretrained(tmp_path / "hf")
    to_dcp(tmp_path / "hf", tmp_path / "dcp")
    # The expert the first prompt token is routed to first, so the change reaches the logits.
    with torch.no_grad():
        router = model(prompt(VOCAB), output_router_logits=True).router_logits[0]
        expert = int(router.reshape(-1, 5)[0].argmax())
        weight = model.model.layers[0].mlp.experts.down_proj  # (E, D, F), fused in transformers 5
        weight[expert, 0, 0] += 0.5
    model.save_pretrained(tmp_path / "changed")

    report = verify(tmp_path / "changed", tmp_path / "dcp", logits=True)
    assert not report.ok
    assert [(d.name, d.differing) for d in report.value_mismatches] == [
        ("layers.0.moe.routed_experts.inner_experts.w2_EDF", 1)
    ]
    assert report.logits_max_abs_diff > 10 * report.logits_tolerance
    assert "DIFFERENT" in report.format()
