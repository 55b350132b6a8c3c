"""The kernel modules against the torchtitan modules they replace."""

from __future__ import annotations

import pytest
import torch
from torchtitan.models.common.moe import GroupedExperts
from torchtitan.models.common.rope import CosSinRoPE, RoPE

from qwentitan.modeling.kernel_path import KernelGroupedExperts, KernelRoPE, _replace_rope


def _rope_pair(max_seq=64, dim=16):
    config = CosSinRoPE.Config(dim=dim, max_seq_len=max_seq, theta=1e6)
    return config.build(), _replace_rope(config).build()


def test_rope_equals_torchtitan_qwen3_rope_exactly_in_float32():
    torch.manual_seed(0)
    ours_q, ours_k = torch.randn(2, 48, 4, 16), torch.randn(2, 48, 2, 16)
    theirs, ours = _rope_pair()
    tq, tk = ours_q.clone().requires_grad_(), ours_k.clone().requires_grad_()
    oq, ok = ours_q.clone().requires_grad_(), ours_k.clone().requires_grad_()
    want = theirs(tq, tk)
    got = ours(oq, ok)
    assert isinstance(ours, KernelRoPE) and isinstance(ours, RoPE)
    assert (got[0] - want[0]).abs().max().item() == 0.0
    assert (got[1] - want[1]).abs().max().item() == 0.0
    gq, gk = torch.randn_like(ours_q), torch.randn_like(ours_k)
    torch.autograd.backward(want, (gq, gk))
    torch.autograd.backward(got, (gq, gk))
    assert torch.equal(oq.grad, tq.grad) and torch.equal(ok.grad, tk.grad)


def test_rope_follows_per_document_positions_like_torchtitan():
    """torchtitan's loaders restart positions at each packed document; both RoPEs gather there."""
    torch.manual_seed(2)
    q, k = torch.randn(2, 32, 4, 16), torch.randn(2, 32, 2, 16)
    positions = torch.stack([torch.cat([torch.arange(9), torch.arange(23)]), torch.arange(32)])
    theirs, ours = _rope_pair()
    tq, tk = q.clone().requires_grad_(), k.clone().requires_grad_()
    oq, ok = q.clone().requires_grad_(), k.clone().requires_grad_()
    want, got = theirs(tq, tk, positions), ours(oq, ok, positions)
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
    assert not torch.equal(got[0], ours(q, k)[0])  # the restart at token 9 changed the rotation
    gq, gk = torch.randn_like(q), torch.randn_like(k)
    torch.autograd.backward(want, (gq, gk))
    torch.autograd.backward(got, (gq, gk))
    assert torch.equal(oq.grad, tq.grad) and torch.equal(ok.grad, tk.grad)


def test_rope_yarn_cache_is_honoured_too():
    config = CosSinRoPE.Config(dim=16, max_seq_len=64, scaling="yarn", rope_factor=4.0)
    theirs, ours = config.build(), _replace_rope(config).build()
    q, k = torch.randn(1, 64, 2, 16), torch.randn(1, 64, 2, 16)
    for a, b in zip(ours(q, k), theirs(q, k), strict=True):
        assert (a - b).abs().max().item() == 0.0


def _experts(cls, **extra):
    config = cls.Config(dim=32, hidden_dim=16, num_experts=4, **extra)
    module = config.build()
    torch.manual_seed(1)
    for p in module.parameters():
        torch.nn.init.normal_(p, std=0.2)
    return module


def _routed_rows(rows=40, experts=4):
    counts = torch.tensor([13, 0, 20, 7])  # an idle expert and uneven loads
    assert int(counts.sum()) == rows
    return torch.randn(rows, 32), counts


def test_grouped_experts_match_torchtitan_grouped_experts_in_bfloat16():
    theirs = _experts(GroupedExperts)
    ours = _experts(KernelGroupedExperts, block_size=8, compute_dtype=torch.bfloat16)
    ours.load_state_dict(theirs.state_dict())
    x, counts = _routed_rows()
    xt, xo = x.clone().requires_grad_(), x.clone().requires_grad_()
    want, got = theirs(xt, counts), ours(xo, counts)
    # Both compute in bfloat16 (torchtitan casts); they differ by rounding order only.
    torch.testing.assert_close(got, want, rtol=2e-2, atol=2e-2)
    grad = torch.randn_like(want)
    want.backward(grad)
    got.backward(grad)
    torch.testing.assert_close(xo.grad, xt.grad, rtol=2e-2, atol=2e-2)
    for name in ("w1_EFD", "w2_EDF", "w3_EFD"):
        torch.testing.assert_close(
            getattr(ours, name).grad, getattr(theirs, name).grad, rtol=3e-2, atol=3e-2
        )


def test_grouped_experts_match_torchtitans_grouped_mm_formula_in_float32():
    theirs = _experts(GroupedExperts)
    ours = _experts(KernelGroupedExperts, block_size=8)  # computes in the input's float32
    x, counts = _routed_rows()
    offsets = torch.cumsum(counts, 0, dtype=torch.int32)
    # torchtitan's GroupedExperts.forward with its bfloat16 casts removed (its own _grouped_mm seam).
    h = torch.nn.functional.silu(
        theirs._grouped_mm(A=x, B_t=theirs.w1_EFD.transpose(-2, -1), offs=offsets)
    ) * theirs._grouped_mm(A=x, B_t=theirs.w3_EFD.transpose(-2, -1), offs=offsets)
    want = theirs._grouped_mm(A=h, B_t=theirs.w2_EDF.transpose(-2, -1), offs=offsets)
    got = ours(x, counts)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    grad = torch.randn_like(want)  # contiguous: grouped_mm's backward rejects expanded grads
    grads_want = torch.autograd.grad(want, list(theirs.parameters()), grad)
    grads_got = torch.autograd.grad(got, list(ours.parameters()), grad)
    for g, w in zip(grads_got, grads_want, strict=True):
        torch.testing.assert_close(g, w, rtol=1e-4, atol=1e-4)


def test_a_complex_rope_is_refused():
    from torchtitan.models.common.rope import ComplexRoPE

    from qwentitan.kernels import KernelError

    with pytest.raises(KernelError, match="CosSinRoPE"):
        _replace_rope(ComplexRoPE.Config(dim=16, max_seq_len=8))


def test_grouped_experts_under_ep_count_the_experts_this_rank_holds():
    """Under EP each rank holds a slice of the experts (its local shard of w1/w2/w3) and
    torchtitan's dispatcher hands it one token count per local expert, while the Config still
    says the global number of experts."""
    whole = _experts(KernelGroupedExperts, block_size=8)  # 4 experts in all
    rank_1 = _experts(KernelGroupedExperts, block_size=8)
    for name in ("w1_EFD", "w2_EDF", "w3_EFD"):  # EP 2, rank 1: experts 2 and 3
        setattr(rank_1, name, torch.nn.Parameter(getattr(whole, name).detach()[2:].clone()))
    x, counts = _routed_rows()
    local_rows = x[int(counts[:2].sum()) :]
    got = rank_1(local_rows, counts[2:])
    torch.testing.assert_close(got, whole(x, counts)[int(counts[:2].sum()) :])
