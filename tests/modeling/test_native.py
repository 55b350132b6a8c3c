"""The native path: torchtitan's Qwen3 with the flavor's dimensions, checked against
transformers on the same weights (written by transformers' save_pretrained)."""

import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from torchtitan.models.common.attention import ScaledDotProductAttention
from torchtitan.models.common.moe import GroupedExperts
from torchtitan.models.qwen3 import parallelize_qwen3, qwen3_configs
from torchtitan.models.qwen3.state_dict_adapter import Qwen3StateDictAdapter

from qwentitan.modeling import ModelingError, get_flavor, model_spec

from .conftest import hf_logits


def _native_model(flavor: str, folder: Path, **kwargs) -> torch.nn.Module:
    spec = model_spec(flavor, "native", hf_folder=folder, **kwargs)
    model = spec.model.build()
    model.init_states()
    hub = {}
    for file in sorted(folder.glob("*.safetensors")):
        hub.update(load_file(file))
    native = spec.state_dict_adapter(spec.model, str(folder)).from_hf(hub)
    model.load_state_dict(native, strict=True)
    return model.eval()


def test_dense_logits_equal_transformers(tiny_dense_folder, tokens):
    model = _native_model("tiny-dense", tiny_dense_folder)
    with torch.no_grad():
        diff = (model(tokens) - hf_logits(tiny_dense_folder, tokens)).abs().max().item()
    print(f"native tiny-dense max|diff| vs Qwen3ForCausalLM: {diff:.3e}")
    assert diff == 0.0  # same float32 ops in the same order: bit-identical, as the README says


def test_moe_logits_match_transformers_to_bf16_expert_precision(tiny_moe_folder, tokens):
    """torchtitan's GroupedExperts always runs its grouped matmuls in bfloat16 (inputs and
    weights cast down, 8-bit mantissa: relative rounding 2**-9 ~ 0.2% per operand), so
    float32 logits cannot agree to 1e-5. The test pins both halves of that claim: with
    `float32_experts` the paths agree exactly (routing, weights, layout all exact), and with
    torchtitan's bf16 they differ by at most 1% of the logit scale."""
    reference = hf_logits(tiny_moe_folder, tokens)
    scale = reference.abs().max().item()
    float32 = _native_model("tiny-moe", tiny_moe_folder, float32_experts=True)
    assert all(
        type(layer.moe.routed_experts.inner_experts) is not GroupedExperts
        for layer in float32.layers.values()
    )
    with torch.no_grad():
        bf16 = _native_model("tiny-moe", tiny_moe_folder)(tokens)
        bf16_diff = (bf16 - reference).abs().max().item()
        fp32_diff = (float32(tokens) - reference).abs().max().item()
    print(
        f"native tiny-moe max|diff| vs Qwen3MoeForCausalLM: {bf16_diff:.3e} (bf16 grouped mm, "
        f"logit scale {scale:.2f}); {fp32_diff:.3e} with float32_experts"
    )
    assert fp32_diff == 0.0  # per-expert float32 matmuls, as transformers: bit-identical
    assert 1e-5 < bf16_diff <= 1e-2 * scale


def test_native_spec_is_torchtitans_qwen3_with_the_flavor_dimensions():
    spec = model_spec("qwen3-30b-a3b", "native")
    f = get_flavor("qwen3-30b-a3b")
    assert (spec.name, spec.flavor) == ("qwen3", "qwen3-30b-a3b")
    assert spec.parallelize_fn is parallelize_qwen3
    assert spec.state_dict_adapter is Qwen3StateDictAdapter
    config = spec.model
    assert (config.dim, config.vocab_size, len(config.layers)) == (2048, 151936, 48)
    layer = config.layers[0]
    assert (layer.attention.n_heads, layer.attention.n_kv_heads, layer.attention.head_dim) == (
        32,
        4,
        128,
    )
    assert layer.attention.rope.theta == f.rope_theta
    assert layer.attention.rope.max_seq_len == f.max_position_embeddings
    assert (layer.moe.num_experts, layer.moe.router.top_k) == (128, 8)
    assert layer.moe.router.route_norm and layer.moe.load_balance_coeff is None
    assert isinstance(layer.attention.inner_attention, ScaledDotProductAttention.Config)
    assert not config.enable_weight_tying
    assert model_spec("qwen3-0.6b").model.enable_weight_tying


def test_sdpa_backend_trains_on_cpu():
    model = model_spec("tiny-moe").model.build()
    model.init_states()
    tokens = torch.randint(0, 151936, (1, 32))
    loss = torch.nn.functional.cross_entropy(model(tokens)[0, :-1], tokens[0, 1:])
    loss.backward()
    grads = [p.grad for p in model.parameters()]
    assert all(g is not None and torch.isfinite(g).all() for g in grads)
    assert model.layers["0"].moe.routed_experts.inner_experts.w1_EFD.grad.abs().sum() > 0


def test_flex_backend_is_available_for_accelerators():
    inner = model_spec("tiny-dense", attn_backend="flex").model.layers[0].attention.inner_attention
    assert type(inner).__qualname__ == "FlexAttention.Config"


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        (
            dict(flavor="tiny-dense", path="jax"),
            r"Unknown model path 'jax'.*native, hf, moe-kernels",
        ),
        (dict(flavor="tiny-dense", attn_backend="xformers"), r"Unknown attention backend"),
        (dict(flavor="qwen3-8b", path="moe-kernels"), r"needs an MoE flavor"),
    ],
)
def test_bad_requests_are_one_sentence_errors(kwargs, match):
    with pytest.raises(ModelingError, match=match):
        model_spec(**kwargs)


def test_moe_kernels_without_the_kernels_package_names_the_install(monkeypatch):
    # `nox -s isolation` runs this without qwentitan-kernels; in the workspace it is installed,
    # so hide it the way a missing package looks to the import system.
    monkeypatch.setitem(sys.modules, "qwentitan.kernels", None)
    with pytest.raises(ModelingError, match=r"pip install 'qwentitan-modeling\[kernels\]'"):
        model_spec("tiny-moe", "moe-kernels")


def test_folder_of_another_flavor_is_refused(tiny_dense_folder):
    with pytest.raises(ModelingError, match=r"is 'tiny-dense', not flavor 'tiny-moe'"):
        model_spec("tiny-moe", "native", hf_folder=tiny_dense_folder)


TORCHTITAN_FLAVORS = {
    "qwen3-0.6b": "0.6B",
    "qwen3-1.7b": "1.7B",
    "qwen3-4b": "4B",
    "qwen3-8b": "8B",
    "qwen3-14b": "14B",
    "qwen3-32b": "32B",
    "qwen3-30b-a3b": "30B-A3B",
    "qwen3-235b-a22b": "235B-A22B",
}


@pytest.mark.parametrize("name", sorted(TORCHTITAN_FLAVORS))
def test_published_flavors_build_torchtitans_own_qwen3(name):
    ours = model_spec(name).model
    theirs = qwen3_configs[TORCHTITAN_FLAVORS[name]](attn_backend="flex")
    with torch.device("meta"):
        ours_model, theirs_model = ours.build(), theirs.build()
    shapes = [{k: v.shape for k, v in m.named_parameters()} for m in (ours_model, theirs_model)]
    assert shapes[0] == shapes[1]
    # the one buffer difference: no learned routing bias (see native.py)
    assert not any("expert_bias" in k for k, _ in ours_model.named_buffers())
    assert ours.enable_weight_tying == theirs.enable_weight_tying
    ours_attn, theirs_attn = ours.layers[0].attention, theirs.layers[0].attention
    assert ours_attn.rope.max_seq_len == theirs_attn.rope.max_seq_len
    # torchtitan took 235B-A22B's theta from the 2507 release (see flavors.py)
    expected_theta = 1e6 if name == "qwen3-235b-a22b" else theirs_attn.rope.theta
    assert ours_attn.rope.theta == expected_theta
