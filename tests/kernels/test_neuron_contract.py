"""The NKI path against fakes of nki, nki-library and TorchNeuron installed in sys.modules.

Unlike test_nki_call_sites.py, nothing here replaces our loader: `nki_loader` imports the
fake packages and launches the kernels by the route the installed (fake) torch-neuronx takes,
so what a trn2 run does (import, route, LNC, nested kernel call, compute dtype) executes.
"""

from __future__ import annotations

import sys

import pytest
import torch

from qwentitan.kernels import KernelError, nki_loader
from qwentitan.kernels.attention import (
    causal_attention_backward_nki,
    causal_attention_backward_reference,
    causal_attention_nki,
    causal_attention_reference,
)
from qwentitan.kernels.experts import (
    grouped_experts_backward_nki,
    grouped_experts_backward_reference,
    grouped_experts_nki,
    grouped_experts_reference,
)
from qwentitan.kernels.rope import rope_backward_reference, rope_nki, rope_reference

from . import fakes
from .cases import experts_case, rope_cache
from .fakes import nki as fake_nki

# The fakes behave as the real packages do (each rule's source is named in the fake).


def test_the_fake_nki_jit_takes_the_lnc_from_the_environment(neuron, monkeypatch):
    q = torch.zeros(1, 2, 256, 8)
    kwargs = dict(q=q, k=q, q_out=q.clone(), k_out=q.clone(), rope_cache=torch.zeros(256, 16))
    neuron["rope_hf"](**kwargs)  # NEURON_LOGICAL_NC_CONFIG=2: kernel and compiler agree
    monkeypatch.delenv("NEURON_LOGICAL_NC_CONFIG")
    with pytest.raises(fake_nki.NKIError, match="EVRF066"):
        neuron["rope_hf"](**kwargs)  # unset: the kernel takes LNC 1, neuronx-cc 2


def test_the_fake_wrap_nki_drops_unknown_keywords_and_refuses_unhashable_constants(monkeypatch):
    monkeypatch.setattr(nki_loader, "_cache", {})
    monkeypatch.setenv("NEURON_LOGICAL_NC_CONFIG", "2")
    neuron = fakes.install(monkeypatch, host="april-source")
    caller = sys.modules["torch_neuronx"].wrap_nki(neuron["moe_cte"])
    with pytest.raises(TypeError):
        caller[2]  # TorchNeuron does tuple(map(int, grid))
    moe = sys.modules["nkilib.core.moe.moe_cte.moe_cte"]
    spec = moe.MoECTESpec(implementation=moe.MoECTEImplementation.shard_on_i)
    with pytest.raises(RuntimeError, match="'spec' of type MoECTESpec is not hashable"):
        caller[(2,)](*experts_case()[:4], torch.zeros(1), torch.zeros(1, 1), 256, spec)
    q = torch.zeros(1, 2, 256, 8)
    wrapped = sys.modules["torch_neuronx"].wrap_nki(neuron["rope_hf"])
    wrapped[(2,)](q=q, k=q, q_out=q.clone(), k_out=q.clone(), rope_cache=torch.zeros(256, 16), x=1)
    assert "x" not in neuron["rope_hf"].calls[-1], "an unknown keyword is dropped"


def test_the_fake_allows_a_jit_kernel_inside_another_trace(neuron):
    calls = []

    @fake_nki.jit
    def inner(x):
        calls.append(fake_nki.num_programs())
        return x + 1

    outer = fake_nki.jit(lambda x: inner(x) * 2)
    assert torch.equal(outer(torch.ones(1)), torch.full((1,), 4.0))
    assert calls == [2], "the nested kernel ran inside the outer trace, at its LNC"


def test_the_april_torch_neuronx_launches_only_through_wrap_nki(monkeypatch):
    monkeypatch.setenv("NEURON_LOGICAL_NC_CONFIG", "2")
    neuron = fakes.install(monkeypatch, host="april-source")
    q = torch.zeros(1, 2, 256, 8)
    with pytest.raises(fake_nki.NKIError, match="wrap_nki"):
        neuron["rope_hf"](q=q, k=q, q_out=q, k_out=q, rope_cache=torch.zeros(256, 16))


# The launch helper: the documented nki.jit call first, wrap_nki only where it exists.


@pytest.mark.parametrize(
    ("host", "route"),
    [
        ("documented", "nki.jit"),
        ("documented-with-wrap_nki", "nki.jit"),
        ("april-source", "wrap_nki"),
    ],
)
def test_the_route_follows_the_installed_torch_neuronx_and_is_logged(
    monkeypatch, caplog, host, route
):
    monkeypatch.setattr(nki_loader, "_cache", {})
    monkeypatch.setattr(nki_loader, "_logged", set())
    monkeypatch.setenv("NEURON_LOGICAL_NC_CONFIG", "2")
    neuron = fakes.install(monkeypatch, host=host)
    assert nki_loader.launch_route() == route
    q, k, cache = torch.randn(2, 256, 4, 16), torch.randn(2, 256, 2, 16), rope_cache(300, 16)
    with caplog.at_level("INFO", logger="qwentitan.kernels"):
        for got, want in zip(
            rope_nki(q, k, cache, False), rope_reference(q, k, cache), strict=True
        ):
            torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)
    assert len(neuron["rope_hf"].calls) == 1
    assert f"NKI kernel rope_hf launched through {route} at LNC 2" in caplog.text


def test_a_torch_neuronx_without_wrap_nki_runs_every_kernel(monkeypatch):
    # The helper before this change called torch_neuronx.wrap_nki unconditionally: an
    # AttributeError on the first RoPE or experts launch of a torch-neuronx without it.
    monkeypatch.setattr(nki_loader, "_cache", {})
    monkeypatch.setenv("NEURON_LOGICAL_NC_CONFIG", "2")
    neuron = fakes.install(monkeypatch, host="documented")
    assert not hasattr(sys.modules["torch_neuronx"], "wrap_nki")
    args = experts_case()
    out, gate_up_act, down_act = grouped_experts_nki(*args)
    torch.testing.assert_close(out, grouped_experts_reference(*args)[0], rtol=1e-4, atol=1e-4)
    grad = torch.randn_like(out)
    grouped_experts_backward_nki(grad, *args[:4], gate_up_act, down_act, *args[4:])
    q, k, cache = torch.randn(2, 256, 4, 16), torch.randn(2, 256, 2, 16), rope_cache(300, 16)
    rope_nki(q, k, cache, False)
    # nki-library's kernels are called as jit kernels inside our launchers' traces, as the
    # library nests its own, not through `.func`.
    assert len(neuron["moe_cte"].nested_calls) == 1 and neuron["moe_cte"].calls == []
    assert len(neuron["blockwise_mm_bwd"].nested_calls) == 1
    assert len(neuron["rope_hf"].calls) == 1


def test_the_nki_jit_route_needs_the_lnc_in_the_environment(neuron, monkeypatch):
    monkeypatch.delenv("NEURON_LOGICAL_NC_CONFIG")
    q, k, cache = torch.randn(1, 256, 2, 16), torch.randn(1, 256, 2, 16), rope_cache(256, 16)
    with pytest.raises(KernelError, match="export NEURON_LOGICAL_NC_CONFIG=2"):
        rope_nki(q, k, cache, False)
    assert neuron["rope_hf"].calls == []


def test_rope_launches_rope_hf_in_its_layout(neuron):
    torch.manual_seed(0)
    q, k, cache = torch.randn(2, 256, 4, 16), torch.randn(2, 256, 2, 16), rope_cache(300, 16)
    for got, want in zip(rope_nki(q, k, cache, False), rope_reference(q, k, cache), strict=True):
        torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)
    dq, dk = torch.randn_like(q), torch.randn_like(k)
    for got, want in zip(
        rope_nki(dq, dk, cache, True), rope_backward_reference(dq, dk, cache), strict=True
    ):
        torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)
    fwd, bwd = neuron["rope_hf"].calls
    assert fwd["backward"] is False and bwd["backward"] is True
    assert fwd["q"].shape == (2, 4, 256, 16), "rope_hf takes (batch, heads, seq, head_dim)"


def test_attention_launches_attention_cte_and_bwd(neuron):
    torch.manual_seed(0)
    q = torch.randn(2, 256, 4, 32)
    k, v = torch.randn(2, 256, 2, 32), torch.randn(2, 256, 2, 32)
    out, lse = causal_attention_nki(q, k, v, 0.2)
    ref_out, ref_lse = causal_attention_reference(q, k, v, 0.2)
    torch.testing.assert_close(out, ref_out, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(lse, ref_lse, rtol=1e-5, atol=1e-5)
    grad = torch.randn_like(out)
    got = causal_attention_backward_nki(grad, q, k, v, out, lse, 0.2)
    want = causal_attention_backward_reference(grad, q, k, v, ref_out, ref_lse, 0.2)
    for g, w in zip(got, want, strict=True):
        torch.testing.assert_close(g, w, rtol=1e-4, atol=1e-4)
    (fwd,), (bwd,) = neuron["attention_cte"].calls, neuron["attention_bwd"].calls
    assert fwd["q"].shape == (8, 256, 32) and fwd["k"].shape == (4, 32, 256)
    assert fwd["cache_softmax"] and fwd["causal_mask"] and fwd["scale"] == 0.2
    assert bwd["use_causal_mask"] and bwd["softmax_scale"] == 0.2 and bwd["mixed_precision"]


def test_loading_a_kernel_imports_torch_neuronx_explicitly(neuron, monkeypatch):
    # With TORCH_DEVICE_BACKEND_AUTOLOAD=0 nothing imports torch_neuronx for us.
    monkeypatch.setitem(sys.modules, "torch_neuronx", None)  # makes `import torch_neuronx` fail
    with pytest.raises(KernelError, match="torch-neuronx"):
        nki_loader.load_kernel("rope_hf")


# One top-level launcher per MoE direction, calling nki-library's kernels nested as it does.


@pytest.mark.parametrize("name", ["moe_blockwise_fwd", "moe_blockwise_bwd"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_moe_launchers_pass_the_activations_dtype_as_compute_dtype(neuron, name, dtype):
    launcher = nki_loader.load_kernel(name)
    assert isinstance(launcher, fake_nki.JitKernel) and launcher.mode is None
    args = [a.to(dtype) if torch.is_floating_point(a) else a for a in experts_case()[:-1]]
    args.append(experts_case()[-1])
    if name == "moe_blockwise_fwd":
        grouped_experts_nki(*args)
        (call,) = launcher.calls
    else:
        _, gate_up_act, down_act = grouped_experts_reference(*args)
        grad = torch.randn(64, 512).to(dtype)
        grouped_experts_backward_nki(grad, *args[:4], gate_up_act, down_act, *args[4:])
        (call,) = launcher.calls
    assert call["compute_dtype"] == str(dtype).removeprefix("torch.")
    inner = sys.modules["nki.language"]
    assert getattr(inner, call["compute_dtype"]) is dtype


def test_grouped_experts_run_moe_cte_and_blockwise_mm_bwd_end_to_end_in_float32(neuron):
    # Both kernels default compute_dtype to bfloat16 and the fakes round through it: without
    # compute_dtype=float32 the results are bfloat16-close only, far outside 1e-4.
    args = experts_case()
    got = grouped_experts_nki(*args)
    want = grouped_experts_reference(*args)
    for g, w in zip(got, want, strict=True):
        torch.testing.assert_close(g, w, rtol=1e-4, atol=1e-4)
    grad = torch.randn_like(want[0])
    got = grouped_experts_backward_nki(grad, *args[:4], *want[1:], *args[4:])
    expected = grouped_experts_backward_reference(grad, *args[:4], *want[1:], *args[4:])
    for g, w in zip(got, expected, strict=True):
        torch.testing.assert_close(g, w, rtol=1e-4, atol=1e-4)
    (call,) = nki_loader.load_kernel("moe_blockwise_fwd").calls
    assert call["hidden_states"].shape == (65, 512), "the zero padding row T is added"
    assert call["block_to_expert"].shape == (args[5].numel(), 1), "block_to_expert is [N, 1]"


def test_a_library_without_the_moe_kernels_is_refused_naming_the_minimum_version(monkeypatch):
    monkeypatch.setattr(nki_loader, "_cache", {})
    fakes.install(monkeypatch, "2.27")
    with pytest.raises(KernelError, match=r"nki-library 2\.28") as refused:
        nki_loader.load_kernel("moe_blockwise_bwd")
    assert ". " not in str(refused.value), "one sentence"


def test_rope_takes_one_table_per_sample_in_one_launch(neuron):
    torch.manual_seed(0)
    q, k = torch.randn(2, 256, 4, 16), torch.randn(2, 256, 2, 16)
    tables = torch.stack([rope_cache(300, 16), rope_cache(300, 16).roll(7, 0)])
    got = rope_nki(q, k, tables, False)
    for b in range(2):
        want = rope_reference(q[b : b + 1], k[b : b + 1], tables[b])
        for g, w in zip(got, want, strict=True):
            torch.testing.assert_close(g[b : b + 1], w, rtol=1e-6, atol=1e-6)
    (call,) = neuron["rope_hf"].calls
    assert call["rope_cache"].shape == (2, 300, 32), "rope_hf's [batch, seq, 2 * head_dim] form"


def test_the_replacement_log_names_the_route(neuron, caplog):
    from qwentitan.kernels import ReplacementRule, apply_replacements

    rule = ReplacementRule("rope", lambda c: "kernel", "nki_rope", op="rope", use_nki=True)
    with caplog.at_level("INFO", logger="qwentitan.kernels"):
        apply_replacements({"rope": "torchtitan"}, [rule])
    assert "nki_rope  rope  (nki.jit as nki_op custom ops on neuron, reference twin elsewhere)" in (
        caplog.text
    )


def test_the_moe_backward_passes_shard_on_free_only_where_the_library_has_it(neuron, request):
    args = experts_case()
    _, gate_up_act, down_act = grouped_experts_reference(*args)
    grad = torch.randn(64, 512)
    grouped_experts_backward_nki(grad, *args[:4], gate_up_act, down_act, *args[4:])
    (call,) = neuron["blockwise_mm_bwd"].nested_calls
    options = sys.modules["nkilib.experimental.moe.bwd.moe_bwd_parameters"]
    sharding = {k: call[k].name for k in ("shard_option", "affinity_option")}
    print(f"\n{request.node.callspec.id}: blockwise_mm_bwd got {sharding}")
    if hasattr(options.ShardOption, "SHARD_ON_FREE"):  # 092a49d: the options are validated
        assert sharding == {"shard_option": "SHARD_ON_FREE", "affinity_option": "AFFINITY_ON_H"}
    else:  # 2.29: the library's defaults, which it never reads
        assert sharding == {"shard_option": "SHARD_ON_HIDDEN", "affinity_option": "AFFINITY_ON_H"}


def test_the_newer_moe_backward_refuses_its_own_defaults(monkeypatch):
    # Why the loader passes the options: 092a49d's defaults fail its own validation.
    monkeypatch.setattr(nki_loader, "_cache", {})
    monkeypatch.setenv("NEURON_LOGICAL_NC_CONFIG", "2")
    fakes.install(monkeypatch, "092a49d")
    monkeypatch.setattr(nki_loader, "moe_backward_sharding", lambda _: {})  # the old call
    args = experts_case()
    _, gate_up_act, down_act = grouped_experts_reference(*args)
    grad = torch.randn(64, 512)
    with pytest.raises(AssertionError, match="SHARD_ON_HIDDEN only supports AFFINITY_ON_I"):
        grouped_experts_backward_nki(grad, *args[:4], gate_up_act, down_act, *args[4:])


class _Ops(torch.utils._python_dispatch.TorchDispatchMode):
    """The ops dispatched inside it, by name."""

    def __init__(self):
        super().__init__()
        self.names = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.names.append(str(func.overloadpacket))
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("host", ["documented", "documented-without-nki_op"])
def test_the_neuron_implementations_run_through_nki_op_where_torch_neuronx_has_it(
    monkeypatch, host
):
    from qwentitan.kernels import neuron_dispatch

    monkeypatch.setattr(nki_loader, "_cache", {})
    monkeypatch.setenv("NEURON_LOGICAL_NC_CONFIG", "2")
    neuron = fakes.install(monkeypatch, host=host)
    q, k = torch.randn(1, 256, 2, 16), torch.randn(1, 256, 2, 16)
    cache = rope_cache(256, 16)
    with _Ops() as seen:
        got = neuron_dispatch.neuron_impl("rope")(q, k, cache, True)
    for g, w in zip(got, rope_reference(q, k, cache), strict=True):
        torch.testing.assert_close(g, w, rtol=1e-6, atol=1e-6)
    assert neuron["rope_hf"].calls, "the NKI kernel ran"
    through = "qwentitan_nki.rope" in seen.names
    assert nki_loader.has_nki_op() == through == (host == "documented"), seen.names
    if through:  # every op, each with the schema of its qwentitan:: op but use_nki
        assert nki_loader.register_nki_ops() == [
            "causal_attention", "causal_attention_backward", "grouped_experts",
            "grouped_experts_backward", "rope", "rope_backward",
        ]  # fmt: skip
        schema = str(torch.ops.qwentitan_nki.rope.default._schema)
        assert schema == (
            "qwentitan_nki::rope(Tensor query, Tensor key, Tensor rope_cache) -> (Tensor, Tensor)"
        )
