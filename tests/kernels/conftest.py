"""Test doubles for the NKI kernels, following the contracts in shared/reference/neuron.md.

Each double takes the documented arguments by keyword only, launched as `kernel[lnc](...)`,
asserts the documented constraints (layouts, out buffers, divisibility), and computes the result
in float64 from the layout it was promised. A wrapper that transposes wrongly, swaps arguments or
skips an out buffer either trips an assertion here or returns numbers that differ from the
reference twin.
"""

from __future__ import annotations

import os

import pytest
import torch
import torch.nn.functional as F

from qwentitan.kernels import nki_loader


class KernelDouble:
    def __init__(self, fn):
        self.fn = fn
        self.calls: list[dict] = []

    def __getitem__(self, lnc: int):
        assert lnc == int(os.environ.get("NEURON_LOGICAL_NC_CONFIG", "2")), "launch [lnc] != LNC"

        def launch(*args, **kwargs):
            assert not args, "pass NKI kernel arguments by keyword"
            self.calls.append(kwargs)
            return self.fn(lnc, **kwargs)

        return launch


def rope_hf(lnc, q, k, q_out, k_out, cos=None, sin=None, rope_cache=None, backward=False):
    assert q.dim() == 4 and k.dim() == 4 and q.shape[-1] == k.shape[-1]
    assert q.shape[0] == k.shape[0] and q.shape[2] == k.shape[2]
    assert q_out.shape == q.shape and k_out.shape == k.shape, "out buffers must match q and k"
    assert (rope_cache is None) != (cos is None and sin is None), "one cache form only"
    _, _, seq, dim = q.shape
    assert seq % (128 * lnc) == 0, "S % (128 * lnc) == 0"
    assert rope_cache.dim() == 2 and rope_cache.shape[1] == 2 * dim and rope_cache.shape[0] >= seq
    assert rope_cache.dtype == q.dtype
    cos, sin = rope_cache[:seq, :dim].double(), rope_cache[:seq, dim:].double()
    half = dim // 2

    def apply(x):
        x = x.double()
        x1, x2 = x[..., :half], x[..., half:]
        if backward:
            return x * cos + torch.cat([x2 * sin[:, half:], -x1 * sin[:, :half]], -1)
        return x * cos + torch.cat([-x2, x1], -1) * sin

    q_out.copy_(apply(q))
    k_out.copy_(apply(k))
    return q_out, k_out


def _stats(scores):
    m = scores.amax(-1, keepdim=True)
    s = torch.exp(scores - m).sum(-1, keepdim=True)
    return m, s


def attention_cte(
    lnc,
    q,
    k,
    v,
    scale=1.0,
    causal_mask=True,
    tp_q=True,
    tp_k=False,
    tp_out=False,
    cache_softmax=False,
    **unused,
):
    assert not any(unused.values()), f"unexpected options {unused}"
    qs = q if tp_q else q.transpose(1, 2)  # (BH, S, d)
    ks = k.transpose(1, 2) if not tp_k else k  # (BHkv, S, d)
    assert qs.shape[-1] <= 128 and qs.shape[0] <= 512
    assert v.shape == ks.shape and qs.shape[0] % ks.shape[0] == 0
    bh, seq, _ = qs.shape
    assert ks.shape[1] == seq
    group = bh // ks.shape[0]
    kk = ks.double().repeat_interleave(group, 0)
    vv = v.double().repeat_interleave(group, 0)
    scores = scale * qs.double() @ kk.transpose(1, 2)
    if causal_mask:
        scores = scores.masked_fill(~torch.ones(seq, seq, dtype=torch.bool).tril(), float("-inf"))
    m, s = _stats(scores)
    out = (torch.exp(scores - m) / s) @ vv
    out = (out.transpose(1, 2) if tp_out else out).to(q.dtype)
    if not cache_softmax:
        return out
    assert seq % 128 == 0

    def tiles(x):  # (BH, S, 1) -> [BH, 128, S/128], [i, p, g] <-> query g * 128 + p
        return x[..., 0].reshape(bh, seq // 128, 128).transpose(1, 2).float().contiguous()

    return out, tiles(-m), tiles(1.0 / s)


def attention_bwd(
    lnc,
    q_ref,
    k_ref,
    v_ref,
    o_ref,
    dy_ref,
    lse_ref,
    sinks_ref=None,
    bound_min=None,
    bound_max=None,
    use_causal_mask=False,
    mixed_precision=False,
    softmax_scale=None,
    sliding_window=None,
):
    batch, heads, dim, seq = q_ref.shape
    kv_heads = k_ref.shape[1]
    assert heads % kv_heads == 0 and k_ref.shape == v_ref.shape == (batch, kv_heads, dim, seq)
    assert o_ref.shape == dy_ref.shape == q_ref.shape
    assert len({t.dtype for t in (q_ref, k_ref, v_ref, o_ref, dy_ref)}) == 1, "one dtype"
    assert seq % 128 == 0 and (seq in (128, 256) or seq % 512 == 0)
    assert lse_ref.shape == (batch, heads, 128, seq // 128)
    assert dim <= 128
    scale = softmax_scale or dim**-0.5
    group = heads // kv_heads
    q = q_ref.double().transpose(2, 3).requires_grad_(True)
    k = k_ref.double().transpose(2, 3).requires_grad_(True)
    v = v_ref.double().transpose(2, 3).requires_grad_(True)
    scores = scale * q @ k.repeat_interleave(group, 1).transpose(2, 3)
    if use_causal_mask:
        scores = scores.masked_fill(~torch.ones(seq, seq, dtype=torch.bool).tril(), float("-inf"))
    lse = torch.logsumexp(scores, -1)
    tiles = lse_ref.double().transpose(2, 3).reshape(batch, heads, seq)
    assert torch.allclose(tiles, lse.detach(), atol=1e-4), "lse_ref is not logsumexp in tiles"
    out = torch.softmax(scores, -1) @ v.repeat_interleave(group, 1)
    assert torch.allclose(out.detach().transpose(2, 3), o_ref.double(), atol=1e-4), "o_ref"
    out.backward(dy_ref.double().transpose(2, 3))
    return tuple(t.grad.transpose(2, 3).to(q_ref.dtype) for t in (q, k, v))


def _moe_checks(hidden_states, expert_affinities_masked, gate_up, down, tpid, b2e, block_size):
    tokens_plus_one, hidden = hidden_states.shape
    experts, hidden2, two, inter = gate_up.shape
    assert hidden2 == hidden and two == 2 and down.shape == (experts, inter, hidden)
    assert torch.all(hidden_states[-1] == 0), "row T of hidden_states must be zero"
    assert expert_affinities_masked.shape == (tokens_plus_one * experts, 1)
    assert torch.all(expert_affinities_masked.view(tokens_plus_one, experts)[-1] == 0)
    assert tpid.dtype == torch.int32 and b2e.dtype == torch.int32
    assert b2e.dim() == 2 and b2e.shape[1] == 1, "block_to_expert is [N, 1]"
    assert tpid.shape == (b2e.shape[0] * block_size,)
    assert torch.all(b2e[1:] >= b2e[:-1]), "block_to_expert is non-decreasing"
    assert int(tpid.min()) >= 0 and int(tpid.max()) <= tokens_plus_one - 1
    return experts, inter


def _moe_loop(hidden_states, flat_aff, gate_up, down, tpid, b2e, block_size):
    experts = gate_up.shape[0]
    out = torch.zeros_like(hidden_states)
    gate_up_t, down_act = [], []
    for n, e in enumerate(b2e[:, 0].tolist()):
        ids = tpid[n * block_size : (n + 1) * block_size].long()
        x = hidden_states[ids]
        gate, up = x @ gate_up[e, :, 0], x @ gate_up[e, :, 1]
        d = (F.silu(gate) * up) @ down[e]
        out = out.index_add(0, ids, d * flat_aff[ids * experts + e])
        gate_up_t.append(torch.stack([gate.T, up.T]))
        down_act.append(d)
    return out, torch.stack(gate_up_t), torch.stack(down_act)


def moe_blockwise_fwd(
    lnc,
    hidden_states,
    expert_affinities_masked,
    gate_up_proj_weight,
    down_proj_weight,
    token_position_to_id,
    block_to_expert,
    block_size,
):
    _, inter = _moe_checks(
        hidden_states,
        expert_affinities_masked,
        gate_up_proj_weight,
        down_proj_weight,
        token_position_to_id,
        block_to_expert,
        block_size,
    )
    hidden = hidden_states.shape[1]
    assert block_size % 256 == 0 and 512 <= hidden <= 8192 and hidden % 512 == 0
    assert inter % 16 == 0
    args = (hidden_states, expert_affinities_masked, gate_up_proj_weight, down_proj_weight)
    out, gate_up_t, down_act = _moe_loop(
        *(a.double() for a in args), token_position_to_id, block_to_expert, block_size
    )
    dtype = hidden_states.dtype
    return out.to(dtype), gate_up_t.to(dtype), down_act.to(dtype)


def moe_blockwise_bwd(
    lnc,
    hidden_states,
    expert_affinities_masked,
    gate_up_proj_weight,
    down_proj_weight,
    gate_up_proj_act_checkpoint_T,
    down_proj_act_checkpoint,
    token_position_to_id,
    block_to_expert,
    output_hidden_states_grad,
    block_size,
    is_tensor_update_accumulating,
):
    _, inter = _moe_checks(
        hidden_states,
        expert_affinities_masked,
        gate_up_proj_weight,
        down_proj_weight,
        token_position_to_id,
        block_to_expert,
        block_size,
    )
    hidden = hidden_states.shape[1]
    assert block_size in (128, 256, 512, 1024)
    assert (hidden // lnc) % 32 == 0 and (inter // lnc) % 32 == 0
    assert torch.all(output_hidden_states_grad[-1] == 0), "row T of dOut must be zero"
    leaves = [
        t.double().requires_grad_(True)
        for t in (hidden_states, expert_affinities_masked, gate_up_proj_weight, down_proj_weight)
    ]
    out, gate_up_t, down_act = _moe_loop(*leaves, token_position_to_id, block_to_expert, block_size)
    assert torch.allclose(gate_up_t.detach(), gate_up_proj_act_checkpoint_T.double(), atol=1e-4)
    assert torch.allclose(down_act.detach(), down_proj_act_checkpoint.double(), atol=1e-4)
    out.backward(output_hidden_states_grad.double())
    return tuple(t.grad.to(hidden_states.dtype) for t in leaves)


DOUBLES = {
    "rope_hf": rope_hf,
    "attention_cte": attention_cte,
    "attention_bwd": attention_bwd,
    "moe_blockwise_fwd": moe_blockwise_fwd,
    "moe_blockwise_bwd": moe_blockwise_bwd,
}


@pytest.fixture
def nki_doubles(monkeypatch):
    """Route every NKI kernel load to its double; returns {name: KernelDouble} to inspect calls."""
    doubles = {name: KernelDouble(fn) for name, fn in DOUBLES.items()}
    monkeypatch.setattr(nki_loader, "load_kernel", lambda name: doubles[name])
    monkeypatch.setenv("NEURON_LOGICAL_NC_CONFIG", "2")
    return doubles
