"""Fake nki-library kernels: the real entry points' signatures, constraints and numbers.

Each kernel keeps the parameter list of its nki-library namesake (aws-neuron/nki-library,
`src/nkilib_src/nkilib/...`, releases 2.28 / 2.29, main of April 2026 and, for
`blockwise_mm_bwd`, commit 092a49d) so TorchNeuron's caller fills the same defaults, asserts the constraints the kernel documents or validates,
and computes its result in float64 the way the library's own torch reference does:

| kernel (module) | torch reference it is re-derived from |
|---|---|
| `rope_hf` (core/embeddings/rope_hf.py) | `rope_hf_torch_ref` (core/embeddings/rope_hf_torch.py) |
| `attention_cte` (core/attention/attention_cte.py) | `attention_cte_torch_ref` (core/attention/attention_cte_torch.py) |
| `attention_bwd` (core/attention/attention_bwd.py) | `attention_bwd_torch_ref` (core/attention/attention_bwd_torch.py) |
| `moe_cte` (core/moe/moe_cte/moe_cte.py) | `moe_cte_torch_ref` (core/moe/moe_cte/moe_cte_torch.py) |
| `blockwise_mm_bwd` (experimental/moe/bwd/blockwise_mm_backward.py) | `blockwise_mm_bwd_torch_ref` (test/integration/nkilib/experimental/moe/test_bwmm_bwd_common.py) |

`moe_cte` is a trace-mode sub-kernel and `blockwise_mm_bwd` a top-level `@nki.jit` kernel
there; `build()` makes one set (the enums are classes, fresh per test). Both MoE kernels round
their matmul outputs through `compute_dtype` (default bfloat16, as in the library), so a caller
that does not pass the activations' dtype gets bfloat16 numbers back.
"""

from __future__ import annotations

import dataclasses
import enum
import types

import torch
import torch.nn.functional as F

from . import language, nki

# ShardOption of experimental/moe/bwd/moe_bwd_parameters.py per nki-library generation: 2.28,
# 2.29 and main of April 2026 (blockwise_mm_bwd takes it and never reads it), and commit 092a49d
# (about SDK 2.32; the kernel forwards it to MOEBwdParameters, which validates it).
GENERATIONS = ("2.29", "092a49d")
SHARD_OPTIONS = {
    "2.29": ("AUTO", "SHARD_ON_HIDDEN", "SHARD_ON_INTERMEDIATE", "BASELINE_LNC1"),
    "092a49d": ("SHARD_ON_FREE", "SHARD_ON_HIDDEN", "SHARD_ON_BLOCK"),
}


def _round(x: torch.Tensor, compute_dtype: torch.dtype) -> torch.Tensor:
    """float64 rounded through the kernel's compute_dtype, as its matmul outputs are."""
    return x.to(compute_dtype).double()


def rope_hf(q, k, q_out, k_out, cos=None, sin=None, rope_cache=None, backward=False):
    assert q.dim() == 4 and k.dim() == 4 and q.shape[-1] == k.shape[-1]
    assert q.shape[0] == k.shape[0] and q.shape[2] == k.shape[2]
    assert q_out.shape == q.shape and k_out.shape == k.shape, "out buffers must match q and k"
    assert (rope_cache is None) != (cos is None and sin is None), "one cache form only"
    _, _, seq, dim = q.shape
    assert seq % (128 * nki.num_programs()) == 0, "seq_len % (128 * num_lnc_shards) == 0"
    # [optional(batch), seq, 2 * head_dim], cos first (core/embeddings/rope_hf.py docstring;
    # rope_hf_torch.py broadcasts a 2-D cache over the batch, a 3-D one is read per sample).
    assert rope_cache.dim() in (2, 3) and rope_cache.shape[-1] == 2 * dim
    assert rope_cache.dim() == 2 or rope_cache.shape[0] == q.shape[0], "one table per sample"
    assert rope_cache.shape[-2] >= seq and rope_cache.dtype == q.dtype
    table = rope_cache if rope_cache.dim() == 3 else rope_cache[None]
    cos = table[:, None, :seq, :dim].double()
    sin = table[:, None, :seq, dim:].double()
    half = dim // 2

    def rotate(x):
        x = x.double()
        if backward:  # the transposed rotation: rotate_half_backward(x * sin)
            xs = x * sin
            return x * cos + torch.cat([xs[..., half:], -xs[..., :half]], -1)
        return x * cos + torch.cat([-x[..., half:], x[..., :half]], -1) * sin

    q_out.copy_(rotate(q))
    k_out.copy_(rotate(k))
    return q_out, k_out


def _causal(scores):
    seq_q, seq_k = scores.shape[-2:]
    mask = torch.ones(seq_q, seq_k, dtype=torch.bool).tril()
    return scores.masked_fill(~mask, float("-inf"))


def attention_cte(
    q,
    k,
    v,
    scale=1.0,
    causal_mask=True,
    k_prior=None,
    v_prior=None,
    prior_used_len=None,
    sink=None,
    sliding_window=None,
    tp_q=True,
    tp_k=False,
    tp_out=False,
    cache_softmax=False,
    softmax_dtype="float32",
    mm_out_dtype="float32",
    cp_offset=None,
    global_cp_deg=None,
    cp_strided_q_slicing=False,
    bound_min=None,
    bound_max=None,
):
    unused = (k_prior, v_prior, prior_used_len, sink, sliding_window, cp_offset, global_cp_deg)
    assert all(x is None for x in unused) and not cp_strided_q_slicing
    assert bound_min is None and bound_max is None
    qs = q if tp_q else q.transpose(1, 2)  # (BH, S, d)
    ks = k.transpose(1, 2) if not tp_k else k  # tp_k=False: k is (BHkv, d, S)
    assert qs.shape[-1] <= 128 and qs.shape[0] <= 512
    assert v.shape == ks.shape and qs.shape[0] % ks.shape[0] == 0
    bh, seq, _ = qs.shape
    assert ks.shape[1] == seq
    group = bh // ks.shape[0]
    scores = scale * qs.double() @ ks.double().repeat_interleave(group, 0).transpose(1, 2)
    if causal_mask:
        scores = _causal(scores)
    row_max = scores.amax(-1, keepdim=True)
    row_sum = torch.exp(scores - row_max).sum(-1, keepdim=True)
    out = (torch.exp(scores - row_max) / row_sum) @ v.double().repeat_interleave(group, 0)
    out = (out.transpose(1, 2) if tp_out else out).to(q.dtype)
    if not cache_softmax:
        return out
    assert seq % 128 == 0

    def tiles(x):  # (BH, S, 1) -> [BH, 128, S/128], [i, p, g] <-> query g * 128 + p
        return x[..., 0].reshape(bh, seq // 128, 128).transpose(1, 2).float().contiguous()

    return out, tiles(-row_max), tiles(1.0 / row_sum)


def attention_bwd(
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
    assert sinks_ref is None and bound_min is None and bound_max is None and not sliding_window
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
    # The reference recomputes the probabilities; o_ref and lse_ref are the kernel's inputs, so
    # they are checked against the recomputation here (a wrong layout shows up).
    q, k, v = (t.double().transpose(2, 3) for t in (q_ref, k_ref, v_ref))
    scores = scale * q @ k.repeat_interleave(group, 1).transpose(2, 3)
    if use_causal_mask:
        scores = _causal(scores)
    lse = torch.logsumexp(scores, -1)
    tiles = lse_ref.double().transpose(2, 3).reshape(batch, heads, seq)
    assert torch.allclose(tiles, lse, atol=1e-4), "lse_ref is not logsumexp in tiles"
    probs = torch.exp(scores - lse[..., None])
    v_exp = v.repeat_interleave(group, 1)
    assert torch.allclose(probs @ v_exp, o_ref.double().transpose(2, 3), atol=1e-4), "o_ref"
    dy = dy_ref.double().transpose(2, 3)
    dprobs = dy @ v_exp.transpose(2, 3)
    dscores = probs * (dprobs - (dprobs * probs).sum(-1, keepdim=True))
    dq = scale * dscores @ k.repeat_interleave(group, 1)
    dk = scale * dscores.transpose(2, 3) @ q
    dv = probs.transpose(2, 3) @ dy

    def per_kv_head(x):  # a kv head's gradient sums its query heads
        return x.reshape(batch, kv_heads, group, seq, dim).sum(2)

    return tuple(
        t.transpose(2, 3).to(q_ref.dtype).contiguous()
        for t in (dq, per_kv_head(dk), per_kv_head(dv))
    )


def _moe_inputs(hidden_states, expert_affinities_masked, gate_up, down, tpid, b2e, block_size):
    """The shared layout checks of moe_cte and blockwise_mm_bwd (T+1 rows, flat affinities)."""
    rows, hidden = hidden_states.shape
    experts, hidden2, two, inter = gate_up.shape
    assert hidden2 == hidden and two == 2 and down.shape == (experts, inter, hidden)
    assert torch.all(hidden_states[-1] == 0), "row T of hidden_states is the zero padding row"
    assert expert_affinities_masked.shape == (rows * experts, 1)
    assert torch.all(expert_affinities_masked.view(rows, experts)[-1] == 0)
    assert tpid.dtype == torch.int32 and b2e.dtype == torch.int32
    assert b2e.dim() == 2 and b2e.shape[1] == 1, "block_to_expert is [N, 1]"
    assert tpid.shape == (b2e.shape[0] * block_size,)
    assert torch.all(b2e[1:] >= b2e[:-1]), "block_to_expert is non-decreasing"
    assert int(tpid.min()) >= 0 and int(tpid.max()) <= rows - 1
    return experts, inter, expert_affinities_masked.double().view(rows, experts)


def _blocks(tpid, b2e, block_size):
    for n, expert in enumerate(b2e[:, 0].tolist()):
        yield n, expert, tpid[n * block_size : (n + 1) * block_size].long()


def build(generation: str = "2.29") -> dict[str, types.SimpleNamespace]:
    """The fake library of `generation` (GENERATIONS): {module path: namespace of its names}."""

    class MoECTEImplementation(enum.Enum):
        shard_on_block = 0
        shard_on_i = 1
        shard_on_i_hybrid = 2
        shard_on_i_dropping = 3

    class ExpertAffinityScaleMode(enum.Enum):
        NO_SCALE = 0
        POST_SCALE = 1
        PRE_SCALE = 2
        PRE_SCALE_DELAYED = 3

    class ActFnType(enum.Enum):
        SiLU = 0
        GELU = 1
        GELU_Tanh_Approx = 2
        Swish = 3

    @dataclasses.dataclass
    class ShardOnIConfig:  # a mutable dataclass, as in nki-library: not hashable
        checkpoint_activation: bool = False
        expert_affinity_multiply_on_I: bool = False
        num_static_block: int | None = None

    @dataclasses.dataclass
    class MoECTESpec:
        implementation: MoECTEImplementation
        shard_on_block: object = None
        shard_on_I: ShardOnIConfig | None = None

    ShardOption = enum.Enum("ShardOption", SHARD_OPTIONS[generation], start=0)

    class AffinityOption(enum.Enum):
        AFFINITY_ON_H = 0
        AFFINITY_ON_I = 1

    class KernelTypeOption(enum.Enum):
        DROPPING = 0
        DROPLESS = 1

    @nki.jit(mode="trace")
    def moe_cte(
        hidden_states,
        expert_affinities_masked,
        gate_up_proj_weight,
        down_proj_weight,
        token_position_to_id,
        block_to_expert,
        block_size,
        spec,
        conditions=None,
        gate_and_up_proj_bias=None,
        down_proj_bias=None,
        quantization_config=None,
        gate_up_activations_T=None,
        down_activations=None,
        activation_function=ActFnType.SiLU,
        skip_dma=None,
        compute_dtype=language.bfloat16,
        is_tensor_update_accumulating=True,
        expert_affinities_scaling_mode=ExpertAffinityScaleMode.POST_SCALE,
        gate_clamp_upper_limit=None,
        gate_clamp_lower_limit=None,
        up_clamp_upper_limit=None,
        up_clamp_lower_limit=None,
    ):
        assert isinstance(spec, MoECTESpec), "spec is a MoECTESpec"
        assert spec.implementation == MoECTEImplementation.shard_on_i, "this fake: shard_on_i"
        config = spec.shard_on_I or ShardOnIConfig()
        assert activation_function == ActFnType.SiLU
        assert expert_affinities_scaling_mode in ExpertAffinityScaleMode
        assert conditions is None and quantization_config is None
        assert gate_and_up_proj_bias is None and down_proj_bias is None
        _, inter, affinity = _moe_inputs(
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
        x_all = hidden_states.double()
        w_gate_up, w_down = gate_up_proj_weight.double(), down_proj_weight.double()
        out = torch.zeros_like(x_all)
        n = block_to_expert.shape[0]
        gate_up_t = torch.zeros(n, 2, inter, block_size, dtype=torch.float64)
        down_act = torch.zeros(n, block_size, hidden, dtype=torch.float64)
        post = expert_affinities_scaling_mode == ExpertAffinityScaleMode.POST_SCALE
        for b, e, ids in _blocks(token_position_to_id, block_to_expert, block_size):
            x = x_all[ids]
            if not post and expert_affinities_scaling_mode != ExpertAffinityScaleMode.NO_SCALE:
                x = x * affinity[ids, e][:, None]
            pre = _round(x @ w_gate_up[e].reshape(hidden, 2 * inter), compute_dtype)
            gate, up = pre.view(block_size, 2, inter).unbind(1)
            gate_up_t[b] = torch.stack([gate.T, up.T])
            down_act[b] = _round((F.silu(gate) * up) @ w_down[e], compute_dtype)
            scaled = down_act[b] * affinity[ids, e][:, None] if post else down_act[b]
            out.index_add_(0, ids, scaled)
        dtype = hidden_states.dtype
        if not config.checkpoint_activation:
            return out.to(dtype)
        if config.expert_affinity_multiply_on_I:
            return out.to(dtype), gate_up_t.to(dtype)
        return out.to(dtype), gate_up_t.to(dtype), down_act.to(dtype)

    def bwd_numbers(args):
        """The shared checks and float64 numbers of both generations' blockwise_mm_bwd."""
        _, inter, affinity = _moe_inputs(
            args["hidden_states"],
            args["expert_affinities_masked"],
            args["gate_up_proj_weight"],
            args["down_proj_weight"],
            args["token_position_to_id"],
            args["block_to_expert"],
            args["block_size"],
        )
        assert args["kernel_type_option"] == KernelTypeOption.DROPLESS and not args["bias"]
        assert args["activation_type"] == ActFnType.SiLU and args["clamp_limits"] is None
        hidden_states, grad_out = args["hidden_states"], args["output_hidden_states_grad"]
        block_size, compute_dtype = args["block_size"], args["compute_dtype"]
        hidden = hidden_states.shape[1]
        assert grad_out.shape == hidden_states.shape
        assert torch.all(grad_out[-1] == 0), "row T of dOut must be zero"
        n = args["block_to_expert"].shape[0]
        gate_up_ckpt, down_ckpt = (
            args["gate_up_proj_act_checkpoint_T"],
            args["down_proj_act_checkpoint"],
        )
        assert gate_up_ckpt.shape == (n, 2, inter, block_size)
        assert down_ckpt.shape == (n, block_size, hidden)
        x_all, grad = hidden_states.double(), grad_out.double()
        w_gate_up = args["gate_up_proj_weight"].double()
        w_down = args["down_proj_weight"].double()
        d_hidden = torch.zeros_like(x_all)
        d_affinity = torch.zeros_like(affinity)
        d_gate_up = torch.zeros_like(w_gate_up)
        d_down = torch.zeros_like(w_down)
        # From the checkpoints, as the golden does: no forward recompute; affinity on H.
        for b, e, ids in _blocks(args["token_position_to_id"], args["block_to_expert"], block_size):
            g = grad[ids]
            d_affinity[ids, e] = (g * down_ckpt[b].double()).sum(-1)
            g_down = g * affinity[ids, e][:, None]
            gate, up = gate_up_ckpt[b].double().transpose(1, 2).unbind(0)
            sig = torch.sigmoid(gate)
            d_down[e] += (gate * sig * up).T @ g_down
            d_act = _round(g_down @ w_down[e].T, compute_dtype)
            d_gate = d_act * up * sig * (1 + gate * (1 - sig))
            d_up = d_act * gate * sig
            x = x_all[ids]
            d_gate_up[e, :, 0] += x.T @ d_gate
            d_gate_up[e, :, 1] += x.T @ d_up
            d_hidden.index_add_(0, ids, d_gate @ w_gate_up[e, :, 0].T + d_up @ w_gate_up[e, :, 1].T)
        return (
            d_hidden.to(hidden_states.dtype),
            d_affinity.reshape(-1, 1).to(args["expert_affinities_masked"].dtype),
            d_gate_up.to(args["gate_up_proj_weight"].dtype),
            d_down.to(args["down_proj_weight"].dtype),
        )

    def validate_2_29(block_size, hidden, inter, shards):
        # MOEBwdParameters.validate / validate_sharding (moe_bwd_parameters.py, 2.29)
        assert block_size in (128, 256, 512, 1024)
        assert inter % 2 == 0 and hidden % 2 == 0 and hidden % shards == 0
        assert (hidden // shards) % 32 == 0 and (inter // shards) % 32 == 0

    @nki.jit
    def blockwise_mm_bwd_2_29(
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
        skip_dma=None,
        compute_dtype=language.bfloat16,
        is_tensor_update_accumulating=True,
        shard_option=ShardOption.SHARD_ON_HIDDEN,
        affinity_option=AffinityOption.AFFINITY_ON_H,
        kernel_type_option=KernelTypeOption.DROPLESS,
        clamp_limits=None,
        bias=False,
        activation_type=ActFnType.SiLU,
        block_tile_size=None,
    ):
        # shard_option and affinity_option are accepted and never read (blockwise_mm_backward.py
        # builds MOEBwdParameters without them, 2.28, 2.29 and main of April 2026).
        args = dict(locals())
        inter = down_proj_weight.shape[1]
        validate_2_29(block_size, hidden_states.shape[1], inter, nki.num_programs())
        return bwd_numbers(args)

    @nki.jit
    def blockwise_mm_bwd_092a49d(
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
        skip_dma=None,
        compute_dtype=language.bfloat16,
        is_tensor_update_accumulating=True,
        skip_grad_initialization=False,
        shard_option=ShardOption.SHARD_ON_HIDDEN,
        affinity_option=AffinityOption.AFFINITY_ON_H,
        kernel_type_option=KernelTypeOption.DROPLESS,
        clamp_limits=None,
        bias=False,
        activation_type=ActFnType.SiLU,
        block_tile_size=None,
        blocking_params=None,
        hidden_states_grad_out=None,
        expert_affinities_masked_grad_out=None,
        gate_up_proj_weight_grad_out=None,
        down_proj_weight_grad_out=None,
        accumulation_dtype=None,
    ):
        # Both options now reach MOEBwdParameters, whose validate() and validate_sharding()
        # read them (experimental/moe/bwd/moe_bwd_parameters.py at 092a49d).
        args = dict(locals())
        assert not skip_grad_initialization and blocking_params is None
        assert all(
            out is None
            for out in (
                hidden_states_grad_out,
                expert_affinities_masked_grad_out,
                gate_up_proj_weight_grad_out,
                down_proj_weight_grad_out,
            )
        )
        hidden, inter = hidden_states.shape[1], down_proj_weight.shape[1]
        shards = nki.num_programs()
        assert block_size in (128, 256, 512, 1024), "block_size must be 128, 256, 512, or 1024"
        assert inter % 2 == 0 and hidden % 2 == 0
        if shard_option == ShardOption.SHARD_ON_HIDDEN:
            assert affinity_option == AffinityOption.AFFINITY_ON_I, (
                "SHARD_ON_HIDDEN only supports AFFINITY_ON_I"
            )
        assert hidden % shards == 0 and (hidden // shards) % 32 == 0
        if shard_option != ShardOption.SHARD_ON_HIDDEN and (inter // shards) % 32 != 0:
            assert block_size == 128, "I_TP sharded by the LNC must be a multiple of 32"
        # AFFINITY_ON_I scales on the intermediate dim and drops the down checkpoint: a
        # different contract from moe_cte's POST_SCALE, which this double does not compute.
        assert affinity_option == AffinityOption.AFFINITY_ON_H, "this double: AFFINITY_ON_H"
        return bwd_numbers(args)

    blockwise_mm_bwd = (
        blockwise_mm_bwd_092a49d if generation == "092a49d" else blockwise_mm_bwd_2_29
    )
    blockwise_mm_bwd.__name__ = "blockwise_mm_bwd"

    moe = types.SimpleNamespace(
        moe_cte=moe_cte,
        MoECTESpec=MoECTESpec,
        MoECTEImplementation=MoECTEImplementation,
        ShardOnIConfig=ShardOnIConfig,
        ExpertAffinityScaleMode=ExpertAffinityScaleMode,
        ActFnType=ActFnType,
    )
    bwd = types.SimpleNamespace(
        blockwise_mm_bwd=blockwise_mm_bwd,
        ShardOption=ShardOption,
        AffinityOption=AffinityOption,
        KernelTypeOption=KernelTypeOption,
        ActFnType=ActFnType,
    )
    return {
        "nkilib.core.embeddings.rope_hf": types.SimpleNamespace(rope_hf=nki.jit(rope_hf)),
        "nkilib.core.attention.attention_cte": types.SimpleNamespace(
            attention_cte=nki.jit(attention_cte)
        ),
        "nkilib.core.attention.attention_bwd": types.SimpleNamespace(
            attention_bwd=nki.jit(attention_bwd)
        ),
        "nkilib.core.utils.common_types": types.SimpleNamespace(
            ExpertAffinityScaleMode=ExpertAffinityScaleMode, ActFnType=ActFnType
        ),
        "nkilib.core.moe.moe_cte.moe_cte": moe,
        "nkilib.experimental.moe.bwd.blockwise_mm_backward": bwd,
        "nkilib.experimental.moe.bwd.moe_bwd_parameters": bwd,
    }
