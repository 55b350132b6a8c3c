"""The NKI wrappers' layouts and refusals, run on cpu against the fake Neuron SDK of fakes/."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch

from qwentitan.kernels import KernelError, nki_loader
from qwentitan.kernels.attention import causal_attention_backward_nki, causal_attention_nki
from qwentitan.kernels.experts import grouped_experts_nki
from qwentitan.kernels.neuron_dispatch import has_neuron_impl
from qwentitan.kernels.rope import rope_nki

from .cases import experts_case, rope_cache
from .fakes.nkilib import attention_cte
from .fakes.torch_neuronx import wrap_nki


def test_every_op_has_a_neuron_implementation_and_cpu_uses_the_twin():
    for name in (
        "rope",
        "rope_backward",
        "causal_attention",
        "causal_attention_backward",
        "grouped_experts",
        "grouped_experts_backward",
    ):
        assert has_neuron_impl(name), name
        assert not torch._C._dispatch_has_kernel_for_dispatch_key(f"qwentitan::{name}", "CPU")


def test_importing_the_package_never_imports_the_neuron_sdk():
    code = (
        "import sys, qwentitan.kernels\n"
        "bad = [m for m in sys.modules if m.split('.')[0] in ('nki', 'nkilib', 'torch_neuronx')]\n"
        "assert not bad, bad\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True)


def test_loading_a_kernel_without_the_neuron_sdk_is_a_clear_error(monkeypatch):
    monkeypatch.setattr(nki_loader, "_cache", {})
    with pytest.raises(KernelError, match="torch-neuronx"):
        nki_loader.load_kernel("rope_hf")
    with pytest.raises(KernelError, match="unknown NKI kernel"):
        nki_loader.load_kernel("flash")


def test_rope_refuses_a_sequence_not_a_multiple_of_128_x_lnc(neuron, monkeypatch):
    q, k = torch.randn(1, 128, 2, 8), torch.randn(1, 128, 2, 8)
    with pytest.raises(KernelError, match="multiple of 128 x LNC = 256"):
        rope_nki(q, k, rope_cache(128, 8), False)
    assert neuron["rope_hf"].calls == [], "refused before the kernel is called"
    monkeypatch.setenv("NEURON_LOGICAL_NC_CONFIG", "1")
    rope_nki(q, k, rope_cache(128, 8), False)  # LNC=1 takes multiples of 128
    assert len(neuron["rope_hf"].calls) == 1


def test_the_rope_double_rejects_torchtitans_untransposed_layout(neuron):
    q = torch.randn(1, 256, 4, 16)  # (b, s, h, d) passed as if it were (b, h, s, d)
    with pytest.raises(AssertionError):
        wrap_nki(neuron["rope_hf"])[(2,)](
            q=q,
            k=q,
            q_out=torch.empty_like(q),
            k_out=torch.empty_like(q),
            rope_cache=rope_cache(300, 16),
        )


def test_the_attention_double_catches_a_swapped_key_layout():
    q = torch.randn(4, 256, 32)
    k = torch.randn(2, 256, 32)  # (BHkv, S, d) while tp_k=False promises (BHkv, d, S)
    with pytest.raises(AssertionError):
        attention_cte(q=q, k=k, v=k, scale=1.0, tp_q=True, tp_k=False, cache_softmax=True)


def test_attention_refuses_shapes_the_kernels_cannot_take(neuron):
    big = torch.randn(1, 256, 2, 256)
    with pytest.raises(KernelError, match="head_dim <= 128"):
        causal_attention_nki(big, big, big, 1.0)
    odd = torch.randn(1, 200, 2, 16)
    with pytest.raises(KernelError, match="multiple of 128"):
        causal_attention_nki(odd, odd, odd, 1.0)
    s384 = torch.randn(1, 384, 2, 16)
    out, lse = causal_attention_nki(s384, s384, s384, 1.0)
    with pytest.raises(KernelError, match="128, 256 or a multiple of 512"):
        causal_attention_backward_nki(out, s384, s384, s384, out, lse, 1.0)
    assert neuron["attention_bwd"].calls == []


def test_grouped_experts_refuse_shapes_the_kernels_cannot_take(neuron):
    with pytest.raises(KernelError, match="block_size 128"):
        grouped_experts_nki(*experts_case(block=128))
    with pytest.raises(KernelError, match="hidden 256"):
        grouped_experts_nki(*experts_case(hidden=256))
    assert "moe_blockwise_fwd" not in nki_loader._cache, "refused before the kernel loads"
