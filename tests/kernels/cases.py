"""Inputs the kernel tests share: a RoPE cache and a routed-experts case."""

from __future__ import annotations

import torch

from qwentitan.kernels import block_routing


def rope_cache(max_seq: int, dim: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """torchtitan's CosSinRoPE buffer layout: (max_seq, 2 * dim), cos first, theta 1e4."""
    freqs = torch.outer(torch.arange(max_seq).double(), 1e4 ** -(torch.arange(0, dim, 2) / dim))
    theta = torch.cat([freqs, freqs], -1)
    return torch.cat([theta.cos(), theta.sin()], -1).to(dtype)


def experts_case(tokens=64, hidden=512, inter=64, experts=4, top_k=2, block=256):
    """grouped_experts' arguments: hidden, affinities, gate_up, down, routing, block size."""
    gen = torch.Generator().manual_seed(0)
    ids = torch.stack([torch.randperm(experts, generator=gen)[:top_k] for _ in range(tokens)])
    aff = torch.zeros(tokens, experts).scatter(1, ids, torch.rand(tokens, top_k, generator=gen))
    tpid, b2e = block_routing(ids, experts, block)
    return (
        torch.randn(tokens, hidden, generator=gen),
        aff,
        torch.randn(experts, hidden, 2, inter, generator=gen) * hidden**-0.5,
        torch.randn(experts, inter, hidden, generator=gen) * inter**-0.5,
        tpid,
        b2e,
        block,
    )
