"""Grouped experts as `qwentitan::grouped_experts` + backward, after the NKI blockwise-matmul contract.

Tokens are grouped by expert into fixed-size blocks (dropless, padded): `token_position_to_id`
(int32, num_blocks * block_size) names the token in each block slot, `num_tokens` marking an
empty slot; `block_to_expert` (int32, num_blocks) is non-decreasing, leftover blocks go to the
last expert. Per block: out[ids] += ((silu(h Wg) * (h Wu)) Wd) * affinity[ids, e] (affinity
applied after the down projection, POST_SCALE). Weights: gate_up (experts, hidden, 2, inter),
gate at index 0, up at 1; down (experts, inter, hidden). The forward also returns the
checkpoints the backward consumes: gate/up pre-activations (blocks, 2, inter, block_size) and
the pre-affinity down projection (blocks, block_size, hidden).
"""

from __future__ import annotations

import math

import torch

from qwentitan.kernels import nki_loader
from qwentitan.kernels.errors import KernelError
from qwentitan.kernels.neuron_dispatch import register_neuron_impl


def num_blocks(num_assignments: int, num_experts: int, block_size: int) -> int:
    """Worst-case block count for `num_assignments` = tokens x top_k (dropless routing)."""
    spare = num_experts - 1
    return max(math.ceil((num_assignments - spare) / block_size), 0) + spare


def block_routing(
    expert_ids: torch.Tensor, num_experts: int, block_size: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """(token_position_to_id, block_to_expert) for a (tokens, top_k) expert choice.

    Static shapes (no host sync), so it compiles with fullgraph and Neuron's static shapes.
    Each expert fills its blocks in ascending token id; empty slots hold `tokens`.
    """
    if expert_ids.dim() == 1:
        expert_ids = expert_ids[:, None]
    tokens, top_k = expert_ids.shape
    blocks = num_blocks(tokens * top_k, num_experts, block_size)
    device = expert_ids.device
    flat = expert_ids.reshape(-1).long()
    counts = torch.bincount(flat, minlength=num_experts)[:num_experts]
    blocks_per_expert = (counts + block_size - 1) // block_size
    block_end = torch.cumsum(blocks_per_expert, 0)
    block_start = block_end - blocks_per_expert
    # Stable sort keeps ascending token id within an expert (flat index = token * top_k + k).
    order = torch.argsort(flat, stable=True)
    sorted_experts = flat[order]
    first_of_expert = torch.cumsum(counts, 0) - counts
    rank = torch.arange(flat.numel(), device=device) - first_of_expert[sorted_experts]
    slot = block_start[sorted_experts] * block_size + rank
    token_position_to_id = torch.full(
        (blocks * block_size,), tokens, dtype=torch.long, device=device
    )
    token_position_to_id = token_position_to_id.scatter(0, slot, order // top_k)
    block_ids = torch.arange(blocks, device=device)
    block_to_expert = torch.searchsorted(block_end, block_ids, right=True).clamp(
        max=num_experts - 1
    )
    return token_position_to_id.to(torch.int32), block_to_expert.to(torch.int32)


def _check(hidden, affinities, gate_up, down, token_position_to_id, block_to_expert, block_size):
    tokens, hidden_dim = hidden.shape
    experts = gate_up.shape[0]
    if gate_up.dim() != 4 or gate_up.shape[1] != hidden_dim or gate_up.shape[2] != 2:
        raise KernelError(
            f"grouped_experts gate_up weight has shape {tuple(gate_up.shape)}, expected "
            f"(experts, {hidden_dim}, 2, inter); stack gate and up on dim 2."
        )
    if tuple(down.shape) != (experts, gate_up.shape[3], hidden_dim):
        raise KernelError(
            f"grouped_experts down weight has shape {tuple(down.shape)}, expected "
            f"{(experts, gate_up.shape[3], hidden_dim)}; pass (experts, inter, hidden)."
        )
    if tuple(affinities.shape) != (tokens, experts):
        raise KernelError(
            f"grouped_experts affinities have shape {tuple(affinities.shape)}, expected "
            f"{(tokens, experts)}: one routing weight per token and expert, 0 where unrouted."
        )
    if token_position_to_id.numel() != block_to_expert.numel() * block_size:
        raise KernelError(
            f"token_position_to_id has {token_position_to_id.numel()} slots but there are "
            f"{block_to_expert.numel()} blocks of {block_size}; build both with block_routing()."
        )


def _routed_slots(token_position_to_id, block_to_expert, tokens, num_experts, block_size):
    """The occupied slots grouped by expert: slots, their token ids and experts, rows per expert.

    Empty slots are left out, so padding costs no matmul. The row counts go to the host, since
    the per-expert matmuls slice by them; this runs inside the custom op, which torch.compile
    treats as opaque (shapes come from the fake implementation), so the sync breaks no graph.
    """
    ids = token_position_to_id.long()
    slot_expert = block_to_expert.long().repeat_interleave(block_size)
    slots = torch.nonzero(ids < tokens).squeeze(1)
    # block_to_expert is non-decreasing by contract, so this stable sort is a cheap no-op then;
    # it keeps any block order correct.
    slots = slots[torch.argsort(slot_expert[slots], stable=True)]
    experts = slot_expert[slots]
    counts = torch.bincount(experts, minlength=num_experts).tolist()
    return slots, ids[slots], experts, counts


def _per_expert(counts):
    start = 0
    for expert, count in enumerate(counts):
        if count:
            yield expert, slice(start, start + count)
        start += count


def _gemm_dtype(x):
    # PyTorch's cpu GEMM for bfloat16 / float16 falls back to a generic loop on cpus without
    # bf16 instructions (about 20x slower than float32 on the benchmark's AVX2 machine).
    # Products of half-precision numbers are exact in float32, so a float32 GEMM of the upcast
    # operands, rounded once, is a half-precision GEMM with float32 accumulation (PSUM on
    # Trainium): only the summation order differs.
    half = x.dtype in (torch.bfloat16, torch.float16)
    return torch.float32 if half and x.device.type == "cpu" else x.dtype


def _per_expert_mm(x, weights, counts):
    """x's rows (grouped by expert, counts[e] each) times weights[e]: one matmul per expert.

    Each expert's weights are a view, never a copy.
    """
    dtype, acc = x.dtype, _gemm_dtype(x)
    x, weights = x.to(acc), weights.to(acc)
    out = x.new_empty(x.shape[0], weights.shape[-1])
    for expert, rows in _per_expert(counts):
        torch.mm(x[rows], weights[expert], out=out[rows])
    return out.to(dtype)


def _per_expert_weight_grad(x, grad, counts, num_experts):
    """sum over each expert's rows of x^T grad: (experts, x cols, grad cols), 0 for idle experts."""
    dtype, acc = x.dtype, _gemm_dtype(x)
    x, grad = x.to(acc), grad.to(acc)
    out = x.new_zeros(num_experts, x.shape[1], grad.shape[1])
    for expert, rows in _per_expert(counts):
        torch.mm(x[rows].t(), grad[rows], out=out[expert])
    return out.to(dtype)


def _to_slots(rows, slots, num_slots):
    # Empty slots hold zeros, what a zero padding row gives through the matmuls.
    return rows.new_zeros(num_slots, rows.shape[1]).index_copy_(0, slots, rows)


def grouped_experts_reference(
    hidden, affinities, gate_up, down, token_position_to_id, block_to_expert, block_size
):
    """Reference twin: one matmul per expert and projection over the expert's occupied slots."""
    _check(hidden, affinities, gate_up, down, token_position_to_id, block_to_expert, block_size)
    tokens, hidden_dim = hidden.shape
    experts, inter = gate_up.shape[0], gate_up.shape[3]
    slots, ids, expert_of, counts = _routed_slots(
        token_position_to_id, block_to_expert, tokens, experts, block_size
    )
    x = hidden[ids]
    pre = _per_expert_mm(x, gate_up.reshape(experts, hidden_dim, 2 * inter), counts)
    gate, up = pre.view(-1, 2, inter).unbind(1)
    down_act = _per_expert_mm(torch.nn.functional.silu(gate) * up, down, counts)
    scaled = down_act * affinities[ids, expert_of][:, None].to(down_act.dtype)
    out = hidden.new_zeros(tokens, hidden_dim).index_add_(0, ids, scaled)
    n = block_to_expert.shape[0]
    pre_slots = _to_slots(pre, slots, n * block_size).view(n, block_size, 2, inter)
    down_slots = _to_slots(down_act, slots, n * block_size).view(n, block_size, hidden_dim)
    return out, pre_slots.permute(0, 2, 3, 1).contiguous(), down_slots


def grouped_experts_backward_reference(
    grad_out,
    hidden,
    affinities,
    gate_up,
    down,
    gate_up_activations,
    down_activations,
    token_position_to_id,
    block_to_expert,
    block_size,
):
    """Reference twin of the backward, from the forward checkpoints (no forward recompute)."""
    _check(hidden, affinities, gate_up, down, token_position_to_id, block_to_expert, block_size)
    tokens, hidden_dim = hidden.shape
    experts, inter = gate_up.shape[0], gate_up.shape[3]
    slots, ids, expert_of, counts = _routed_slots(
        token_position_to_id, block_to_expert, tokens, experts, block_size
    )
    g = grad_out[ids]
    # d affinity[t, e] = sum_h dOut[t, h] * down_act[slot, h]
    down_act = down_activations.reshape(-1, hidden_dim)[slots]
    grad_aff = affinities.new_zeros(tokens, experts)
    grad_aff.index_put_((ids, expert_of), (g * down_act).sum(-1).to(affinities.dtype), True)
    g_down = g * affinities[ids, expert_of][:, None].to(g.dtype)
    # (blocks, 2, inter, block) checkpoint -> (rows, 2, inter), gathering only occupied slots.
    pre = gate_up_activations[slots // block_size, :, :, slots % block_size]
    gate, up = pre.unbind(1)
    sig = torch.sigmoid(gate)
    silu = gate * sig
    act = silu * up
    grad_down = _per_expert_weight_grad(act, g_down, counts, experts)
    grad_act = _per_expert_mm(g_down, down.transpose(1, 2), counts)
    grad_gate = grad_act * up * sig * (1 + gate * (1 - sig))
    grad_pre = torch.stack([grad_gate, grad_act * silu], dim=1).view(-1, 2 * inter)
    w = gate_up.reshape(experts, hidden_dim, 2 * inter)
    grad_gate_up = _per_expert_weight_grad(hidden[ids], grad_pre, counts, experts)
    grad_x = _per_expert_mm(grad_pre, w.transpose(1, 2), counts)
    grad_hidden = hidden.new_zeros(tokens, hidden_dim).index_add_(0, ids, grad_x)
    return (
        grad_hidden,
        grad_aff,
        grad_gate_up.view(experts, hidden_dim, 2, inter),
        grad_down,
    )


def _check_nki(hidden, gate_up, block_size, backward):
    hidden_dim, inter = hidden.shape[1], gate_up.shape[3]
    lnc = nki_loader.logical_core_count()
    problems = []
    if block_size % 256 != 0 or block_size not in (256, 512, 1024):
        problems.append(f"block_size {block_size} must be 256, 512 or 1024")
    if not 512 <= hidden_dim <= 8192 or hidden_dim % 512 != 0:
        problems.append(f"hidden {hidden_dim} must be a multiple of 512 in [512, 8192]")
    if inter % 16 != 0:
        problems.append(f"intermediate {inter} must be a multiple of 16")
    if backward and ((hidden_dim // lnc) % 32 != 0 or (inter // lnc) % 32 != 0):
        problems.append(f"hidden / LNC and intermediate / LNC must be multiples of 32 (LNC={lnc})")
    if problems:
        raise KernelError(
            "the NKI blockwise-matmul kernels cannot take this shape: "
            + "; ".join(problems)
            + "; use the reference path (cpu/cuda) or change the expert dims."
        )
    return lnc


def _nki_inputs(hidden, affinities, token_position_to_id, block_to_expert):
    # The kernels read a zero row `tokens` for empty slots and flat (token * E + e) affinities.
    padded = torch.cat([hidden, hidden.new_zeros(1, hidden.shape[1])])
    padded_aff = torch.cat([affinities, affinities.new_zeros(1, affinities.shape[1])])
    return (
        padded.contiguous(),
        padded_aff.to(hidden.dtype).reshape(-1, 1).contiguous(),
        token_position_to_id.to(torch.int32).contiguous(),
        block_to_expert.to(torch.int32).reshape(-1, 1).contiguous(),
    )


def grouped_experts_nki(
    hidden, affinities, gate_up, down, token_position_to_id, block_to_expert, block_size
):
    """The call into nkilib moe_cte (shard on intermediate, activation checkpoints, POST_SCALE)."""
    _check(hidden, affinities, gate_up, down, token_position_to_id, block_to_expert, block_size)
    lnc = _check_nki(hidden, gate_up, block_size, backward=False)
    padded, flat_aff, ids, experts = _nki_inputs(
        hidden, affinities, token_position_to_id, block_to_expert
    )
    out, gate_up_act, down_act = nki_loader.launch(
        "moe_blockwise_fwd",
        lnc,
        hidden_states=padded,
        expert_affinities_masked=flat_aff,
        gate_up_proj_weight=gate_up.contiguous(),
        down_proj_weight=down.contiguous(),
        token_position_to_id=ids,
        block_to_expert=experts,
        block_size=block_size,
        # Both kernels default compute_dtype to bfloat16; the twin computes in the activations'.
        compute_dtype=nki_loader.nki_dtype_name(hidden.dtype),
    )
    return out[: hidden.shape[0]].contiguous(), gate_up_act, down_act


def grouped_experts_backward_nki(
    grad_out,
    hidden,
    affinities,
    gate_up,
    down,
    gate_up_activations,
    down_activations,
    token_position_to_id,
    block_to_expert,
    block_size,
):
    """The call into nkilib blockwise_mm_bwd; the padding row of every gradient is dropped."""
    _check(hidden, affinities, gate_up, down, token_position_to_id, block_to_expert, block_size)
    lnc = _check_nki(hidden, gate_up, block_size, backward=True)
    padded, flat_aff, ids, experts = _nki_inputs(
        hidden, affinities, token_position_to_id, block_to_expert
    )
    tokens = hidden.shape[0]
    grad_padded = torch.cat([grad_out, grad_out.new_zeros(1, grad_out.shape[1])])
    grads = nki_loader.launch(
        "moe_blockwise_bwd",
        lnc,
        hidden_states=padded,
        expert_affinities_masked=flat_aff,
        gate_up_proj_weight=gate_up.contiguous(),
        down_proj_weight=down.contiguous(),
        gate_up_proj_act_checkpoint_T=gate_up_activations.contiguous(),
        down_proj_act_checkpoint=down_activations.contiguous(),
        token_position_to_id=ids,
        block_to_expert=experts,
        output_hidden_states_grad=grad_padded.to(hidden.dtype).contiguous(),
        block_size=block_size,
        # Top-k > 1 sums several experts into one row; accumulating is also right for top-1
        # (into zeros) and avoids a host sync to find out which case this is.
        is_tensor_update_accumulating=True,
        compute_dtype=nki_loader.nki_dtype_name(hidden.dtype),
    )
    grad_hidden, grad_flat_aff, grad_gate_up, grad_down = grads[:4]
    grad_aff = grad_flat_aff.reshape(tokens + 1, -1)[:tokens].to(affinities.dtype)
    return grad_hidden[:tokens].contiguous(), grad_aff.contiguous(), grad_gate_up, grad_down


@torch.library.custom_op("qwentitan::grouped_experts", mutates_args=())
def grouped_experts_op(
    hidden_states: torch.Tensor,
    expert_affinities: torch.Tensor,
    gate_up_weight: torch.Tensor,
    down_weight: torch.Tensor,
    token_position_to_id: torch.Tensor,
    block_to_expert: torch.Tensor,
    block_size: int,
    use_nki: bool = True,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    return grouped_experts_reference(
        hidden_states,
        expert_affinities,
        gate_up_weight,
        down_weight,
        token_position_to_id,
        block_to_expert,
        block_size,
    )


@torch.library.custom_op("qwentitan::grouped_experts_backward", mutates_args=())
def grouped_experts_backward_op(
    grad_out: torch.Tensor,
    hidden_states: torch.Tensor,
    expert_affinities: torch.Tensor,
    gate_up_weight: torch.Tensor,
    down_weight: torch.Tensor,
    gate_up_activations: torch.Tensor,
    down_activations: torch.Tensor,
    token_position_to_id: torch.Tensor,
    block_to_expert: torch.Tensor,
    block_size: int,
    use_nki: bool = True,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    return grouped_experts_backward_reference(
        grad_out,
        hidden_states,
        expert_affinities,
        gate_up_weight,
        down_weight,
        gate_up_activations,
        down_activations,
        token_position_to_id,
        block_to_expert,
        block_size,
    )


@grouped_experts_op.register_fake
def _(
    hidden,
    affinities,
    gate_up,
    down,
    token_position_to_id,
    block_to_expert,
    block_size,
    use_nki=True,
):
    _check(hidden, affinities, gate_up, down, token_position_to_id, block_to_expert, block_size)
    n, inter = block_to_expert.shape[0], gate_up.shape[3]
    return (
        hidden.new_empty(hidden.shape),
        hidden.new_empty((n, 2, inter, block_size)),
        hidden.new_empty((n, block_size, hidden.shape[1])),
    )


@grouped_experts_backward_op.register_fake
def _(
    grad_out,
    hidden,
    affinities,
    gate_up,
    down,
    gu_act,
    down_act,
    tpid,
    b2e,
    block_size,
    use_nki=True,
):
    _check(hidden, affinities, gate_up, down, tpid, b2e, block_size)
    return tuple(x.new_empty(x.shape) for x in (hidden, affinities, gate_up, down))


def _setup_context(ctx, inputs, output):
    hidden, affinities, gate_up, down, tpid, b2e, block_size, use_nki = inputs
    _, gate_up_act, down_act = output
    ctx.save_for_backward(hidden, affinities, gate_up, down, gate_up_act, down_act, tpid, b2e)
    ctx.block_size, ctx.use_nki = block_size, use_nki
    ctx.mark_non_differentiable(gate_up_act, down_act)


def _backward(ctx, grad_out, _grad_gate_up_act, _grad_down_act):
    hidden, affinities, gate_up, down, gate_up_act, down_act, tpid, b2e = ctx.saved_tensors
    grads = torch.ops.qwentitan.grouped_experts_backward(
        grad_out.contiguous(),
        hidden,
        affinities,
        gate_up,
        down,
        gate_up_act,
        down_act,
        tpid,
        b2e,
        ctx.block_size,
        ctx.use_nki,
    )
    return (*grads, None, None, None, None)


grouped_experts_op.register_autograd(_backward, setup_context=_setup_context)
register_neuron_impl("grouped_experts", grouped_experts_nki, grouped_experts_reference)
register_neuron_impl(
    "grouped_experts_backward", grouped_experts_backward_nki, grouped_experts_backward_reference
)


def grouped_experts(
    hidden_states: torch.Tensor,
    expert_affinities: torch.Tensor,
    gate_up_weight: torch.Tensor,
    down_weight: torch.Tensor,
    token_position_to_id: torch.Tensor,
    block_to_expert: torch.Tensor,
    block_size: int,
    *,
    use_nki: bool = True,
) -> torch.Tensor:
    """SwiGLU experts over (tokens, hidden) with block routing; returns (tokens, hidden).

    `use_nki=False` runs the reference twin on a neuron device too (the fallback switch).
    """
    return torch.ops.qwentitan.grouped_experts(
        hidden_states,
        expert_affinities,
        gate_up_weight,
        down_weight,
        token_position_to_id,
        block_to_expert,
        block_size,
        use_nki,
    )[0]
