"""Tiny Qwen3 / Qwen3-MoE Hugging Face folders written by hand (no transformers here).

The names below are spelled out independently of qwentitan.checkpoint.layout so a wrong
table there fails these tests.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

VOCAB, HIDDEN, LAYERS, HEADS, KV_HEADS, HEAD_DIM, FFN = 48, 16, 2, 4, 2, 8, 24
EXPERTS, MOE_FFN = 4, 8


def hf_config(*, moe: bool, tied: bool) -> dict:
    config = {
        "architectures": ["Qwen3MoeForCausalLM" if moe else "Qwen3ForCausalLM"],
        "model_type": "qwen3_moe" if moe else "qwen3",
        "vocab_size": VOCAB,
        "hidden_size": HIDDEN,
        "num_hidden_layers": LAYERS,
        "num_attention_heads": HEADS,
        "num_key_value_heads": KV_HEADS,
        "head_dim": HEAD_DIM,
        "intermediate_size": FFN,
        "tie_word_embeddings": tied,
        "rms_norm_eps": 1e-6,
        "rope_theta": 1000000.0,
        "eos_token_id": 2,
        "bos_token_id": 1,
    }
    if moe:
        config |= {
            "num_experts": EXPERTS,
            "moe_intermediate_size": MOE_FFN,
            "num_experts_per_tok": 2,
            "decoder_sparse_step": 1,
            "mlp_only_layers": [],
        }
    return config


def hf_tensors(
    *, moe: bool, tied: bool, dtype: torch.dtype, seed: int = 0
) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)

    def rnd(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=g).to(dtype)

    t = {"model.embed_tokens.weight": rnd(VOCAB, HIDDEN), "model.norm.weight": rnd(HIDDEN)}
    if not tied:
        t["lm_head.weight"] = rnd(VOCAB, HIDDEN)
    for i in range(LAYERS):
        p = f"model.layers.{i}."
        t[p + "self_attn.q_proj.weight"] = rnd(HEADS * HEAD_DIM, HIDDEN)
        t[p + "self_attn.k_proj.weight"] = rnd(KV_HEADS * HEAD_DIM, HIDDEN)
        t[p + "self_attn.v_proj.weight"] = rnd(KV_HEADS * HEAD_DIM, HIDDEN)
        t[p + "self_attn.o_proj.weight"] = rnd(HIDDEN, HEADS * HEAD_DIM)
        t[p + "self_attn.q_norm.weight"] = rnd(HEAD_DIM)
        t[p + "self_attn.k_norm.weight"] = rnd(HEAD_DIM)
        t[p + "input_layernorm.weight"] = rnd(HIDDEN)
        t[p + "post_attention_layernorm.weight"] = rnd(HIDDEN)
        if moe:
            t[p + "mlp.gate.weight"] = rnd(EXPERTS, HIDDEN)
            for e in range(EXPERTS):
                t[p + f"mlp.experts.{e}.gate_proj.weight"] = rnd(MOE_FFN, HIDDEN)
                t[p + f"mlp.experts.{e}.up_proj.weight"] = rnd(MOE_FFN, HIDDEN)
                t[p + f"mlp.experts.{e}.down_proj.weight"] = rnd(HIDDEN, MOE_FFN)
        else:
            t[p + "mlp.gate_proj.weight"] = rnd(FFN, HIDDEN)
            t[p + "mlp.up_proj.weight"] = rnd(FFN, HIDDEN)
            t[p + "mlp.down_proj.weight"] = rnd(HIDDEN, FFN)
    return t


def write_hf(
    folder: Path,
    tensors: dict[str, torch.Tensor],
    config: dict,
    shards: int = 1,
) -> Path:
    folder.mkdir(parents=True)
    (folder / "config.json").write_text(json.dumps(config))
    (folder / "generation_config.json").write_text(json.dumps({"eos_token_id": 2}))
    names = list(tensors)
    if shards == 1:
        save_file(tensors, folder / "model.safetensors", metadata={"format": "pt"})
        return folder
    weight_map = {}
    for s in range(shards):
        file = f"model-{s + 1:05d}-of-{shards:05d}.safetensors"
        part = {n: tensors[n] for n in names[s::shards]}
        save_file(part, folder / file, metadata={"format": "pt"})
        weight_map |= dict.fromkeys(part, file)
    index = {"metadata": {}, "weight_map": weight_map}
    (folder / "model.safetensors.index.json").write_text(json.dumps(index))
    return folder


@pytest.fixture
def make_hf(tmp_path: Path) -> Callable[..., Path]:
    """make_hf(name, moe=False, tied=True, shards=2, dtype=bfloat16) -> a HF model folder."""

    def make(
        name: str = "hf",
        *,
        moe: bool = False,
        tied: bool = True,
        shards: int = 2,
        dtype: torch.dtype = torch.bfloat16,
    ) -> Path:
        tensors = hf_tensors(moe=moe, tied=tied, dtype=dtype)
        return write_hf(tmp_path / name, tensors, hf_config(moe=moe, tied=tied), shards)

    return make


def load_hf(folder: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    out: dict[str, torch.Tensor] = {}
    for file in sorted(folder.glob("*.safetensors")):
        out |= load_file(file)
    return out


def bitwise_equal(a: torch.Tensor, b: torch.Tensor) -> bool:
    return (
        a.dtype == b.dtype
        and a.shape == b.shape
        and torch.equal(a.contiguous().view(torch.uint8), b.contiguous().view(torch.uint8))
    )


def load_dcp(folder: Path) -> dict[str, torch.Tensor]:
    """Every tensor of a DCP folder, read with DCP's own reader."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import FileSystemReader

    md = FileSystemReader(folder).read_metadata()
    out = {
        k: torch.empty(v.size, dtype=v.properties.dtype) for k, v in md.state_dict_metadata.items()
    }
    dcp.load(out, storage_reader=FileSystemReader(folder), no_dist=True)
    return out


def one_line_error(capsys, *argv) -> str:
    """Run the CLI: it must exit 2 with one `qwentitan-ckpt: error:` line, returned."""
    from qwentitan.checkpoint.cli import main

    code = main([str(a) for a in argv])
    err = capsys.readouterr().err
    assert code == 2, err
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("qwentitan-ckpt: error: "), err
    return lines[0]


@pytest.fixture
def helpers():
    """The module's plain helpers, for tests (conftest is not importable under importlib mode)."""
    import types

    return types.SimpleNamespace(
        load_hf=load_hf,
        one_line_error=one_line_error,
        load_dcp=load_dcp,
        bitwise_equal=bitwise_equal,
        hf_tensors=hf_tensors,
        hf_config=hf_config,
        write_hf=write_hf,
        EXPERTS=EXPERTS,
        MOE_FFN=MOE_FFN,
        HIDDEN=HIDDEN,
    )
