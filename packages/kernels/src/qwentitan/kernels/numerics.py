"""How far an op on a device is from an independent PyTorch reference (used by preflight).

`check_kernels(rules, device)` runs this for every op a model's replacement rules use and
says which route launched it.

Inputs are fixed, seeded and small, and their shapes satisfy the NKI contracts at LNC=2 (sequence
256, hidden 512, block 256), so the same report runs on cpu, cuda and neuron. The reference is
computed on cpu in the same dtype from the same inputs: for rope the formula of torchtitan's
CosSinRoPE, for attention torch's scaled_dot_product_attention, for grouped experts a dense
per-expert loop. On cpu the rope report is exactly 0.0 in float32 (same formula, same order).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence

import torch
import torch.nn.functional as F

from qwentitan.kernels import nki_loader
from qwentitan.kernels.errors import KernelError
from qwentitan.kernels.registry import ReplacementRule

OPS = ("rope", "causal_attention", "grouped_experts")


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class NumericsReport:
    """max |op - reference| for the forward output and each input gradient."""

    op: str
    device: str
    dtype: str
    forward_max_abs_diff: float
    grad_max_abs_diff: dict[str, float]

    @property
    def worst(self) -> float:
        return max([self.forward_max_abs_diff, *self.grad_max_abs_diff.values()])


def _rope_case(gen, use_nki):
    batch, seq, heads, kv_heads, head_dim = 1, 256, 4, 2, 64
    inv_freq = 1.0 / (1e6 ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim))
    freqs = torch.outer(torch.arange(seq, dtype=torch.float32), inv_freq)
    theta = torch.cat([freqs, freqs], -1)
    cache = torch.cat([theta.cos(), theta.sin()], -1)
    q = torch.randn(batch, seq, heads, head_dim, generator=gen)
    k = torch.randn(batch, seq, kv_heads, head_dim, generator=gen)

    def op(q, k):
        return torch.ops.qwentitan.rope(q, k, cache.to(q.device), use_nki)

    def reference(q, k):
        c = cache.to(q.dtype)
        cos, sin = c[None, :, None, :head_dim], c[None, :, None, head_dim:]

        def rot(x):
            return torch.cat([-x[..., head_dim // 2 :], x[..., : head_dim // 2]], -1)

        return (q * cos + rot(q) * sin, k * cos + rot(k) * sin)

    return {"q": q, "k": k}, op, reference


def _attention_case(gen, use_nki):
    batch, seq, heads, kv_heads, head_dim = 1, 256, 4, 2, 64
    scale = head_dim**-0.5
    inputs = {
        "q": torch.randn(batch, seq, heads, head_dim, generator=gen),
        "k": torch.randn(batch, seq, kv_heads, head_dim, generator=gen),
        "v": torch.randn(batch, seq, kv_heads, head_dim, generator=gen),
    }

    def op(q, k, v):
        return (torch.ops.qwentitan.causal_attention(q, k, v, scale, use_nki)[0],)

    def reference(q, k, v):
        out = F.scaled_dot_product_attention(
            q.transpose(1, 2),
            k.transpose(1, 2),
            v.transpose(1, 2),
            is_causal=True,
            scale=scale,
            enable_gqa=True,
        )
        return (out.transpose(1, 2),)

    return inputs, op, reference


def _experts_case(gen, use_nki):
    from qwentitan.kernels.experts import block_routing

    tokens, hidden, inter, experts, top_k, block = 128, 512, 64, 4, 2, 256
    expert_ids = torch.stack(
        [torch.randperm(experts, generator=gen)[:top_k] for _ in range(tokens)]
    )
    weights = torch.rand(tokens, top_k, generator=gen)
    affinities = torch.zeros(tokens, experts).scatter(1, expert_ids, weights)
    tpid, b2e = block_routing(expert_ids, experts, block)
    inputs = {
        "hidden_states": torch.randn(tokens, hidden, generator=gen),
        "expert_affinities": affinities,
        "gate_up_weight": torch.randn(experts, hidden, 2, inter, generator=gen) * hidden**-0.5,
        "down_weight": torch.randn(experts, inter, hidden, generator=gen) * inter**-0.5,
    }

    def op(hidden_states, expert_affinities, gate_up_weight, down_weight):
        dev = hidden_states.device
        out = torch.ops.qwentitan.grouped_experts(
            hidden_states,
            expert_affinities,
            gate_up_weight,
            down_weight,
            tpid.to(dev),
            b2e.to(dev),
            block,
            use_nki,
        )
        return (out[0],)

    routed = affinities != 0

    def reference(hidden_states, expert_affinities, gate_up_weight, down_weight):
        # Only routed (token, expert) pairs reach the output, so only they get a gradient.
        expert_affinities = expert_affinities * routed.to(device=hidden_states.device)
        out = torch.zeros_like(hidden_states)
        for e in range(experts):
            h = F.silu(hidden_states @ gate_up_weight[e, :, 0]) * (
                hidden_states @ gate_up_weight[e, :, 1]
            )
            out = out + (h @ down_weight[e]) * expert_affinities[:, e : e + 1]
        return (out,)

    return inputs, op, reference


_CASES: dict[str, Callable] = {
    "rope": _rope_case,
    "causal_attention": _attention_case,
    "grouped_experts": _experts_case,
}


def _run(fn, inputs: dict[str, torch.Tensor], device, dtype):
    leaves = {
        n: t.to(device=device, dtype=dtype).detach().clone().requires_grad_(True)
        for n, t in inputs.items()
    }
    outputs = fn(**leaves)
    gen = torch.Generator().manual_seed(1)
    cotangents = [
        torch.randn(o.shape, generator=gen).to(device=device, dtype=o.dtype) for o in outputs
    ]
    torch.autograd.backward(outputs, cotangents)
    return [o.detach().cpu().double() for o in outputs], {
        n: t.grad.detach().cpu().double() for n, t in leaves.items()
    }


def numerics_report(
    op: str,
    device: str | torch.device = "cpu",
    dtype: torch.dtype = torch.float32,
    *,
    use_nki: bool = True,
) -> NumericsReport:
    """max |diff| of `op`'s forward and input gradients on `device` against the reference.

    `use_nki=False` runs the op's reference twin on neuron too (the fallback switch).
    """
    if op not in _CASES:
        raise KernelError(f"no numerics report for op {op!r}; use one of {', '.join(OPS)}.")
    import qwentitan.kernels  # noqa: F401  (registers the ops)

    gen = torch.Generator().manual_seed(0)
    inputs, op_fn, reference_fn = _CASES[op](gen, use_nki)
    outs, grads = _run(op_fn, inputs, torch.device(device), dtype)
    ref_outs, ref_grads = _run(reference_fn, inputs, torch.device("cpu"), dtype)
    forward = max(float((a - b).abs().max()) for a, b in zip(outs, ref_outs, strict=True))
    return NumericsReport(
        op=op,
        device=str(device),
        dtype=str(dtype).removeprefix("torch."),
        forward_max_abs_diff=forward,
        grad_max_abs_diff={n: float((grads[n] - ref_grads[n]).abs().max()) for n in grads},
    )


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class KernelCheck:
    """One op of a model's replacement rules, launched once and compared with its reference."""

    op: str
    route: str
    max_abs_diff: float
    report: NumericsReport


def check_kernels(
    rules: Sequence[ReplacementRule],
    device: str | torch.device = "cpu",
    dtype: torch.dtype = torch.float32,
) -> list[KernelCheck]:
    """Launch every op `rules` use once on `device`, forward and backward, against its reference.

    The route is the one the op takes there: `nki.jit` or `wrap_nki` for an NKI kernel on a
    neuron device (`nki_loader.launch_route`), `reference twin` elsewhere or where a rule
    chose the twin. Rules without an op (plain module swaps) are skipped.
    """
    # Read from the name: "neuron" parses as a torch.device only once torch_neuronx renamed
    # PrivateUse1, and the route is asked of torch_neuronx below anyway.
    neuron = str(device).partition(":")[0] == "neuron"
    chosen: dict[str, bool] = {}
    for rule in rules:
        if rule.op is not None:
            chosen[rule.op] = chosen.get(rule.op, False) or rule.use_nki
    checks = []
    for op, use_nki in chosen.items():
        report = numerics_report(op, device, dtype, use_nki=use_nki)
        route = nki_loader.launch_route() if neuron and use_nki else "reference twin"
        checks.append(KernelCheck(op=op, route=route, max_abs_diff=report.worst, report=report))
    return checks
