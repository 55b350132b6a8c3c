"""Checkpoints made by transformers' save_pretrained: HF -> DCP -> torchtitan Qwen3 -> HF."""

import json
import shutil
import sys
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM, Qwen3Config, Qwen3MoeConfig

from qwentitan.checkpoint import convert, to_dcp, to_hf, verify
from qwentitan.checkpoint.cli import main
from qwentitan.checkpoint.logits import (
    RELATIVE_TOLERANCE,
    load_titan_model,
    prompt,
    titan_model_config,
)

from .conftest import folder_tensors

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
KINDS = {
    "dense-tied": lambda: Qwen3Config(**COMMON, tie_word_embeddings=True),
    "dense-untied": lambda: Qwen3Config(**COMMON, tie_word_embeddings=False),
    "moe": lambda: Qwen3MoeConfig(
        **COMMON,
        moe_intermediate_size=16,
        num_experts=4,
        num_experts_per_tok=2,
        norm_topk_prob=True,
        tie_word_embeddings=False,
    ),
}


@pytest.fixture(scope="module", params=[*KINDS, "dense-tied-chunked", "moe-chunked"])
def converted(request, tmp_path_factory):
    root = tmp_path_factory.mktemp(request.param)
    kind = request.param.removesuffix("-chunked")
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(KINDS[kind]()).eval()
    model.save_pretrained(root / "hf", max_shard_size="40KB")  # several shards + index
    with pytest.MonkeyPatch.context() as patch:
        if request.param.endswith("-chunked"):  # every tensor in row chunks, as large ones are
            patch.setattr(convert, "CHUNK_BYTES", 200)
        to_dcp(root / "hf", root / "dcp")
    with torch.no_grad():
        logits = model(prompt(COMMON["vocab_size"])).logits
    return kind, root, logits


def test_dcp_loads_into_torchtitan_qwen3_with_transformers_logits(converted):
    _, root, expected = converted
    config = json.loads((root / "hf" / "config.json").read_text())
    # CheckpointManager(initial_load_path=..., model-only): torchtitan's own loading path.
    titan = load_titan_model(root / "dcp", config, root / "hf" / "config.json")
    with torch.no_grad():
        got = titan(prompt(COMMON["vocab_size"]))
    assert got.shape == expected.shape
    # float32 throughout, MoE experts included: agreement to float32 rounding.
    tolerance = RELATIVE_TOLERANCE * expected.abs().max()
    assert (got - expected).abs().max() <= tolerance
    # A model that loaded nothing would not be this close: the weights really came from the DCP.
    assert expected.abs().max() > 100 * tolerance


def test_dcp_load_equals_torchtitans_own_hf_import_bit_for_bit(converted):
    """The trainer's DCP load of to-dcp's output builds the very model torchtitan builds from
    the HF folder itself (its Qwen3StateDictAdapter.from_hf): identical logits, bit for bit.
    Against transformers' Qwen3 only float32 rounding can differ, as the test above allows:
    two implementations of one model do not round alike."""
    from torchtitan.models.qwen3.state_dict_adapter import Qwen3StateDictAdapter

    _, root, _ = converted
    config_file = root / "hf" / "config.json"
    config = json.loads(config_file.read_text())
    from_dcp = load_titan_model(root / "dcp", config, config_file)

    model_config = titan_model_config(config, config_file)
    model = model_config.build()
    model.init_states(buffer_device=None)
    adapter = Qwen3StateDictAdapter(model_config, str(root / "hf"))
    missing, unexpected = model.load_state_dict(
        adapter.from_hf(folder_tensors(root / "hf")), strict=False
    )
    assert not unexpected
    # torchtitan's load-balancing buffer has no HF counterpart; both routes start it at zero.
    assert all(k.endswith("expert_bias_E") for k in missing)
    tokens = prompt(COMMON["vocab_size"])
    with torch.no_grad():
        assert torch.equal(from_dcp(tokens), model.eval()(tokens))


def test_hf_dcp_hf_is_bitwise_identical_and_reloads(converted):
    _, root, expected = converted
    to_hf(root / "dcp", root / "back", max_shard_size="40KB", overwrite=True)
    before, after = folder_tensors(root / "hf"), folder_tensors(root / "back")
    assert before.keys() == after.keys()
    for name in before:
        assert before[name].dtype == after[name].dtype and torch.equal(before[name], after[name]), (
            name
        )

    model, info = AutoModelForCausalLM.from_pretrained(root / "back", output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"] and not info["mismatched_keys"]
    with torch.no_grad():
        assert torch.equal(model.eval()(prompt(COMMON["vocab_size"])).logits, expected)


def test_verify_with_logits_passes_and_catches_a_flipped_value(converted):
    _, root, _ = converted
    report = verify(root / "hf", root / "dcp", logits=True)
    assert report.ok, report.format()
    assert report.logits_max_abs_diff is not None
    assert report.logits_max_abs_diff <= report.logits_tolerance

    changed = root / "changed"
    shutil.rmtree(changed, ignore_errors=True)
    model = AutoModelForCausalLM.from_pretrained(root / "hf")
    with torch.no_grad():
        weight = model.model.layers[1].self_attn.o_proj.weight
        weight[2, 3] = weight[2, 3] + 1.0
    model.save_pretrained(changed)
    report = verify(changed, root / "dcp")
    assert not report.ok
    assert [(d.name, d.differing) for d in report.value_mismatches] == [
        ("layers.1.attention.wo.weight", 1)
    ]


def test_cli_verify_exit_codes(converted, capsys):
    kind, root, _ = converted
    if kind != "dense-tied" or "chunked" in root.name:
        pytest.skip("the CLI path is the same for every kind; one is enough")
    assert main(["verify", str(root / "hf"), str(root / "dcp")]) == 0
    assert "identical" in capsys.readouterr().out
    assert main(["to-dcp", str(root / "hf"), str(root / "dcp")]) == 2
    err = capsys.readouterr().err
    assert "already exists" in err and "Traceback" not in err
    # The console script the package declares is installed next to this interpreter.
    assert Path(sys.executable).with_name("qwentitan-ckpt").exists()


def test_verify_logits_names_the_tensors_holding_nan_or_inf(tmp_path, capsys):
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(KINDS["dense-untied"]()).eval()
    with torch.no_grad():
        model.model.layers[1].mlp.up_proj.weight[2, 3] = float("nan")
        model.model.norm.weight[0] = float("inf")
    model.save_pretrained(tmp_path / "hf")
    to_dcp(tmp_path / "hf", tmp_path / "dcp")
    assert main(["verify", str(tmp_path / "hf"), str(tmp_path / "dcp"), "--logits"]) == 1
    out = capsys.readouterr().out
    assert "tolerance nan" not in out
    assert "logits are NaN or Inf, so they cannot be compared" in out
    assert "layers.1.feed_forward.w3.weight" in out and "norm.weight" in out
    assert "result: DIFFERENT" in out
