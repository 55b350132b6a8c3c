"""The hf path under torchtitan's checkpoint formats: the same DCP calls torchtitan's
checkpointer makes for `initial_load_in_hf` (dcp_load, from_hf) and `last_save_in_hf`
(dcp_save, to_hf), and its own DCP checkpoints (ModelWrapper state dict)."""

import shutil

import pytest
import torch
import torch.distributed.checkpoint as dcp
from safetensors import safe_open
from torch.distributed.checkpoint import HuggingFaceStorageWriter
from torchtitan.components.checkpoint import ModelWrapper
from transformers import AutoModelForCausalLM

from qwentitan.modeling import flavor_to_hf_config, model_spec

from .conftest import hf_logits

FOLDERS = {"tiny-dense": "tiny_dense_folder", "tiny-moe": "tiny_moe_folder"}


def _fresh(flavor):
    spec = model_spec(flavor, "hf")
    with torch.device("meta"):
        model = spec.model.build()
    model.to_empty(device="cpu")
    model.init_weights()
    return spec, model.eval()


@pytest.mark.parametrize("flavor", sorted(FOLDERS))
def test_initial_load_in_hf_through_dcp(flavor, tokens, request):
    folder = request.getfixturevalue(FOLDERS[flavor])
    spec, model = _fresh(flavor)
    adapter = spec.state_dict_adapter(spec.model, str(folder))
    # torchtitan's DCPCheckpointer.dcp_load(from_hf=True), step by step
    hf_state = adapter.to_hf(ModelWrapper(model).state_dict())
    dcp.load(hf_state, storage_reader=adapter.get_hf_storage_reader(str(folder)))
    ModelWrapper(model).load_state_dict(adapter.from_hf(hf_state))
    with torch.no_grad():
        assert (model(tokens) - hf_logits(folder, tokens)).abs().max().item() <= 1e-5


@pytest.mark.parametrize("flavor", sorted(FOLDERS))
def test_last_save_in_hf_reloads_in_transformers(flavor, tokens, tmp_path, request):
    folder = request.getfixturevalue(FOLDERS[flavor])
    spec = model_spec(flavor, "hf", hf_folder=folder)
    with torch.device("meta"):
        model = spec.model.build()
    model.to_empty(device="cpu")
    model.init_weights()
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.01 * torch.randn_like(p))  # trained: no longer the folder's weights
        expected = model.eval()(tokens)
    adapter = spec.state_dict_adapter(spec.model, None)
    # torchtitan's DCPCheckpointer.dcp_save(to_hf=True) without an index mapping
    out = tmp_path / "export"
    dcp.save(
        adapter.to_hf(ModelWrapper(model).state_dict()),
        storage_writer=HuggingFaceStorageWriter(
            path=str(out), save_distributed=True, enable_consolidation=True
        ),
    )
    with safe_open(next(out.glob("*.safetensors")), framework="pt") as f:
        keys = set(f.keys())
    assert "model.layers.0.mlp.experts.gate_up_proj" not in keys
    if flavor == "tiny-moe":
        assert "model.layers.0.mlp.experts.7.down_proj.weight" in keys
    else:
        assert "lm_head.weight" not in keys  # tied, as save_pretrained writes it
    flavor_to_hf_config(flavor).save_pretrained(out)
    shutil.rmtree(out / "sharded", ignore_errors=True)
    reloaded = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    with torch.no_grad():
        assert (reloaded(tokens).logits - expected).abs().max().item() <= 1e-5


def test_dcp_checkpoint_round_trip(tiny_moe_folder, tokens, tmp_path):
    spec = model_spec("tiny-moe", "hf", hf_folder=tiny_moe_folder)
    with torch.device("meta"):
        model = spec.model.build()
    model.to_empty(device="cpu")
    model.init_weights()
    dcp.save(ModelWrapper(model).state_dict(), checkpoint_id=str(tmp_path / "step-1"))
    _, restored = _fresh("tiny-moe")
    state = ModelWrapper(restored).state_dict()
    dcp.load(state, checkpoint_id=str(tmp_path / "step-1"))
    ModelWrapper(restored).load_state_dict(state)
    with torch.no_grad():
        assert torch.equal(restored(tokens), model.eval()(tokens))
