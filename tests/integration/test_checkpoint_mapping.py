"""qwentitan.checkpoint's name table is the one torchtitan's Qwen3StateDictAdapter uses."""

from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp
from safetensors.torch import load_file
from torch.distributed.checkpoint import FileSystemReader
from torchtitan.models.qwen3.state_dict_adapter import Qwen3StateDictAdapter
from transformers import AutoModelForCausalLM, Qwen3Config, Qwen3MoeConfig

from qwentitan.checkpoint import to_dcp, to_hf
from qwentitan.checkpoint.logits import titan_model_config

COMMON = dict(
    vocab_size=96,
    hidden_size=32,
    intermediate_size=48,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=8,
    max_position_embeddings=64,
)


def _hf_folder(root: Path, moe: bool) -> Path:
    torch.manual_seed(0)
    if moe:
        config = Qwen3MoeConfig(
            **COMMON,
            moe_intermediate_size=16,
            num_experts=4,
            num_experts_per_tok=2,
            norm_topk_prob=True,
            tie_word_embeddings=False,
        )
    else:
        config = Qwen3Config(**COMMON, tie_word_embeddings=True)
    AutoModelForCausalLM.from_config(config).save_pretrained(root / "hf")
    return root / "hf"


def _read_all(folder: Path) -> dict[str, torch.Tensor]:
    md = FileSystemReader(folder).read_metadata()
    out = {
        k: torch.empty(v.size, dtype=v.properties.dtype) for k, v in md.state_dict_metadata.items()
    }
    dcp.load(out, storage_reader=FileSystemReader(folder), no_dist=True)
    return out


@pytest.mark.parametrize("moe", [False, True], ids=["dense-tied", "moe"])
def test_table_matches_torchtitan_adapter_both_ways(tmp_path, moe):
    import json

    hf_dir = _hf_folder(tmp_path, moe)
    config = json.loads((hf_dir / "config.json").read_text())
    model_config = titan_model_config(config, hf_dir / "config.json")
    adapter = Qwen3StateDictAdapter(model_config, None)
    hf_sd = load_file(hf_dir / "model.safetensors")

    to_dcp(hf_dir, tmp_path / "dcp")
    ours = _read_all(tmp_path / "dcp")
    theirs = adapter.from_hf(dict(hf_sd))  # from_hf mutates its argument (torchtitan #3557)

    bias = {k for k in ours if k.endswith("moe.expert_bias_E")}
    assert bool(bias) == moe  # torchtitan's buffer, absent from HF and from the adapter's output
    assert set(ours) - bias == set(theirs)
    for name, value in theirs.items():
        assert torch.equal(ours[name], value), name

    # The DCP holds exactly the keys torchtitan's Qwen3 state dict has: what its loader asks for.
    model = model_config.build()
    assert set(ours) == set(model.state_dict())

    to_hf(tmp_path / "dcp", tmp_path / "back")
    exported = load_file(tmp_path / "back" / "model.safetensors")
    back = adapter.to_hf({k: v for k, v in ours.items() if k not in bias})
    assert set(exported) == set(back) == set(hf_sd)
    for name, value in back.items():
        assert torch.equal(exported[name], value), name
