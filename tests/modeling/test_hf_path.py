"""The hf path: transformers' own Qwen3 behind torchtitan's protocols, Hub layout in and out."""

import json
from types import SimpleNamespace

import pytest
import torch
import torch.distributed as dist
from safetensors.torch import load_file, save_file
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor
from torchtitan.config import ParallelismConfig, TrainingConfig
from torchtitan.distributed.activation_checkpoint import FullAC, SelectiveAC
from transformers import AutoModelForCausalLM

from qwentitan.modeling import (
    ModelingError,
    flavor_to_hf_config,
    flops_per_token,
    get_flavor,
    model_spec,
    param_counts,
)
from qwentitan.modeling.hf_path import parallelize_hf_qwen3
from qwentitan.modeling.hf_weights import (
    hub_to_memory,
    open_hub_folder,
    read_hub_state_dict,
    read_memory_tensor,
)

from .conftest import hf_logits

FOLDERS = {"tiny-dense": "tiny_dense_folder", "tiny-moe": "tiny_moe_folder"}


def _build(flavor, folder=None, **kwargs):
    """The way torchtitan's trainer builds it: on meta, materialised, then init_states."""
    spec = model_spec(flavor, "hf", hf_folder=folder, **kwargs)
    with torch.device("meta"):
        model = spec.model.build()
    model.to_empty(device="cpu")
    model.init_weights()
    return spec, model.eval()


@pytest.mark.parametrize("flavor", sorted(FOLDERS))
def test_logits_equal_transformers_on_the_folders_weights(flavor, tokens, request):
    folder = request.getfixturevalue(FOLDERS[flavor])
    _, model = _build(flavor, folder)
    with torch.no_grad():
        diff = (model(tokens) - hf_logits(folder, tokens)).abs().max().item()
    print(f"hf {flavor} max|diff| vs transformers from_pretrained: {diff:.3e}")
    assert diff == 0.0  # the same transformers model on the same weights: bit-identical


def test_without_a_folder_transformers_initialises_the_model():
    _, model = _build("tiny-dense")
    assert model.model.lm_head.weight is model.model.model.embed_tokens.weight  # re-tied
    inv_freq = model.model.model.rotary_emb.inv_freq
    assert torch.allclose(inv_freq[:2], torch.tensor([1.0, 1e6 ** (-2 / 32)]))
    assert 0.015 < model.model.model.layers[0].self_attn.q_proj.weight.std() < 0.025


@pytest.mark.parametrize("flavor", sorted(FOLDERS))
def test_checkpoint_conversion_speaks_the_hub_layout(flavor, request):
    folder = request.getfixturevalue(FOLDERS[flavor])
    spec, model = _build(flavor, folder)
    adapter = spec.state_dict_adapter(spec.model, str(folder))
    on_disk = {}
    for file in folder.glob("*.safetensors"):
        on_disk.update(load_file(file))
    exported = adapter.to_hf(model.state_dict())
    assert exported.keys() == on_disk.keys()  # per-expert keys, tied head omitted
    assert all(torch.equal(exported[k], on_disk[k]) for k in on_disk)
    assert model.hub_state_dict().keys() == on_disk.keys()
    # and back: what torchtitan's checkpointer would load into a fresh model
    _, fresh = _build(flavor)
    fresh.load_state_dict(adapter.from_hf(on_disk), strict=True)
    assert all(
        torch.equal(a, b) for a, b in zip(fresh.parameters(), model.parameters(), strict=True)
    )


def test_exported_weights_reload_in_transformers(tiny_moe_folder, tokens, tmp_path):
    _, model = _build("tiny-moe", tiny_moe_folder)
    with torch.no_grad():
        for p in model.parameters():
            p.mul_(1.01)  # a "trained" model, different from the folder
        expected = model(tokens)
    flavor_to_hf_config("tiny-moe").save_pretrained(tmp_path)
    save_file(model.hub_state_dict(), tmp_path / "model.safetensors", metadata={"format": "pt"})
    reloaded = AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.float32).eval()
    with torch.no_grad():
        assert (reloaded(tokens).logits - expected).abs().max().item() <= 1e-5


def test_incomplete_checkpoint_is_refused(tiny_moe_folder, tiny_dense_folder, tmp_path):
    hub = read_hub_state_dict(tiny_moe_folder)
    del hub["model.layers.1.mlp.experts.5.up_proj.weight"]
    with pytest.raises(ModelingError, match=r"layers\.1\.mlp\.experts\.\*\.up_proj.*missing \[5\]"):
        hub_to_memory(hub, get_flavor("tiny-moe"))
    with pytest.raises(ModelingError, match="holds MoE experts but flavor 'tiny-dense' is dense"):
        hub_to_memory(read_hub_state_dict(tiny_moe_folder), get_flavor("tiny-dense"))
    _, model = _build("tiny-moe")
    with pytest.raises(ModelingError, match=r"does not fit flavor 'tiny-moe'.*missing"):
        model.load_hub_folder(open_hub_folder(tiny_dense_folder))
    (tmp_path / "config.json").write_text(json.dumps(flavor_to_hf_config("tiny-dense").to_dict()))
    with pytest.raises(
        ModelingError, match=r"holds neither model\.safetensors nor model\.safetensors\.index\.json"
    ):
        _build("tiny-dense", tmp_path)


def test_parallelisms_other_than_fsdp_are_refused():
    config = model_spec("tiny-dense", "hf").model
    job = SimpleNamespace(
        parallelism=ParallelismConfig(tensor_parallel_degree=2), training=TrainingConfig()
    )
    with pytest.raises(ModelingError, match="tensor_parallel_degree=2"):
        config.update_from_config(config=job)
    # torchtitan 0.3.0's default backend (spmd_types) needs its own Module sharding configs
    spmd_job = SimpleNamespace(parallelism=ParallelismConfig(), training=TrainingConfig())
    with pytest.raises(ModelingError, match="'partial_dtensor', not 'spmd_types'"):
        config.update_from_config(config=spmd_job)
    fsdp_only = ParallelismConfig(data_parallel_shard_degree=-1, spmd_backend="partial_dtensor")
    config.update_from_config(
        config=SimpleNamespace(parallelism=fsdp_only, training=TrainingConfig())
    )
    long_job = SimpleNamespace(parallelism=fsdp_only, training=TrainingConfig(seq_len=4096))
    with pytest.raises(ModelingError, match="exceeds flavor 'tiny-dense'"):
        config.update_from_config(config=long_job)


def test_varlen_is_not_an_hf_backend():
    with pytest.raises(ModelingError, match="not 'varlen'"):
        model_spec("tiny-dense", "hf", attn_backend="varlen")


def test_counts_and_flops_come_from_the_one_formula():
    spec, model = _build("tiny-moe")
    nparams, flops = spec.model.get_nparams_and_flops(model, 256)
    assert nparams == param_counts("tiny-moe").total
    assert flops == flops_per_token("tiny-moe", 256)


@pytest.fixture
def one_rank_group(tmp_path):
    dist.init_process_group("gloo", init_method=f"file://{tmp_path}/pg", rank=0, world_size=1)
    yield init_device_mesh("cpu", (1,), mesh_dim_names=("fsdp",))
    dist.destroy_process_group()


@pytest.mark.parametrize("flavor", sorted(FOLDERS))
def test_fsdp_sharded_model_loads_the_folder_and_matches(flavor, tokens, one_rank_group, request):
    folder = request.getfixturevalue(FOLDERS[flavor])
    spec = model_spec(flavor, "hf", hf_folder=folder)
    with torch.device("meta"):
        model = spec.model.build()
    dims = SimpleNamespace(
        fsdp_enabled=True, dp_replicate_enabled=False, get_mesh=lambda names: one_rank_group
    )
    parallelize_hf_qwen3(
        model,
        parallel_dims=dims,
        # float32 compute so the comparison measures loading and sharding, not bf16 rounding
        training=TrainingConfig(mixed_precision_param="float32"),
        parallelism=ParallelismConfig(),
        compile_config=SimpleNamespace(enable=False, components=[]),
        ac_config=None,
        dump_folder="",
    )
    assert isinstance(model.layers[0].self_attn.q_proj.weight, DTensor)
    model.to_empty(device="cpu")
    model.init_weights()
    with torch.no_grad():
        diff = (model(tokens) - hf_logits(folder, tokens)).abs().max().item()
    print(f"hf {flavor} under FSDP2 max|diff| vs transformers from_pretrained: {diff:.3e}")
    assert diff == 0.0  # one rank: FSDP2 gathers the same values, no reduction reorders them


def test_trains_on_cpu_and_takes_torchtitans_positions():
    _, model = _build("tiny-moe")
    model.train()
    tokens = torch.randint(0, 151936, (2, 32))
    positions = torch.arange(32).expand(2, 32)
    logits = model(tokens, positions=positions)
    with torch.no_grad():
        assert torch.equal(logits, model(tokens))
    torch.nn.functional.cross_entropy(
        logits[:, :-1].flatten(0, 1), tokens[:, 1:].flatten()
    ).backward()
    assert model.layers[0].mlp.experts.gate_up_proj.grad.abs().sum() > 0
    assert all(torch.isfinite(p.grad).all() for p in model.parameters() if p.grad is not None)


def test_a_shard_reads_only_its_region(tiny_moe_folder):
    flavor = get_flavor("tiny-moe")
    full = hub_to_memory(read_hub_state_dict(tiny_moe_folder), flavor)
    key = "model.layers.1.mlp.experts.gate_up_proj"
    hub = open_hub_folder(tiny_moe_folder)
    region = (slice(2, 5), slice(10, 100), slice(0, 64))
    assert torch.equal(read_memory_tensor(hub, key, flavor, region, (3, 90, 64)), full[key][region])
    down = "model.layers.0.mlp.experts.down_proj"
    region = (slice(6, 8), slice(0, 64), slice(3, 40))
    assert torch.equal(
        read_memory_tensor(hub, down, flavor, region, (2, 64, 37)),
        full[down][region],
    )
    norm = "model.layers.0.input_layernorm.weight"
    assert torch.equal(
        read_memory_tensor(hub, norm, flavor, (slice(16, 48),), (32,)), full[norm][16:48]
    )
    empty = read_memory_tensor(
        hub, key, flavor, (slice(8, 8), slice(0, 128), slice(0, 64)), (0, 128, 64)
    )
    assert empty.shape == (0, 128, 64)
    q = "model.layers.0.self_attn.q_proj.weight"  # a plain 2-d weight: rows and columns cut
    region = (slice(5, 20), slice(3, 50))
    assert torch.equal(read_memory_tensor(hub, q, flavor, region, (15, 47)), full[q][region])


def test_torchtitans_activation_checkpointing_wraps_the_transformers_layers(tokens):
    spec, model = _build("tiny-moe")
    assert spec.post_optimizer_build_fn is None  # nothing to balance in transformers' MoE
    with torch.no_grad():
        before = model(tokens)
    _checkpointed(model, FullAC.Config())
    assert all(type(layer).__name__ == "CheckpointWrapper" for layer in model.layers)
    model.train()
    logits = model(tokens)
    logits.sum().backward()
    assert torch.equal(logits.detach(), before)
    assert model.model.model.embed_tokens.weight.grad is not None


def _checkpointed(model, ac_config):
    """`parallelize_hf_qwen3` on one rank: activation checkpointing only."""
    parallelize_hf_qwen3(
        model,
        parallel_dims=SimpleNamespace(fsdp_enabled=False, dp_replicate_enabled=False),
        training=TrainingConfig(),
        parallelism=ParallelismConfig(),
        compile_config=SimpleNamespace(enable=False, components=[]),
        ac_config=ac_config,
        dump_folder="",
    )


def _grads_under(ac_config, tokens, positions):
    torch.manual_seed(3)  # the same initial weights under each policy
    _, model = _build("tiny-dense")
    _checkpointed(model, ac_config)
    model.train()
    model(tokens, positions=positions).square().mean().backward()
    return {name: p.grad for name, p in model.named_parameters()}


def test_selective_activation_checkpointing_recomputes_what_full_checkpointing_does(tokens):
    # torchtitan's loaders restart positions at every packed document
    positions = torch.cat([torch.arange(20), torch.arange(28)]).expand(2, -1)
    full = _grads_under(FullAC.Config(), tokens, positions)
    selective = _grads_under(SelectiveAC.Config(), tokens, positions)
    assert full.keys() == selective.keys()
    for name, grad in full.items():
        torch.testing.assert_close(selective[name], grad, msg=name)


def test_attention_is_causal_over_the_whole_window_across_documents(tokens):
    """As torchtitan's SDPA: a document restart in the positions masks nothing."""
    _, model = _build("tiny-dense")
    positions = torch.cat([torch.arange(20), torch.arange(28)]).expand(2, -1)
    other = tokens.clone()
    other[:, :20] = (other[:, :20] + 1) % 151936  # another first document
    with torch.no_grad():
        second = model(tokens, positions=positions)[:, 20:]
        second_after_other_first = model(other, positions=positions)[:, 20:]
    assert not torch.allclose(second, second_after_other_first)
