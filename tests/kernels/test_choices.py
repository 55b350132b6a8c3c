"""The per-kernel fallback switch: KernelChoices, QWENTITAN_KERNELS, and use_nki in the ops."""

from __future__ import annotations

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from qwentitan.kernels import (
    KernelChoices,
    KernelError,
    block_routing,
    causal_attention,
    grouped_experts,
    nki_loader,
    rope,
)
from qwentitan.kernels.neuron_dispatch import neuron_impl


def test_defaults_are_nki_for_rope_and_experts_and_torchtitans_attention():
    assert KernelChoices.from_env({}) == KernelChoices(
        rope="nki", attention="torchtitan", experts="nki"
    )


def test_the_environment_overrides_single_kernels():
    choices = KernelChoices.from_env({"QWENTITAN_KERNELS": "experts=reference, attention=nki"})
    assert choices == KernelChoices(rope="nki", attention="nki", experts="reference")


@pytest.mark.parametrize(
    ("raw", "match"),
    [("expert=reference", "has 'expert=reference'"), ("rope", "has 'rope'"), ("rope=off", "off")],
)
def test_a_malformed_switch_is_one_sentence_naming_the_fix(raw, match):
    with pytest.raises(KernelError, match=match) as refused:
        KernelChoices.from_env({"QWENTITAN_KERNELS": raw})
    assert "e.g." in str(refused.value) or "fix it in QWENTITAN_KERNELS" in str(refused.value)


def _rope_args():
    freqs = torch.outer(torch.arange(256).float(), 1e4 ** -(torch.arange(0, 16, 2) / 16))
    theta = torch.cat([freqs, freqs], -1)
    cache = torch.cat([theta.cos(), theta.sin()], -1)
    return torch.randn(1, 256, 2, 16), torch.randn(1, 256, 2, 16), cache


def _experts_args():
    ids = torch.randint(0, 4, (64, 2), generator=torch.Generator().manual_seed(0))
    aff = torch.zeros(64, 4).scatter(1, ids, 0.5)
    tpid, b2e = block_routing(ids, 4, 256)
    weights = (torch.randn(4, 512, 2, 64) * 0.05, torch.randn(4, 64, 512) * 0.1)
    return torch.randn(64, 512), aff, *weights, tpid, b2e, 256


@pytest.mark.parametrize("op", ["rope", "causal_attention", "grouped_experts"])
def test_the_neuron_implementation_runs_the_twin_when_use_nki_is_false(neuron, op):
    torch.manual_seed(0)
    if op == "rope":
        args = _rope_args()
    elif op == "causal_attention":
        q, k, _ = _rope_args()
        args = (q, k, k, 0.25)
    else:
        args = _experts_args()
    twin = neuron_impl(op)(*args, False)
    assert nki_loader._cache == {}, "the fallback loads no NKI kernel"
    nki = neuron_impl(op)(*args, True)
    assert nki_loader._cache, "use_nki=True launches the NKI kernel"
    for a, b in zip(twin, nki, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-4)


class _OpLog(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.calls = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func.namespace == "qwentitan":
            # The dispatcher drops trailing arguments equal to their default (use_nki=True).
            given = len(args) == len(func._schema.arguments)
            self.calls.append((func.__name__.split(".")[0], args[-1] if given else True))
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("use_nki", [True, False])
def test_the_switch_reaches_every_backward_op(use_nki):
    q, k, cache = _rope_args()
    q, k = q[:, :8].clone().requires_grad_(True), k[:, :8].clone()  # cpu: any length
    hidden, aff, gate_up, down, tpid, b2e, block = _experts_args()
    hidden.requires_grad_(True)
    with _OpLog() as log:
        q_rot, _ = rope(q, k, cache, use_nki=use_nki)
        out = causal_attention(q_rot, k, k, use_nki=use_nki)
        experts = grouped_experts(hidden, aff, gate_up, down, tpid, b2e, block, use_nki=use_nki)
        (out.sum() + experts.sum()).backward()
    assert sorted(set(log.calls)) == sorted(
        (name, use_nki)
        for name in (
            "rope",
            "rope_backward",
            "causal_attention",
            "causal_attention_backward",
            "grouped_experts",
            "grouped_experts_backward",
        )
    )
