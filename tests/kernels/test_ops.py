"""The ops on cpu: torch.library contract, float64 gradients, and agreement with PyTorch."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from qwentitan.kernels import (
    KernelError,
    block_routing,
    causal_attention,
    grouped_experts,
    num_blocks,
    numerics_report,
    rope,
)
from qwentitan.kernels.attention import _math_backward, _math_forward

from .cases import rope_cache


def _rope_args(dtype=torch.float32, grad=False):
    q = torch.randn(2, 8, 4, 8, dtype=dtype, requires_grad=grad)
    k = torch.randn(2, 8, 2, 8, dtype=dtype, requires_grad=grad)
    return q, k, rope_cache(12, 8, dtype)


def _attention_args(dtype=torch.float32, grad=False, seq=8):
    return (
        torch.randn(2, seq, 4, 8, dtype=dtype, requires_grad=grad),
        torch.randn(2, seq, 2, 8, dtype=dtype, requires_grad=grad),
        torch.randn(2, seq, 2, 8, dtype=dtype, requires_grad=grad),
        0.3,
    )


def _experts_args(dtype=torch.float32, grad=False, tokens=6, experts=3, top_k=2, block=4):
    gen = torch.Generator().manual_seed(0)
    ids = torch.stack([torch.randperm(experts, generator=gen)[:top_k] for _ in range(tokens)])
    aff = torch.zeros(tokens, experts, dtype=dtype).scatter(
        1, ids, torch.rand(tokens, top_k, generator=gen, dtype=dtype)
    )
    tpid, b2e = block_routing(ids, experts, block)
    tensors = [
        torch.randn(tokens, 8, generator=gen, dtype=dtype),
        aff,
        torch.randn(experts, 8, 2, 4, generator=gen, dtype=dtype),
        torch.randn(experts, 4, 8, generator=gen, dtype=dtype),
    ]
    return (*(t.requires_grad_(grad) for t in tensors), tpid, b2e, block)


def test_opcheck_passes_for_every_forward_op():
    torch.manual_seed(0)
    torch.library.opcheck(torch.ops.qwentitan.rope.default, _rope_args(grad=True))
    torch.library.opcheck(torch.ops.qwentitan.causal_attention.default, _attention_args(grad=True))
    torch.library.opcheck(torch.ops.qwentitan.grouped_experts.default, _experts_args(grad=True))


def test_opcheck_passes_for_every_backward_op():
    torch.manual_seed(0)
    q, k, cache = _rope_args(grad=True)
    torch.library.opcheck(torch.ops.qwentitan.rope_backward.default, (q, k, cache))
    q, k, v, scale = _attention_args()
    out, lse = torch.ops.qwentitan.causal_attention(q, k, v, scale)
    torch.library.opcheck(
        torch.ops.qwentitan.causal_attention_backward.default,
        (torch.randn_like(out), q, k, v, out, lse, scale),
    )
    hidden, aff, gate_up, down, tpid, b2e, block = _experts_args()
    out, gu_act, down_act = torch.ops.qwentitan.grouped_experts(
        hidden, aff, gate_up, down, tpid, b2e, block
    )
    torch.library.opcheck(
        torch.ops.qwentitan.grouped_experts_backward.default,
        (torch.randn_like(out), hidden, aff, gate_up, down, gu_act, down_act, tpid, b2e, block),
    )


def test_gradcheck_float64_for_every_op():
    torch.manual_seed(0)
    q = torch.randn(1, 4, 2, 4, dtype=torch.float64, requires_grad=True)
    k = torch.randn(1, 4, 1, 4, dtype=torch.float64, requires_grad=True)
    cache = rope_cache(6, 4, torch.float64)
    assert torch.autograd.gradcheck(lambda q, k: rope(q, k, cache), (q, k))
    # rope is linear: its backward op has a gradient too (the forward rotation).
    assert torch.autograd.gradcheck(
        lambda q, k: torch.ops.qwentitan.rope_backward(q, k, cache), (q, k)
    )
    v = torch.randn(1, 4, 1, 4, dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradcheck(lambda q, k, v: causal_attention(q, k, v, 0.3), (q, k, v))
    hidden, aff, gate_up, down, tpid, b2e, block = _experts_args(
        torch.float64, grad=True, tokens=3, experts=2, top_k=2, block=2
    )
    assert torch.autograd.gradcheck(
        lambda h, a, gu, d: grouped_experts(h, a, gu, d, tpid, b2e, block),
        (hidden, aff, gate_up, down),
    )


def test_rope_matches_the_rotate_half_formula_exactly_and_leaves_the_cache_without_grad():
    q, k, cache = _rope_args(grad=True)
    cache.requires_grad_(True)
    q_out, k_out = rope(q, k, cache)
    cos, sin = cache[None, :8, None, :8], cache[None, :8, None, 8:]

    def rot(x):
        return torch.cat([-x[..., 4:], x[..., :4]], -1)

    assert (q_out - (q * cos + rot(q) * sin)).abs().max().item() == 0.0
    assert (k_out - (k * cos + rot(k) * sin)).abs().max().item() == 0.0
    (q_out.sum() + k_out.sum()).backward()
    assert cache.grad is None and q.grad is not None


def test_rope_rejects_a_cache_shorter_than_the_sequence():
    q, k, _ = _rope_args()
    with pytest.raises(KernelError, match="max_seq_len"):
        rope(q, k, rope_cache(4, 8))


@pytest.mark.parametrize("groups", [1, 2, 4])
def test_attention_matches_sdpa_causal_gqa_forward_and_backward(groups):
    torch.manual_seed(0)
    q = torch.randn(2, 32, 4, 16, requires_grad=True)
    k = torch.randn(2, 32, 4 // groups, 16, requires_grad=True)
    v = torch.randn(2, 32, 4 // groups, 16, requires_grad=True)
    out = causal_attention(q, k, v)
    ref = F.scaled_dot_product_attention(
        q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True, enable_gqa=True
    ).transpose(1, 2)
    # On cpu both run PyTorch's flash kernel on the same strided views: bit-identical.
    assert torch.equal(out, ref)
    grad = torch.randn_like(out)
    got = torch.autograd.grad(out, (q, k, v), grad)
    want = torch.autograd.grad(ref, (q, k, v), grad)
    for g, w in zip(got, want, strict=True):
        assert torch.equal(g, w)


def test_attention_lse_is_the_log_sum_exp_of_the_causal_scores():
    q, k, v, scale = _attention_args()
    _, lse = torch.ops.qwentitan.causal_attention(q, k, v, scale)
    scores = scale * q.transpose(1, 2) @ k.repeat_interleave(2, 2).transpose(1, 2).transpose(2, 3)
    scores = scores.masked_fill(~torch.ones(8, 8, dtype=torch.bool).tril(), float("-inf"))
    assert lse.shape == (2, 4, 8) and lse.dtype == torch.float32
    torch.testing.assert_close(lse, torch.logsumexp(scores, -1), rtol=1e-5, atol=1e-5)


def test_attention_math_twin_used_off_cpu_matches_the_cpu_twin():
    q, k, v, scale = _attention_args(torch.float64)
    out, lse = torch.ops.qwentitan.causal_attention(q, k, v, scale)
    m_out, m_lse = _math_forward(q, k, v, scale)
    torch.testing.assert_close(m_out, out)
    torch.testing.assert_close(m_lse, lse)
    grad = torch.randn_like(out)
    cpu = torch.ops.qwentitan.causal_attention_backward(grad, q, k, v, out, lse, scale)
    for g, w in zip(_math_backward(grad, q, k, v, out, lse, scale), cpu, strict=True):
        torch.testing.assert_close(g, w)


def test_block_routing_follows_the_contract_example():
    tpid, b2e = block_routing(torch.tensor([0, 1, 0, 2, 0, 1]), num_experts=3, block_size=2)
    assert b2e.tolist() == [0, 0, 1, 2]
    assert tpid.tolist() == [0, 2, 4, 6, 1, 5, 3, 6]  # 6 = number of tokens = empty slot
    assert tpid.dtype == b2e.dtype == torch.int32
    assert num_blocks(6, 3, 2) == 4


def test_block_routing_gives_leftover_blocks_to_the_last_expert():
    tpid, b2e = block_routing(torch.zeros(4, 1, dtype=torch.long), num_experts=3, block_size=2)
    assert b2e.tolist() == [0, 0, 2]  # worst case ceil((4 - 2) / 2) + 2 = 3 blocks
    assert tpid.tolist() == [0, 1, 2, 3, 4, 4]


def test_grouped_experts_match_a_dense_per_expert_loop_forward_and_backward():
    hidden, aff, gate_up, down, tpid, b2e, block = _experts_args(grad=True, tokens=10, block=4)
    out = grouped_experts(hidden, aff, gate_up, down, tpid, b2e, block)
    ref = torch.zeros_like(out)
    for e in range(gate_up.shape[0]):
        act = F.silu(hidden @ gate_up[e, :, 0]) * (hidden @ gate_up[e, :, 1])
        ref = ref + (act @ down[e]) * aff[:, e : e + 1]
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)
    grad = torch.randn_like(out)
    leaves = (hidden, gate_up, down)
    for g, w in zip(
        torch.autograd.grad(out, leaves, grad), torch.autograd.grad(ref, leaves, grad), strict=True
    ):
        torch.testing.assert_close(g, w, rtol=1e-5, atol=1e-5)


def test_grouped_experts_do_not_depend_on_the_order_of_the_blocks():
    hidden, aff, gate_up, down, tpid, b2e, block = _experts_args(grad=True, tokens=10, block=4)
    perm = torch.randperm(b2e.numel(), generator=torch.Generator().manual_seed(1))
    shuffled = (tpid.view(-1, block)[perm].reshape(-1), b2e[perm])
    assert not torch.equal(shuffled[1], b2e)
    leaves = (hidden, aff, gate_up, down)
    results = []
    for routing in ((tpid, b2e), shuffled):
        out = grouped_experts(hidden, aff, gate_up, down, *routing, block)
        results.append((out, *torch.autograd.grad(out.square().sum(), leaves)))
    for ordered, permuted in zip(*results, strict=True):
        torch.testing.assert_close(permuted, ordered)


def test_grouped_experts_in_bfloat16_agree_with_float32_on_the_same_values():
    hidden, aff, gate_up, down, tpid, b2e, block = _experts_args(tokens=10, block=4)
    # Weights scaled by fan-in, as in a model, so no product is far above its inputs.
    values = (hidden, aff, gate_up * 8**-0.5, down * 4**-0.5)
    bf16 = [t.bfloat16().requires_grad_() for t in values]
    fp32 = [t.detach().float().requires_grad_() for t in bf16]
    grad = torch.randn(10, 8, generator=torch.Generator().manual_seed(2))
    results = []
    for inputs in (bf16, fp32):
        out = grouped_experts(*inputs, tpid, b2e, block)
        results.append((out, *torch.autograd.grad(out, inputs, grad.to(out.dtype))))
    for low, high in zip(*results, strict=True):
        assert low.dtype == torch.bfloat16
        # bfloat16 keeps 8 mantissa bits; the intermediates are rounded to it, as on Trainium.
        torch.testing.assert_close(low.float(), high, rtol=3e-2, atol=3e-2)


def test_ops_compile_fullgraph_and_agree_with_eager_in_values_and_gradients():
    def step(q, k, v, cache, hidden, aff, gate_up, down, tpid, b2e):
        q, k = rope(q, k, cache)
        out = causal_attention(q, k, v)
        return out.square().sum() + grouped_experts(hidden, aff, gate_up, down, tpid, b2e, 4).sum()

    compiled = torch.compile(step, fullgraph=True, backend="aot_eager")
    q, k, cache = _rope_args(grad=True)
    v = torch.randn(2, 8, 2, 8, requires_grad=True)
    hidden, aff, gate_up, down, tpid, b2e, _ = _experts_args(grad=True)
    leaves = (q, k, v, hidden, aff, gate_up, down)
    results = []
    for fn in (step, compiled):
        loss = fn(q, k, v, cache, hidden, aff, gate_up, down, tpid, b2e)
        results.append((loss, *torch.autograd.grad(loss, leaves)))
    # aot_eager runs the same ops the eager call does, so values and gradients are identical.
    for eager, graph in zip(*results, strict=True):
        assert torch.equal(eager, graph)


def test_numerics_report_on_cpu():
    rope_report = numerics_report("rope")
    assert set(rope_report.grad_max_abs_diff) == {"q", "k"} and rope_report.worst == 0.0
    attention = numerics_report("causal_attention")
    assert set(attention.grad_max_abs_diff) == {"q", "k", "v"} and attention.worst == 0.0
    experts = numerics_report("grouped_experts")
    assert experts.forward_max_abs_diff == 0.0
    assert set(experts.grad_max_abs_diff) == {
        "hidden_states", "expert_affinities", "gate_up_weight", "down_weight"
    }  # fmt: skip
    # Stays loose: the reference sums the gradient over all tokens at once, the op per block.
    assert max(experts.grad_max_abs_diff.values()) <= 1e-5
    with pytest.raises(KernelError, match="no numerics report"):
        numerics_report("flash")


def test_check_kernels_launches_each_op_of_the_rules_once_and_names_the_route():
    from qwentitan.kernels import ReplacementRule, check_kernels

    rules = [
        ReplacementRule("a", lambda c: c, "nki_rope", op="rope", use_nki=True),
        ReplacementRule("b", lambda c: c, "nki_rope_again", op="rope", use_nki=True),
        ReplacementRule("c", lambda c: c, "reference_experts", op="grouped_experts"),
        ReplacementRule("d", lambda c: c, "plain swap"),
    ]
    checks = check_kernels(rules)
    assert [c.op for c in checks] == ["rope", "grouped_experts"]
    assert all(c.route == "reference twin" for c in checks), "cpu runs the twins"
    assert checks[0].max_abs_diff == 0.0, "the rope twin is exact in float32 on cpu"
    assert 0.0 < checks[1].max_abs_diff < 1e-4
    assert checks[1].max_abs_diff == checks[1].report.worst
