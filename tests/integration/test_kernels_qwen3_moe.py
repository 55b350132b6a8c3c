"""A tiny torchtitan Qwen3 MoE with the three kernel replacements: loss, training, compile."""

from __future__ import annotations

import dataclasses
import logging

import pytest
import torch
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode
from torchtitan.models.common import CosSinRoPE, Embedding, Linear
from torchtitan.models.common.attention import ScaledDotProductAttention
from torchtitan.models.qwen3 import (
    _EMBEDDING_INIT,
    _LINEAR_INIT,
    Qwen3Model,
    _build_qwen3_moe_layers,
    _qwen3_norm,
)

from qwentitan.kernels import KernelChoices, KernelError, ReplacementRule
from qwentitan.modeling.kernel_path import (
    KernelCausalAttention,
    KernelGroupedExperts,
    KernelRoPE,
    apply_kernel_replacements,
    default_rules,
)

VOCAB, DIM, SEQ, LAYERS = 128, 64, 32, 2


def tiny_qwen3_moe() -> Qwen3Model.Config:
    """torchtitan's Qwen3-MoE layer builder at tiny dims (4 experts, top-2)."""
    config = Qwen3Model.Config(
        vocab_size=VOCAB,
        dim=DIM,
        norm=_qwen3_norm(DIM),
        tok_embeddings=Embedding.Config(
            num_embeddings=VOCAB, embedding_dim=DIM, param_init=_EMBEDDING_INIT
        ),
        lm_head=Linear.Config(in_features=DIM, out_features=VOCAB, param_init=_LINEAR_INIT),
        layers=_build_qwen3_moe_layers(
            n_layers=LAYERS,
            dim=DIM,
            n_heads=4,
            n_kv_heads=2,
            head_dim=16,
            moe_hidden_dim=32,
            num_experts=4,
            top_k=2,
            attn_backend="flex",
            moe_comm_backend="standard",
            rope=CosSinRoPE.Config(dim=16, max_seq_len=SEQ, theta=1e6),
        ),
    )
    return config


def _unreplaced_on_cpu(config):
    # FlexAttention has no cpu backward and compiles for ~1 min on cpu; torchtitan's own causal
    # SDPA module computes the same single-document causal attention.
    layers = [
        dataclasses.replace(
            layer,
            attention=dataclasses.replace(
                layer.attention, inner_attention=ScaledDotProductAttention.Config()
            ),
        )
        for layer in config.layers
    ]
    return dataclasses.replace(config, layers=layers)


def _build(config, seed=0):
    torch.manual_seed(seed)
    model = config.build()
    model.init_states()
    return model


def _loss(model, tokens):
    logits = model(tokens[:, :-1])
    return F.cross_entropy(logits.reshape(-1, VOCAB), tokens[:, 1:].reshape(-1))


ALL_NKI = KernelChoices(rope="nki", attention="nki", experts="nki")


def _kernel_config(block_size=8, choices=ALL_NKI):
    return apply_kernel_replacements(tiny_qwen3_moe(), default_rules(block_size, choices))


def test_every_layer_gets_all_three_kernels_and_the_log_says_so(caplog):
    original = tiny_qwen3_moe()
    with caplog.at_level(logging.INFO, logger="qwentitan.kernels"):
        config = _kernel_config()
    for layer in config.layers:
        assert isinstance(layer.attention.rope, KernelRoPE.Config)
        assert isinstance(layer.attention.inner_attention, KernelCausalAttention.Config)
        assert isinstance(layer.moe.routed_experts.inner_experts, KernelGroupedExperts.Config)
    assert not isinstance(original.layers[0].attention.rope, KernelRoPE.Config)
    lines = [r.getMessage() for r in caplog.records]
    # The launch route is named too; here no torch-neuronx is installed.
    route = "  (reference twin (no torch-neuronx here))"
    assert "nki_rope  layers.1.attention.rope" + route in lines
    assert "nki_attention  layers.0.attention.inner_attention" + route in lines
    assert "nki_experts  layers.1.moe.routed_experts.inner_experts" + route in lines
    assert len(lines) == 3 * LAYERS


def test_by_default_attention_stays_torchtitans_and_rope_and_experts_use_nki(caplog, monkeypatch):
    monkeypatch.delenv("QWENTITAN_KERNELS", raising=False)
    with caplog.at_level(logging.INFO, logger="qwentitan.kernels"):
        config = apply_kernel_replacements(tiny_qwen3_moe())
    layer = config.layers[0]
    assert type(layer.attention.inner_attention) is type(
        tiny_qwen3_moe().layers[0].attention.inner_attention
    )
    assert layer.attention.rope.use_nki and layer.moe.routed_experts.inner_experts.use_nki
    assert len(caplog.records) == 2 * LAYERS


def test_a_kernel_switched_to_reference_is_replaced_without_nki_and_logged_per_module(
    caplog, monkeypatch
):
    monkeypatch.setenv("QWENTITAN_KERNELS", "experts=reference")
    with caplog.at_level(logging.INFO, logger="qwentitan.kernels"):
        config = apply_kernel_replacements(tiny_qwen3_moe())
    for layer in config.layers:
        experts = layer.moe.routed_experts.inner_experts
        assert isinstance(experts, KernelGroupedExperts.Config) and not experts.use_nki
        assert layer.attention.rope.use_nki
    lines = [r.getMessage() for r in caplog.records]
    assert [line for line in lines if line.startswith("reference_")] == [
        f"reference_experts  layers.{i}.moe.routed_experts.inner_experts" for i in range(LAYERS)
    ]
    assert config.layers[0].moe.routed_experts.inner_experts.build().use_nki is False


def test_a_dense_model_config_is_refused_for_the_experts_rule():
    config = tiny_qwen3_moe()
    with pytest.raises(KernelError, match="matches no module"):
        apply_kernel_replacements(
            config, [ReplacementRule("layers.*.feed_forward.experts", lambda c: c, "nki_x")]
        )


def test_replaced_model_matches_the_unreplaced_loss_at_step_1_and_trains():
    tokens = torch.randint(0, VOCAB, (2, SEQ + 1), generator=torch.Generator().manual_seed(0))
    baseline = _build(_unreplaced_on_cpu(tiny_qwen3_moe()))
    kernel_model = _build(_kernel_config())
    kernel_model.load_state_dict(baseline.state_dict())
    with torch.no_grad():
        want = _loss(baseline, tokens).item()
    opt = torch.optim.AdamW(kernel_model.parameters(), lr=3e-3)
    losses = []
    for _ in range(4):
        opt.zero_grad()
        loss = _loss(kernel_model, tokens)
        loss.backward()
        opt.step()
        losses.append(loss.item())
    # torchtitan's GroupedExperts rounds to bfloat16; ours computes in float32 (the next test
    # removes torchtitan's casts and matches to 1e-5).
    assert losses[0] == pytest.approx(want, rel=1e-3)
    assert losses[-1] < losses[0] - 0.05, losses


def test_replaced_model_matches_in_float32_when_the_experts_compute_in_float32():
    tokens = torch.randint(0, VOCAB, (2, SEQ + 1), generator=torch.Generator().manual_seed(1))
    kernel_model = _build(_kernel_config())
    # Reference: torchtitan's modules, with the experts' bfloat16 casts off via its seam.
    baseline = _build(_unreplaced_on_cpu(tiny_qwen3_moe()))
    baseline.load_state_dict(kernel_model.state_dict())
    for layer in baseline.layers.values():
        experts = layer.moe.routed_experts.inner_experts
        experts.forward = _float32_grouped_experts(experts)
    with torch.no_grad():
        assert _loss(kernel_model, tokens).item() == pytest.approx(
            _loss(baseline, tokens).item(), rel=1e-5
        )


def _float32_grouped_experts(experts):
    def forward(x, counts):
        offs = torch.cumsum(counts, 0, dtype=torch.int32)
        h = F.silu(experts._grouped_mm(A=x, B_t=experts.w1_EFD.transpose(-2, -1), offs=offs))
        h = h * experts._grouped_mm(A=x, B_t=experts.w3_EFD.transpose(-2, -1), offs=offs)
        return experts._grouped_mm(A=h, B_t=experts.w2_EDF.transpose(-2, -1), offs=offs)

    return forward


def test_replaced_model_compiles_fullgraph_and_agrees_with_eager():
    tokens = torch.randint(0, VOCAB, (2, SEQ + 1), generator=torch.Generator().manual_seed(2))
    model = _build(_kernel_config())
    eager = _loss(model, tokens)
    compiled = torch.compile(model, fullgraph=True, backend="aot_eager")
    loss = F.cross_entropy(compiled(tokens[:, :-1]).reshape(-1, VOCAB), tokens[:, 1:].reshape(-1))
    loss.backward()
    assert loss.item() == pytest.approx(eager.item(), rel=1e-5)
    assert model.layers["0"].moe.routed_experts.inner_experts.w1_EFD.grad is not None


class _SwitchLog(TorchDispatchMode):
    """Records (op, use_nki) of every qwentitan op call."""

    def __init__(self):
        super().__init__()
        self.calls = set()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func.namespace == "qwentitan":
            # The dispatcher drops a trailing argument equal to its default (use_nki=True).
            given = len(args) == len(func._schema.arguments)
            self.calls.add((func.__name__.split(".")[0], args[-1] if given else True))
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("choice", ["nki", "reference"])
def test_every_kernel_module_hands_its_switch_to_the_ops_forward_and_backward(choice):
    choices = KernelChoices(rope=choice, attention=choice, experts=choice)
    model = _build(_kernel_config(choices=choices))
    tokens = torch.randint(0, VOCAB, (2, SEQ + 1), generator=torch.Generator().manual_seed(3))
    with _SwitchLog() as log:
        _loss(model, tokens).backward()
    ops = ("rope", "causal_attention", "grouped_experts")
    want = {(op + suffix, choice == "nki") for op in ops for suffix in ("", "_backward")}
    assert log.calls == want
