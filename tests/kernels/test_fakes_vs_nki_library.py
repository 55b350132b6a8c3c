"""The fake kernels against nki-library's own torch references, given a checkout of the library.

Set QWENTITAN_NKI_LIBRARY_CHECKOUT to a clone of aws-neuron/nki-library (branch 2.29 or main;
2.28 lacks the rope and moe_cte references) to run these; without it they are skipped. They
load the library's reference functions (`rope_hf_torch_ref`, `attention_cte_torch_ref`,
`attention_bwd_torch_ref`, `moe_cte_torch_ref`, `blockwise_mm_bwd_torch_ref`) with a stand-in
for the `nki` package, which the references import but do not use, and compare them with the
fakes of fakes/nkilib.py on the same inputs: a fake that drifts from the library fails here.
"""

from __future__ import annotations

import enum
import importlib
import os
import sys
import types
from unittest.mock import MagicMock

import pytest
import torch

from qwentitan.kernels import block_routing

from .cases import rope_cache
from .fakes import nkilib as fake_nkilib
from .fakes import torch_neuronx as fake_torch_neuronx

CHECKOUT = os.environ.get("QWENTITAN_NKI_LIBRARY_CHECKOUT")
pytestmark = pytest.mark.skipif(
    not CHECKOUT, reason="set QWENTITAN_NKI_LIBRARY_CHECKOUT to an nki-library checkout"
)


class _AnyAttribute(types.ModuleType):
    def __getattr__(self, name):
        if name.startswith("__"):
            raise AttributeError(name)
        return MagicMock(name=f"{self.__name__}.{name}")


class BWMMFunc(enum.Enum):  # the members moe_cte_torch_ref compares against
    SHARD_ON_BLOCK = 1
    SHARD_ON_INTERMEDIATE = 3
    SHARD_ON_INTERMEDIATE_DROPPING = 6


@pytest.fixture(scope="module")
def refs():
    pytest.importorskip("numpy")
    pytest.importorskip("scipy")
    with pytest.MonkeyPatch.context() as mp:
        mp.syspath_prepend(os.path.join(CHECKOUT, "src"))
        mp.syspath_prepend(CHECKOUT)
        stubs = {n: _AnyAttribute(n) for n in ("nki", "nki.isa", "nki.isa.constants")}
        stubs["nki.language"] = _AnyAttribute("nki.language")
        stubs["nki.language"].NKIObject = object  # a base class of the library's dataclasses
        stubs["nki"].language, stubs["nki"].isa = stubs["nki.language"], stubs["nki.isa"]
        stubs["nki.isa"].constants = stubs["nki.isa.constants"]
        common = types.ModuleType("test.integration.nkilib.core.moe.moe_cte.test_moe_cte_common")
        common.BWMMFunc = BWMMFunc
        helpers = types.ModuleType("test.integration.nkilib.utils.test_kernel_common")
        helpers.silu = lambda x: x / (1 + __import__("numpy").exp(-x))
        helpers.gelu_apprx_sigmoid = helpers.gelu_apprx_sigmoid_dx = None
        for module in (*stubs.values(), common, helpers):
            mp.setitem(sys.modules, module.__name__, module)
        base = "nkilib_src.nkilib.core."
        found = {
            "rope_hf": (base + "embeddings.rope_hf_torch", "rope_hf_torch_ref"),
            "attention_cte": (base + "attention.attention_cte_torch", "attention_cte_torch_ref"),
            "attention_bwd": (base + "attention.attention_bwd_torch", "attention_bwd_torch_ref"),
            "moe_cte": (base + "moe.moe_cte.moe_cte_torch", "moe_cte_torch_ref"),
            "blockwise_mm_bwd": (
                "test.integration.nkilib.experimental.moe.test_bwmm_bwd_common",
                "blockwise_mm_bwd_torch_ref",
            ),
        }
        yield {k: getattr(importlib.import_module(m), a) for k, (m, a) in found.items()}
        for name in [m for m in sys.modules if m.split(".")[0] in ("nkilib_src", "test")]:
            del sys.modules[name]


@pytest.fixture
def lib(monkeypatch):
    monkeypatch.setenv("NEURON_LOGICAL_NC_CONFIG", "2")
    library = fake_nkilib.build()
    return {path.rsplit(".", 1)[1]: names for path, names in library.items()}


def _launch(kernel, **kwargs):
    return fake_torch_neuronx.wrap_nki(kernel)[(2,)](**kwargs)


@pytest.mark.parametrize("backward", [False, True])
def test_rope_hf(refs, lib, backward):
    q, k, cache = torch.randn(2, 4, 256, 16), torch.randn(2, 2, 256, 16), rope_cache(256, 16)
    got = _launch(
        lib["rope_hf"].rope_hf,
        q=q,
        k=k,
        q_out=torch.empty_like(q),
        k_out=torch.empty_like(k),
        rope_cache=cache,
        backward=backward,
    )
    want = refs["rope_hf"](q, k, None, None, rope_cache=cache, backward=backward)
    torch.testing.assert_close(got, (want["q_out"], want["k_out"]), rtol=1e-5, atol=1e-5)


def test_attention_cte_with_cached_softmax(refs, lib):
    q, k, v = torch.randn(8, 256, 32), torch.randn(4, 32, 256), torch.randn(4, 256, 32)
    options = dict(scale=0.2, causal_mask=True, tp_q=True, tp_k=False, cache_softmax=True)
    got = _launch(lib["attention_cte"].attention_cte, q=q, k=k, v=v, **options)
    want = refs["attention_cte"](q, k, v, **options)
    torch.testing.assert_close(got, tuple(want), rtol=1e-5, atol=1e-5)


def test_attention_bwd(refs, lib):
    b, h, kv, d, s = 2, 4, 2, 32, 512
    q, k, v = torch.randn(b, h, d, s), torch.randn(b, kv, d, s), torch.randn(b, kv, d, s)
    scores = 0.2 * q.transpose(2, 3) @ k.repeat_interleave(2, 1)
    scores = scores.masked_fill(~torch.ones(s, s, dtype=torch.bool).tril(), float("-inf"))
    lse = torch.logsumexp(scores, -1)
    out = torch.softmax(scores, -1) @ v.repeat_interleave(2, 1).transpose(2, 3)
    args = dict(
        q_ref=q,
        k_ref=k,
        v_ref=v,
        o_ref=out.transpose(2, 3).contiguous(),
        dy_ref=torch.randn_like(q),
        lse_ref=lse.reshape(b, h, s // 128, 128).transpose(2, 3).contiguous(),
        use_causal_mask=True,
        mixed_precision=True,
        softmax_scale=0.2,
    )
    got = _launch(lib["attention_bwd"].attention_bwd, **args)
    want = refs["attention_bwd"](**args)
    expected = tuple(want[f"out_{n}_ref"] for n in ("dq", "dk", "dv"))
    torch.testing.assert_close(got, expected, rtol=1e-4, atol=1e-4)


def test_moe_cte_and_blockwise_mm_bwd(refs, lib):
    tokens, hidden, inter, experts, block = 64, 512, 64, 4, 256
    gen = torch.Generator().manual_seed(0)
    ids = torch.stack([torch.randperm(experts, generator=gen)[:2] for _ in range(tokens)])
    aff = torch.zeros(tokens, experts).scatter(1, ids, torch.rand(tokens, 2, generator=gen))
    tpid, b2e = block_routing(ids, experts, block)
    x = torch.cat([torch.randn(tokens, hidden, generator=gen), torch.zeros(1, hidden)])
    flat_aff = torch.cat([aff, torch.zeros(1, experts)]).reshape(-1, 1)
    gate_up = torch.randn(experts, hidden, 2, inter, generator=gen) * hidden**-0.5
    down = torch.randn(experts, inter, hidden, generator=gen) * inter**-0.5
    moe = lib["moe_cte"]
    spec = moe.MoECTESpec(
        implementation=moe.MoECTEImplementation.shard_on_i,
        shard_on_I=moe.ShardOnIConfig(checkpoint_activation=True),
    )
    routing = dict(token_position_to_id=tpid, block_to_expert=b2e.reshape(-1, 1), block_size=block)
    fwd = fake_nkilib.nki.jit(
        lambda x, a, gu, d, token_position_to_id, block_to_expert, block_size: moe.moe_cte.func(
            x,
            a,
            gu,
            d,
            token_position_to_id,
            block_to_expert,
            block_size,
            spec,
            compute_dtype=torch.float32,
        )
    )
    out, gate_up_t, down_act = _launch(fwd, x=x, a=flat_aff, gu=gate_up, d=down, **routing)
    want = refs["moe_cte"](
        x,
        flat_aff,
        gate_up,
        down,
        tpid,
        b2e,
        block,
        BWMMFunc.SHARD_ON_INTERMEDIATE,
        checkpoint_activation=True,
    )
    # The reference rounds each block's contribution to bfloat16 before summing.
    torch.testing.assert_close(out, want["output"], rtol=2e-2, atol=2e-2)
    torch.testing.assert_close(gate_up_t, want["gate_up_activations_T"], rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(down_act, want["down_activations"], rtol=1e-4, atol=1e-4)
    grad = torch.cat([torch.randn(tokens, hidden, generator=gen), torch.zeros(1, hidden)])
    bwd = lib["blockwise_mm_backward"]
    got = _launch(
        bwd.blockwise_mm_bwd,
        hidden_states=x,
        expert_affinities_masked=flat_aff,
        gate_up_proj_weight=gate_up,
        down_proj_weight=down,
        gate_up_proj_act_checkpoint_T=gate_up_t,
        down_proj_act_checkpoint=down_act,
        output_hidden_states_grad=grad,
        compute_dtype=torch.float32,  # the torch references compute in float32
        **routing,
    )
    want = refs["blockwise_mm_bwd"](
        x, flat_aff, gate_up, down, gate_up_t, down_act, tpid, b2e, grad, block
    )
    names = ("hidden_states", "expert_affinities_masked", "gate_up_proj_weight", "down_proj_weight")
    expected = tuple(want[f"{n}_grad"] for n in names)
    torch.testing.assert_close(got, expected, rtol=1e-4, atol=1e-4)
