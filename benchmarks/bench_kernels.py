"""Each kernel module's reference twin vs the torchtitan module it replaces, forward + backward, cpu.

Prints median milliseconds per forward+backward and the ratio torchtitan / ours (>= 1.0 means the
kernel path's reference twin is at least as fast). The two are timed in alternation, so load from
other processes on the machine falls on both alike. Attention is compared with torchtitan's
causal ScaledDotProductAttention module: FlexAttention, the Qwen3 default, has no cpu backward.
Grouped experts run twice: ours in the input's float32 (the default) and ours in bfloat16, the
dtype torchtitan's GroupedExperts always casts to. PyTorch's cpu bfloat16 GEMM is slow without
bf16 instructions; torchtitan's grouped_mm uses it, ours runs float32 GEMMs of the upcast
bfloat16 operands and rounds the results to bfloat16 (see experts.py).
Run: `uv run nox -s bench -- kernels` or `uv run python benchmarks/bench_kernels.py`.
"""

from __future__ import annotations

import statistics
import time

import torch
from torchtitan.models.common.attention import ScaledDotProductAttention
from torchtitan.models.common.moe import GroupedExperts
from torchtitan.models.common.rope import CosSinRoPE

from qwentitan.modeling.kernel_path import (
    KernelCausalAttention,
    KernelGroupedExperts,
    KernelRoPE,
)


def _time_pair(theirs, ours, budget_s: float = 20.0, warmup: int = 2):
    """(median ms of theirs, median ms of ours, rounds), timed in alternation.

    Each round runs both, the order flipping every round (AB, BA, AB...) so neither always
    follows the other; as many rounds as fit in `budget_s` by the first round's time, 7 to 51.
    """
    for _ in range(warmup):
        theirs()
        ours()
    samples = {theirs: [], ours: []}
    rounds, done = 1, 0
    while done < rounds:
        for fn in (theirs, ours) if done % 2 == 0 else (ours, theirs):
            start = time.perf_counter()
            fn()
            samples[fn].append(time.perf_counter() - start)
        done += 1
        if done == 1:
            first = samples[theirs][0] + samples[ours][0]
            rounds = min(max(int(budget_s / first), 7), 51)
    ms = [statistics.median(samples[fn]) * 1e3 for fn in (theirs, ours)]
    return ms[0], ms[1], rounds


def _rope_case():
    batch, seq, heads, kv_heads, dim = 2, 1024, 16, 8, 128
    cfg = dict(dim=dim, max_seq_len=seq, theta=1e6)
    theirs, ours = CosSinRoPE.Config(**cfg).build(), KernelRoPE.Config(**cfg).build()
    q = torch.randn(batch, seq, heads, dim, requires_grad=True)
    k = torch.randn(batch, seq, kv_heads, dim, requires_grad=True)
    gq, gk = torch.randn_like(q), torch.randn_like(k)

    def run(module):
        return lambda: torch.autograd.backward(module(q, k), (gq, gk))

    return "rope", f"q {tuple(q.shape)} k {tuple(k.shape)} fp32", run(theirs), run(ours)


def _attention_case():
    batch, seq, heads, kv_heads, dim = 1, 1024, 16, 8, 128
    theirs = ScaledDotProductAttention.Config().build()
    ours = KernelCausalAttention.Config().build()
    q = torch.randn(batch, seq, heads, dim, requires_grad=True)
    k = torch.randn(batch, seq, kv_heads, dim, requires_grad=True)
    v = torch.randn(batch, seq, kv_heads, dim, requires_grad=True)
    grad = torch.randn_like(q)

    def run(module):
        return lambda: module(q, k, v, scale=dim**-0.5, enable_gqa=True).backward(grad)

    return (
        "causal_attention",
        f"q {tuple(q.shape)} kv_heads {kv_heads} fp32",
        run(theirs),
        run(ours),
    )


def _experts_case(compute_dtype):
    rows, dim, hidden, experts = 4096, 512, 256, 8
    theirs = GroupedExperts.Config(dim=dim, hidden_dim=hidden, num_experts=experts).build()
    ours = KernelGroupedExperts.Config(
        dim=dim, hidden_dim=hidden, num_experts=experts, block_size=256, compute_dtype=compute_dtype
    ).build()
    for p in theirs.parameters():
        torch.nn.init.normal_(p, std=0.02)
    ours.load_state_dict(theirs.state_dict())
    counts = torch.tensor([700, 300, 900, 100, 600, 500, 400, 596])
    x = torch.randn(rows, dim, requires_grad=True)
    grad = torch.randn(rows, dim)

    def run(module):
        return lambda: module(x, counts).backward(grad)

    ours_dtype = "bf16 like torchtitan (GEMMs in fp32)" if compute_dtype else "fp32 (default)"
    shape = f"rows {rows} dim {dim} hidden {hidden} E {experts}, torchtitan bf16, ours {ours_dtype}"
    return "grouped_experts", shape, run(theirs), run(ours)


def main() -> None:
    torch.manual_seed(0)
    print(f"torch {torch.__version__}, {torch.get_num_threads()} cpu threads")
    print(f"{'op':<18}{'torchtitan ms':>15}{'ours ms':>10}{'ratio':>8}{'rounds':>8}  shape")
    cases = (
        _rope_case,
        _attention_case,
        lambda: _experts_case(None),
        lambda: _experts_case(torch.bfloat16),
    )
    for case in cases:
        name, shape, theirs, ours = case()
        t_theirs, t_ours, rounds = _time_pair(theirs, ours)
        ratio = f"{t_theirs / t_ours:.2f}x"
        print(f"{name:<18}{t_theirs:>15.2f}{t_ours:>10.2f}{ratio:>8}{rounds:>8}  {shape}")


if __name__ == "__main__":
    main()
