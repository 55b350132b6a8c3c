"""The NKI path against fakes of nki, nki-library and TorchNeuron installed in sys.modules.

Unlike test_nki_call_sites.py, nothing here replaces our loader: `nki_loader` imports the
fake packages, wraps the kernels with the fake `torch_neuronx.wrap_nki` and launches them, so
the route a trn2 run takes (import, wrap, grid, sub-kernel call, version detection) executes.
"""

from __future__ import annotations

import sys

import pytest
import torch

from qwentitan.kernels import KernelError, nki_loader
from qwentitan.kernels.attention import (
    causal_attention_backward_nki,
    causal_attention_backward_reference,
    causal_attention_nki,
    causal_attention_reference,
)
from qwentitan.kernels.experts import (
    grouped_experts_backward_nki,
    grouped_experts_backward_reference,
    grouped_experts_nki,
    grouped_experts_reference,
)
from qwentitan.kernels.rope import rope_backward_reference, rope_nki, rope_reference

from . import fakes
from .cases import experts_case, rope_cache
from .fakes import nki as fake_nki
from .fakes import torch_neuronx as fake_torch_neuronx

# The fakes refuse what the real packages refuse.


def test_the_fake_refuses_a_raw_kernel_call_with_torch_tensors(neuron):
    with pytest.raises(fake_nki.NKIError, match="wrap_nki"):
        neuron["rope_hf"][2](q=torch.zeros(1))


def test_the_fake_wrap_nki_takes_a_grid_sequence_and_only_hashable_constants(neuron):
    caller = fake_torch_neuronx.wrap_nki(neuron["moe_cte"])
    with pytest.raises(TypeError):
        caller[2]  # TorchNeuron does tuple(map(int, grid))
    moe = sys.modules["nkilib.core.moe.moe_cte.moe_cte"]
    spec = moe.MoECTESpec(implementation=moe.MoECTEImplementation.shard_on_i)
    with pytest.raises(TypeError, match="'spec' of type MoECTESpec is not hashable"):
        caller[(2,)](*experts_case()[:4], torch.zeros(1), torch.zeros(1, 1), 256, spec)


def test_the_fake_takes_the_lnc_from_the_callers_grid_only(neuron):
    q = torch.zeros(1, 2, 256, 8)
    kwargs = dict(q=q, k=q, q_out=q, k_out=q, rope_cache=torch.zeros(256, 16))
    with pytest.raises(fake_nki.NKIError, match="LNC 1 != NEURON_LOGICAL_NC_CONFIG"):
        fake_torch_neuronx.wrap_nki(neuron["rope_hf"])(**kwargs)  # empty grid: LNC 1
    with pytest.raises(AttributeError):
        fake_torch_neuronx.wrap_nki(neuron["rope_hf"][2])  # the LNC belongs on the caller


def test_the_fake_refuses_a_jit_kernel_called_inside_another_trace(neuron):
    outer = fake_nki.jit(lambda x: neuron["moe_cte"](x))
    with pytest.raises(fake_nki.NKIError, match=r"nested nki\.jit"):
        fake_torch_neuronx.wrap_nki(outer)[(2,)](torch.zeros(1))


# Finding 2: the ops reach nki-library through torch_neuronx.wrap_nki.


def test_rope_launches_rope_hf_through_wrap_nki(neuron):
    torch.manual_seed(0)
    q, k, cache = torch.randn(2, 256, 4, 16), torch.randn(2, 256, 2, 16), rope_cache(300, 16)
    for got, want in zip(rope_nki(q, k, cache, False), rope_reference(q, k, cache), strict=True):
        torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)
    dq, dk = torch.randn_like(q), torch.randn_like(k)
    for got, want in zip(
        rope_nki(dq, dk, cache, True), rope_backward_reference(dq, dk, cache), strict=True
    ):
        torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)
    fwd, bwd = neuron["rope_hf"].calls
    assert fwd["backward"] is False and bwd["backward"] is True
    assert fwd["q"].shape == (2, 4, 256, 16), "rope_hf takes (batch, heads, seq, head_dim)"


def test_attention_launches_attention_cte_and_bwd_through_wrap_nki(neuron):
    torch.manual_seed(0)
    q = torch.randn(2, 256, 4, 32)
    k, v = torch.randn(2, 256, 2, 32), torch.randn(2, 256, 2, 32)
    out, lse = causal_attention_nki(q, k, v, 0.2)
    ref_out, ref_lse = causal_attention_reference(q, k, v, 0.2)
    torch.testing.assert_close(out, ref_out, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(lse, ref_lse, rtol=1e-5, atol=1e-5)
    grad = torch.randn_like(out)
    got = causal_attention_backward_nki(grad, q, k, v, out, lse, 0.2)
    want = causal_attention_backward_reference(grad, q, k, v, ref_out, ref_lse, 0.2)
    for g, w in zip(got, want, strict=True):
        torch.testing.assert_close(g, w, rtol=1e-4, atol=1e-4)
    (fwd,), (bwd,) = neuron["attention_cte"].calls, neuron["attention_bwd"].calls
    assert fwd["q"].shape == (8, 256, 32) and fwd["k"].shape == (4, 32, 256)
    assert fwd["cache_softmax"] and fwd["causal_mask"] and fwd["scale"] == 0.2
    assert bwd["use_causal_mask"] and bwd["softmax_scale"] == 0.2 and bwd["mixed_precision"]


def test_loading_a_kernel_imports_torch_neuronx_explicitly(neuron, monkeypatch):
    # With TORCH_DEVICE_BACKEND_AUTOLOAD=0 nothing imports torch_neuronx for us.
    monkeypatch.setitem(sys.modules, "torch_neuronx", None)  # makes `import torch_neuronx` fail
    with pytest.raises(KernelError, match="torch-neuronx"):
        nki_loader.load_kernel("rope_hf")


# Finding 3: one top-level launcher per MoE direction calls the sub-kernels' .func.


@pytest.mark.parametrize("name", ["moe_blockwise_fwd", "moe_blockwise_bwd"])
def test_moe_launchers_are_top_level_kernels_that_wrap_nki_accepts(neuron, name):
    launcher = nki_loader._moe_launcher(name)
    assert isinstance(launcher, fake_nki.JitKernel) and launcher.mode is None
    args = experts_case()
    _, gate_up_act, down_act = grouped_experts_reference(*args)
    padded = torch.cat([args[0], torch.zeros(1, 512)])
    flat_aff = torch.cat([args[1], torch.zeros(1, 4)]).reshape(-1, 1)
    common = dict(
        hidden_states=padded,
        expert_affinities_masked=flat_aff,
        gate_up_proj_weight=args[2],
        down_proj_weight=args[3],
        token_position_to_id=args[4],
        block_to_expert=args[5].reshape(-1, 1),
        block_size=256,
    )
    if name == "moe_blockwise_bwd":
        common.update(
            gate_up_proj_act_checkpoint_T=gate_up_act,
            down_proj_act_checkpoint=down_act,
            output_hidden_states_grad=torch.cat([torch.randn(64, 512), torch.zeros(1, 512)]),
            is_tensor_update_accumulating=True,
        )
    result = fake_torch_neuronx.wrap_nki(launcher)[(2,)](**common)
    assert len(result) == (3 if name == "moe_blockwise_fwd" else 4)


def test_grouped_experts_run_moe_cte_and_blockwise_mm_bwd_end_to_end(neuron):
    args = experts_case()
    got = grouped_experts_nki(*args)
    want = grouped_experts_reference(*args)
    for g, w in zip(got, want, strict=True):
        torch.testing.assert_close(g, w, rtol=1e-4, atol=1e-4)
    grad = torch.randn_like(want[0])
    got = grouped_experts_backward_nki(grad, *args[:4], *want[1:], *args[4:])
    expected = grouped_experts_backward_reference(grad, *args[:4], *want[1:], *args[4:])
    for g, w in zip(got, expected, strict=True):
        torch.testing.assert_close(g, w, rtol=1e-4, atol=1e-4)
    (call,) = nki_loader.load_kernel("moe_blockwise_fwd").kernel.calls
    assert call["hidden_states"].shape == (65, 512), "the zero padding row T is added"
    assert call["block_to_expert"].shape == (args[5].numel(), 1), "block_to_expert is [N, 1]"


# Finding 4: the ShardOption is picked from what the installed library has.


@pytest.mark.parametrize("version", ["2.29", "shard-on-free"])
def test_the_backward_picks_a_shard_option_the_installed_library_has(monkeypatch, version):
    monkeypatch.setattr(nki_loader, "_cache", {})
    monkeypatch.setenv("NEURON_LOGICAL_NC_CONFIG", "2")
    fakes.install(monkeypatch, version)
    args = experts_case()
    _, gate_up_act, down_act = grouped_experts_reference(*args)
    grad = torch.randn(64, 512)
    got = grouped_experts_backward_nki(grad, *args[:4], gate_up_act, down_act, *args[4:])
    want = grouped_experts_backward_reference(grad, *args[:4], gate_up_act, down_act, *args[4:])
    for g, w in zip(got, want, strict=True):
        torch.testing.assert_close(g, w, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("version", ["no-usable-shard-option", "2.27"])
def test_a_library_without_the_moe_backward_is_refused_naming_the_minimum_version(
    monkeypatch, version
):
    monkeypatch.setattr(nki_loader, "_cache", {})
    fakes.install(monkeypatch, version)
    with pytest.raises(KernelError, match=r"nki-library 2\.28") as refused:
        nki_loader.load_kernel("moe_blockwise_bwd")
    assert ". " not in str(refused.value), "one sentence"
