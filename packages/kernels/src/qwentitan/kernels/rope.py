"""RoPE as the `qwentitan::rope` op, following nkilib `rope_hf` (HF rotate-half convention).

Inputs use torchtitan's layout: query (batch, seq, q_heads, head_dim), key (batch, seq,
kv_heads, head_dim), and torchtitan's CosSinRoPE cache (max_seq_len, 2 * head_dim), cos first,
or one table per sample (batch, max_seq_len, 2 * head_dim): both are rope_hf's `rope_cache`
forms (nki-library core/embeddings/rope_hf.py), so per-sample positions still take one kernel
launch. Gather-free: row i of a table is position i, the cache is only narrowed, never indexed
by a position tensor. Computed in the query's dtype, as the kernel
does, with the cache cast to it. The cache gets no gradient; the backward is the same rotation
transposed (rope_hf with backward=True).
"""

from __future__ import annotations

import torch

from qwentitan.kernels import nki_loader
from qwentitan.kernels.errors import KernelError
from qwentitan.kernels.neuron_dispatch import register_neuron_impl


def _check(query: torch.Tensor, key: torch.Tensor, rope_cache: torch.Tensor) -> None:
    if query.dim() != 4 or key.dim() != 4:
        raise KernelError(
            f"rope takes 4-D (batch, seq, heads, head_dim) query and key, got {tuple(query.shape)} "
            f"and {tuple(key.shape)}; reshape them to torchtitan's layout."
        )
    batch, seq, _, head_dim = query.shape
    if key.shape[0] != batch or key.shape[1] != seq or key.shape[3] != head_dim:
        raise KernelError(
            f"rope key {tuple(key.shape)} does not match query {tuple(query.shape)} in batch, seq "
            "or head_dim; pass the key of the same attention call."
        )
    batched = rope_cache.dim() == 3 and rope_cache.shape[0] == batch
    if not (rope_cache.dim() == 2 or batched) or rope_cache.shape[-1] != 2 * head_dim:
        raise KernelError(
            f"rope cache has shape {tuple(rope_cache.shape)}, expected (max_seq_len, {2 * head_dim}) "
            f"or ({batch}, max_seq_len, {2 * head_dim}) with cos first; pass torchtitan's "
            "CosSinRoPE cache or one table per sample."
        )
    if rope_cache.shape[-2] < seq:
        raise KernelError(
            f"rope cache covers {rope_cache.shape[-2]} positions but the sequence has {seq}; "
            "raise the RoPE max_seq_len to at least the training seq_len."
        )


def _cos_sin(rope_cache: torch.Tensor, seq: int, head_dim: int, dtype: torch.dtype):
    cache = rope_cache.narrow(-2, 0, seq).to(dtype)
    # ([batch,] seq, 1, head_dim): broadcasts over batch and heads of the (b, s, h, d) layout.
    return cache[..., None, :head_dim], cache[..., None, head_dim:]


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def _rotate_half_transposed(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((x2, -x1), dim=-1)


def _combine(x_cos: torch.Tensor, rotated_sin: torch.Tensor) -> torch.Tensor:
    # In place on the fresh products: the same roundings as `x_cos + rotated_sin`, one
    # full-size allocation fewer (memory traffic is all this op costs on cpu).
    return x_cos.add_(rotated_sin).contiguous()


def rope_reference(query: torch.Tensor, key: torch.Tensor, rope_cache: torch.Tensor):
    """Reference twin: y = x * cos + rotate_half(x) * sin, in the operation order of torchtitan."""
    _check(query, key, rope_cache)
    cos, sin = _cos_sin(rope_cache, query.shape[1], query.shape[3], query.dtype)
    q_out = _combine(query * cos, _rotate_half(query).mul_(sin))
    k_out = _combine(key * cos, _rotate_half(key).mul_(sin))
    return q_out, k_out


def rope_backward_reference(grad_q: torch.Tensor, grad_k: torch.Tensor, rope_cache: torch.Tensor):
    """Reference twin of the backward: dx = dy * cos + cat(dy2 * sin2, -dy1 * sin1)."""
    _check(grad_q, grad_k, rope_cache)
    cos, sin = _cos_sin(rope_cache, grad_q.shape[1], grad_q.shape[3], grad_q.dtype)
    dq = _combine(grad_q * cos, _rotate_half_transposed(grad_q * sin))
    dk = _combine(grad_k * cos, _rotate_half_transposed(grad_k * sin))
    return dq, dk


def rope_nki(query: torch.Tensor, key: torch.Tensor, rope_cache: torch.Tensor, backward: bool):
    """The call into nkilib `rope_hf`: (b, s, h, d) -> (b, h, s, d), caller-provided out buffers."""
    _check(query, key, rope_cache)
    seq = query.shape[1]
    lnc = nki_loader.logical_core_count()
    if seq % (128 * lnc) != 0:
        raise KernelError(
            f"the NKI rope kernel needs the sequence length to be a multiple of 128 x LNC = "
            f"{128 * lnc}, got {seq}; pad or choose training.seq_len = a multiple of {128 * lnc}."
        )
    q_bhsd = query.transpose(1, 2).contiguous()
    k_bhsd = key.transpose(1, 2).contiguous()
    q_out = torch.empty_like(q_bhsd)
    k_out = torch.empty_like(k_bhsd)
    q_out, k_out = nki_loader.launch(
        "rope_hf",
        lnc,
        q=q_bhsd,
        k=k_bhsd,
        q_out=q_out,
        k_out=k_out,
        rope_cache=rope_cache.to(query.dtype).contiguous(),
        backward=backward,
    )
    return q_out.transpose(1, 2).contiguous(), k_out.transpose(1, 2).contiguous()


@torch.library.custom_op("qwentitan::rope", mutates_args=())
def rope_op(
    query: torch.Tensor, key: torch.Tensor, rope_cache: torch.Tensor, use_nki: bool = True
) -> tuple[torch.Tensor, torch.Tensor]:
    return rope_reference(query, key, rope_cache)


@torch.library.custom_op("qwentitan::rope_backward", mutates_args=())
def rope_backward_op(
    grad_query: torch.Tensor, grad_key: torch.Tensor, rope_cache: torch.Tensor, use_nki: bool = True
) -> tuple[torch.Tensor, torch.Tensor]:
    return rope_backward_reference(grad_query, grad_key, rope_cache)


@rope_op.register_fake
def _(query, key, rope_cache, use_nki=True):
    _check(query, key, rope_cache)
    return torch.empty(query.shape, dtype=query.dtype, device=query.device), torch.empty(
        key.shape, dtype=key.dtype, device=key.device
    )


@rope_backward_op.register_fake
def _(grad_query, grad_key, rope_cache, use_nki=True):
    _check(grad_query, grad_key, rope_cache)
    return torch.empty(
        grad_query.shape, dtype=grad_query.dtype, device=grad_query.device
    ), torch.empty(grad_key.shape, dtype=grad_key.dtype, device=grad_key.device)


def _setup_context(ctx, inputs, output):
    ctx.save_for_backward(inputs[2])
    ctx.use_nki = inputs[3]


def _backward(ctx, grad_q, grad_k):
    (rope_cache,) = ctx.saved_tensors
    dq, dk = torch.ops.qwentitan.rope_backward(grad_q, grad_k, rope_cache, ctx.use_nki)
    return dq, dk, None, None


def _backward_of_backward(ctx, grad_dq, grad_dk):
    # The backward is linear in its inputs: its gradient is the forward rotation.
    (rope_cache,) = ctx.saved_tensors
    q, k = torch.ops.qwentitan.rope(grad_dq, grad_dk, rope_cache, ctx.use_nki)
    return q, k, None, None


rope_op.register_autograd(_backward, setup_context=_setup_context)
rope_backward_op.register_autograd(_backward_of_backward, setup_context=_setup_context)
register_neuron_impl(
    "rope", lambda q, k, cache: rope_nki(q, k, cache, backward=False), rope_reference
)
register_neuron_impl(
    "rope_backward",
    lambda dq, dk, cache: rope_nki(dq, dk, cache, backward=True),
    rope_backward_reference,
)


def rope(
    query: torch.Tensor, key: torch.Tensor, rope_cache: torch.Tensor, *, use_nki: bool = True
) -> tuple[torch.Tensor, torch.Tensor]:
    """Rotate (batch, seq, heads, head_dim) query and key with a ([batch,] max_seq_len, 2 * head_dim) cache.

    `use_nki=False` runs the reference twin on a neuron device too (the fallback switch).
    """
    return torch.ops.qwentitan.rope(query, key, rope_cache, use_nki)
