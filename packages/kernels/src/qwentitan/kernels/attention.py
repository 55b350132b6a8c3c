"""Causal grouped-query attention as `qwentitan::causal_attention` + `causal_attention_backward`.

Inputs use torchtitan's inner-attention layout: q (batch, seq, q_heads, head_dim), k and v
(batch, seq, kv_heads, head_dim), q_heads a multiple of kv_heads. The forward returns the output
(batch, seq, q_heads, head_dim) and the log-sum-exp statistics lse (batch, q_heads, seq) in float32
(float64 for float64 inputs): lse = logsumexp over visible keys of scale * q.k. The backward op
consumes out and lse, as nkilib attention_bwd does, instead of recomputing the softmax.
The NKI path follows attention_cte (forward, cache_softmax=True) and attention_bwd (backward).
"""

from __future__ import annotations

import torch

from qwentitan.kernels import nki_loader
from qwentitan.kernels.errors import KernelError
from qwentitan.kernels.neuron_dispatch import register_neuron_impl

MAX_HEAD_DIM = 128  # attention_cte asserts d <= 128 (nki-library at SDK 2.29)
MAX_FOLDED_HEADS = 512  # attention_cte asserts batch * heads <= 512


def _check(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
    if q.dim() != 4 or k.shape != v.shape or k.dim() != 4:
        raise KernelError(
            f"causal_attention takes 4-D (batch, seq, heads, head_dim) q, k, v with k and v alike, "
            f"got {tuple(q.shape)}, {tuple(k.shape)}, {tuple(v.shape)}; pass torchtitan's layout."
        )
    if q.shape[0] != k.shape[0] or q.shape[1] != k.shape[1] or q.shape[3] != k.shape[3]:
        raise KernelError(
            f"causal_attention q {tuple(q.shape)} and k {tuple(k.shape)} differ in batch, seq or "
            "head_dim; causal self-attention needs them equal."
        )
    if q.shape[2] % k.shape[2] != 0:
        raise KernelError(
            f"causal_attention has {q.shape[2]} query heads and {k.shape[2]} kv heads; the query "
            "heads must be a multiple of the kv heads (grouped-query attention)."
        )


def _lse_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.float64 if dtype == torch.float64 else torch.float32


def _expand_kv(x: torch.Tensor, groups: int) -> torch.Tensor:
    # (b, hkv, s, d) -> (b, hkv * groups, s, d): query head h reads kv head h // groups.
    return x.repeat_interleave(groups, dim=1) if groups > 1 else x


def _math_forward(q, k, v, scale):
    # Explicit softmax: the device-independent twin (cuda and any non-cpu device).
    groups = q.shape[2] // k.shape[2]
    qh, kh = q.transpose(1, 2), _expand_kv(k.transpose(1, 2), groups)
    vh = _expand_kv(v.transpose(1, 2), groups)
    acc = _lse_dtype(q.dtype)
    scores = torch.matmul(qh.to(acc), kh.to(acc).transpose(-1, -2)) * scale
    seq = q.shape[1]
    causal = torch.ones(seq, seq, dtype=torch.bool, device=q.device).tril()
    scores = scores.masked_fill(~causal, float("-inf"))
    lse = torch.logsumexp(scores, dim=-1)
    probs = torch.exp(scores - lse[..., None])
    out = torch.matmul(probs, vh.to(acc)).to(q.dtype)
    return out.transpose(1, 2).contiguous(), lse.contiguous()


def _math_backward(grad_out, q, k, v, out, lse, scale):
    groups = q.shape[2] // k.shape[2]
    acc = lse.dtype
    qh = q.transpose(1, 2).to(acc)
    kh = _expand_kv(k.transpose(1, 2), groups).to(acc)
    vh = _expand_kv(v.transpose(1, 2), groups).to(acc)
    do, o = grad_out.transpose(1, 2).to(acc), out.transpose(1, 2).to(acc)
    seq = q.shape[1]
    causal = torch.ones(seq, seq, dtype=torch.bool, device=q.device).tril()
    scores = (torch.matmul(qh, kh.transpose(-1, -2)) * scale).masked_fill(~causal, float("-inf"))
    probs = torch.exp(scores - lse[..., None])
    dv = torch.matmul(probs.transpose(-1, -2), do)
    dp = torch.matmul(do, vh.transpose(-1, -2))
    delta = (do * o).sum(-1, keepdim=True)
    ds = probs * (dp - delta) * scale
    dq = torch.matmul(ds, kh)
    dk = torch.matmul(ds.transpose(-1, -2), qh)
    return _fold_back(dq, dk, dv, q, k, groups)


def _fold_back(dq, dk, dv, q, k, groups):
    b, hkv, s, d = k.shape[0], k.shape[2], k.shape[1], k.shape[3]
    if groups > 1:  # a kv head's gradient is the sum over the query heads of its group
        dk = dk.reshape(b, hkv, groups, s, d).sum(2)
        dv = dv.reshape(b, hkv, groups, s, d).sum(2)
    return (
        dq.transpose(1, 2).to(q.dtype).contiguous(),
        dk.transpose(1, 2).to(k.dtype).contiguous(),
        dv.transpose(1, 2).to(k.dtype).contiguous(),
    )


def causal_attention_reference(q, k, v, scale):
    """Reference twin; on cpu it uses PyTorch's fused flash kernel, which also yields the lse."""
    _check(q, k, v)
    if q.device.type != "cpu":
        return _math_forward(q, k, v, scale)
    # PyTorch's cpu flash kernel reads grouped kv heads itself: no expanded copies of k and v.
    out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
        q.transpose(1, 2),
        k.transpose(1, 2),
        v.transpose(1, 2),
        0.0,
        True,
        scale=scale,
    )
    return out.transpose(1, 2).contiguous(), lse.to(_lse_dtype(q.dtype)).contiguous()


def causal_attention_backward_reference(grad_out, q, k, v, out, lse, scale):
    """Reference twin of the backward, from the saved out and lse."""
    _check(q, k, v)
    if q.device.type != "cpu":
        return _math_backward(grad_out, q, k, v, out, lse, scale)
    dq, dk, dv = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(
        grad_out.transpose(1, 2),
        q.transpose(1, 2),
        k.transpose(1, 2),
        v.transpose(1, 2),
        out.transpose(1, 2),
        lse,
        0.0,
        True,
        scale=scale,
    )
    return _fold_back(dq, dk, dv, q, k, groups=1)  # dk, dv already summed per kv head


def _check_nki(q: torch.Tensor, k: torch.Tensor, backward: bool) -> None:
    batch, seq, heads, head_dim = q.shape
    if head_dim > MAX_HEAD_DIM:
        raise KernelError(
            f"the NKI attention kernels take head_dim <= {MAX_HEAD_DIM}, got {head_dim}; use the "
            "reference path (cpu/cuda) or a model with head_dim <= 128."
        )
    if batch * heads > MAX_FOLDED_HEADS:
        raise KernelError(
            f"attention_cte takes batch x heads <= {MAX_FOLDED_HEADS}, got {batch} x {heads}; "
            "lower the local batch size."
        )
    if seq % 128 != 0:
        raise KernelError(
            f"the NKI attention kernels need the sequence length to be a multiple of 128, got "
            f"{seq}; choose training.seq_len as a multiple of 128."
        )
    if backward and seq not in (128, 256) and seq % 512 != 0:
        raise KernelError(
            f"attention_bwd takes a key length of 128, 256 or a multiple of 512, got {seq}; "
            "choose training.seq_len accordingly."
        )


def causal_attention_nki(q, k, v, scale):
    """The call into nkilib attention_cte with heads folded into batch and cached softmax stats."""
    _check(q, k, v)
    _check_nki(q, k, backward=False)
    batch, seq, heads, head_dim = q.shape
    kv_heads = k.shape[2]
    lnc = nki_loader.logical_core_count()
    out, neg_max, sum_recip = nki_loader.launch(
        "attention_cte",
        lnc,
        q=q.transpose(1, 2).reshape(batch * heads, seq, head_dim),  # tp_q=True: (BH, S, d)
        k=k.permute(0, 2, 3, 1).reshape(batch * kv_heads, head_dim, seq),  # tp_k=False: (BH, d, S)
        v=v.transpose(1, 2).reshape(batch * kv_heads, seq, head_dim),
        scale=scale,
        causal_mask=True,
        tp_q=True,
        tp_k=False,
        tp_out=False,
        cache_softmax=True,
    )
    # [bh, p, g] holds query g * 128 + p; lse = -max - log(1 / sum).
    tiles = seq // 128
    lse = (-neg_max - torch.log(sum_recip)).reshape(batch, heads, 128, tiles)
    lse = lse.transpose(-1, -2).reshape(batch, heads, seq).to(_lse_dtype(q.dtype))
    out = out.reshape(batch, heads, seq, head_dim).transpose(1, 2).contiguous()
    return out, lse.contiguous()


def causal_attention_backward_nki(grad_out, q, k, v, out, lse, scale):
    """The call into nkilib attention_bwd: d-major tensors, lse in (b, h, 128, seq / 128) tiles."""
    _check(q, k, v)
    _check_nki(q, k, backward=True)
    batch, seq, heads, _ = q.shape
    lnc = nki_loader.logical_core_count()

    def d_major(x):  # (b, s, h, d) -> (b, h, d, s)
        return x.permute(0, 2, 3, 1).contiguous()

    lse_tiles = lse.to(torch.float32).reshape(batch, heads, seq // 128, 128).transpose(-1, -2)
    dq, dk, dv = nki_loader.launch(
        "attention_bwd",
        lnc,
        q_ref=d_major(q),
        k_ref=d_major(k),
        v_ref=d_major(v),
        o_ref=d_major(out),
        dy_ref=d_major(grad_out.to(q.dtype)),
        lse_ref=lse_tiles.contiguous(),
        use_causal_mask=True,
        mixed_precision=True,
        softmax_scale=scale,
    )[:3]

    def back(x):  # (b, h, d, s) -> (b, s, h, d)
        return x.permute(0, 3, 1, 2).contiguous()

    return back(dq), back(dk), back(dv)


@torch.library.custom_op("qwentitan::causal_attention", mutates_args=())
def causal_attention_op(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, use_nki: bool = True
) -> tuple[torch.Tensor, torch.Tensor]:
    return causal_attention_reference(q, k, v, scale)


@torch.library.custom_op("qwentitan::causal_attention_backward", mutates_args=())
def causal_attention_backward_op(
    grad_out: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    out: torch.Tensor,
    lse: torch.Tensor,
    scale: float,
    use_nki: bool = True,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    return causal_attention_backward_reference(grad_out, q, k, v, out, lse, scale)


@causal_attention_op.register_fake
def _(q, k, v, scale, use_nki=True):
    _check(q, k, v)
    batch, seq, heads, _ = q.shape
    return torch.empty_like(q, memory_format=torch.contiguous_format), q.new_empty(
        (batch, heads, seq), dtype=_lse_dtype(q.dtype)
    )


@causal_attention_backward_op.register_fake
def _(grad_out, q, k, v, out, lse, scale, use_nki=True):
    _check(q, k, v)
    return tuple(torch.empty_like(x, memory_format=torch.contiguous_format) for x in (q, k, v))


def _setup_context(ctx, inputs, output):
    q, k, v, scale, use_nki = inputs
    out, lse = output
    ctx.save_for_backward(q, k, v, out, lse)
    ctx.scale, ctx.use_nki = scale, use_nki
    ctx.mark_non_differentiable(lse)


def _backward(ctx, grad_out, _grad_lse):
    q, k, v, out, lse = ctx.saved_tensors
    dq, dk, dv = torch.ops.qwentitan.causal_attention_backward(
        grad_out.contiguous(), q, k, v, out, lse, ctx.scale, ctx.use_nki
    )
    return dq, dk, dv, None, None


causal_attention_op.register_autograd(_backward, setup_context=_setup_context)
register_neuron_impl("causal_attention", causal_attention_nki, causal_attention_reference)
register_neuron_impl(
    "causal_attention_backward",
    causal_attention_backward_nki,
    causal_attention_backward_reference,
)


def causal_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    scale: float | None = None,
    *,
    use_nki: bool = True,
) -> torch.Tensor:
    """Causal GQA over (batch, seq, heads, head_dim) tensors; scale defaults to 1/sqrt(head_dim).

    `use_nki=False` runs the reference twin on a neuron device too (the fallback switch).
    """
    scale = q.shape[-1] ** -0.5 if scale is None else float(scale)
    return torch.ops.qwentitan.causal_attention(q, k, v, scale, use_nki)[0]
