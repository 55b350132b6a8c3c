"""Qwen3 parameter names and shapes on both sides: the Hugging Face folder and torchtitan's DCP.

The name table is the one torchtitan 0.3.0's `Qwen3StateDictAdapter.from_hf_map` uses
(torchtitan/models/qwen3/state_dict_adapter.py); `tests/integration/test_checkpoint_mapping.py`
proves the two agree. It lives here as a small table so this package needs neither
torchtitan nor transformers. What torchtitan does beyond renaming:

- q/k/v stay three tensors (`attention.qkv_linear.wq/wk/wv`): torchtitan's fused-QKV module
  splits its `wqkv` on `state_dict()` and merges it back on `load_state_dict()`.
- Routed experts are stacked per layer along a leading expert dim:
  `moe.routed_experts.inner_experts.w1_EFD` = stack of `experts.{e}.gate_proj.weight` (E, F, D),
  `w3_EFD` = stack of `up_proj`, `w2_EDF` = stack of `down_proj` (E, D, F).
- The MoE load-balancing buffer `moe.expert_bias_E` (float32 zeros, E) is part of torchtitan's
  state dict but has no HF counterpart: it is written as zeros and dropped on export. A DCP
  without it (a model trained with load balancing off, as qwentitan's MoE models are) is
  exported and verified all the same; torchtitan ignores it when its model has none.
- `lm_head.weight` is always in torchtitan's state dict; when the config ties embeddings it is
  the embedding matrix.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from qwentitan.checkpoint.errors import CheckpointError

# HF name -> torchtitan name, with `{layer}` / `{expert}` holes: torchtitan's from_hf_map.
HF_TO_TITAN: dict[str, str] = {
    "model.embed_tokens.weight": "tok_embeddings.weight",
    "model.norm.weight": "norm.weight",
    "lm_head.weight": "lm_head.weight",
    "model.layers.{layer}.self_attn.q_proj.weight": "layers.{layer}.attention.qkv_linear.wq.weight",
    "model.layers.{layer}.self_attn.k_proj.weight": "layers.{layer}.attention.qkv_linear.wk.weight",
    "model.layers.{layer}.self_attn.v_proj.weight": "layers.{layer}.attention.qkv_linear.wv.weight",
    "model.layers.{layer}.self_attn.o_proj.weight": "layers.{layer}.attention.wo.weight",
    "model.layers.{layer}.self_attn.q_norm.weight": "layers.{layer}.attention.q_norm.weight",
    "model.layers.{layer}.self_attn.k_norm.weight": "layers.{layer}.attention.k_norm.weight",
    "model.layers.{layer}.input_layernorm.weight": "layers.{layer}.attention_norm.weight",
    "model.layers.{layer}.post_attention_layernorm.weight": "layers.{layer}.ffn_norm.weight",
    "model.layers.{layer}.mlp.gate_proj.weight": "layers.{layer}.feed_forward.w1.weight",
    "model.layers.{layer}.mlp.up_proj.weight": "layers.{layer}.feed_forward.w3.weight",
    "model.layers.{layer}.mlp.down_proj.weight": "layers.{layer}.feed_forward.w2.weight",
    "model.layers.{layer}.mlp.gate.weight": "layers.{layer}.moe.router.gate.weight",
    # Stacked over experts: one torchtitan tensor from num_experts HF tensors.
    "model.layers.{layer}.mlp.experts.{expert}.gate_proj.weight": "layers.{layer}.moe.routed_experts.inner_experts.w1_EFD",
    "model.layers.{layer}.mlp.experts.{expert}.up_proj.weight": "layers.{layer}.moe.routed_experts.inner_experts.w3_EFD",
    "model.layers.{layer}.mlp.experts.{expert}.down_proj.weight": "layers.{layer}.moe.routed_experts.inner_experts.w2_EDF",
}
EXPERT_BIAS = "layers.{layer}.moe.expert_bias_E"

# Keys of a full torchtitan training checkpoint that are not model weights.
NON_MODEL_PREFIXES = ("optimizer.", "lr_scheduler.", "dataloader.", "train_state")

SUPPORTED_MODEL_TYPES = ("qwen3", "qwen3_moe")


@dataclass(frozen=True, slots=True)
class TitanTensor:
    """One tensor of torchtitan's state dict and the HF tensors it is made of.

    `hf_names` holds one name, or one per expert in expert order when `stacked`; it is empty
    for a tensor HF has no counterpart of (created as zeros). `exported` is False for the
    tied lm_head, which HF does not store.
    """

    name: str
    shape: tuple[int, ...]
    hf_names: tuple[str, ...]
    stacked: bool = False
    exported: bool = True

    @property
    def numel(self) -> int:
        n = 1
        for s in self.shape:
            n *= s
        return n


@dataclass(frozen=True, slots=True)
class Qwen3Layout:
    """Every parameter's name and shape, from a Qwen3 / Qwen3-MoE config.json."""

    model_type: str
    vocab_size: int
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    tie_word_embeddings: bool
    num_experts: int = 0
    moe_intermediate_size: int = 0
    moe_layers: frozenset[int] = frozenset()

    @classmethod
    def from_config(cls, config: dict[str, Any], where: Path | str) -> Qwen3Layout:
        model_type = config.get("model_type")
        if model_type not in SUPPORTED_MODEL_TYPES:
            raise CheckpointError(
                f"{where} describes model_type {model_type!r}, not Qwen3 or Qwen3-MoE; "
                "pass the config.json of a Qwen3 or Qwen3-MoE model."
            )
        if config.get("attention_bias"):
            raise CheckpointError(
                f"{where} sets attention_bias=true, which torchtitan's Qwen3 has no parameter "
                "for; only bias-free Qwen3 checkpoints can be converted."
            )

        def need(key: str, *alternatives: str) -> int:
            for k in (key, *alternatives):
                if isinstance(config.get(k), int):
                    return config[k]
            raise CheckpointError(
                f"{where} lacks the integer field {key!r}; pass the complete config.json "
                "that came with the weights."
            )

        hidden = need("hidden_size")
        heads = need("num_attention_heads")
        layers = need("num_hidden_layers")
        common = dict(
            model_type=model_type,
            vocab_size=need("vocab_size"),
            hidden_size=hidden,
            num_layers=layers,
            num_heads=heads,
            num_kv_heads=config.get("num_key_value_heads") or heads,
            head_dim=config.get("head_dim") or hidden // heads,
            intermediate_size=need("intermediate_size"),
            tie_word_embeddings=bool(config.get("tie_word_embeddings", False)),
        )
        if model_type == "qwen3":
            return cls(**common)
        # transformers 5 writes num_local_experts; Hub configs say num_experts.
        experts = need("num_experts", "num_local_experts")
        step = config.get("decoder_sparse_step", 1) or 1
        dense_only = set(config.get("mlp_only_layers") or [])
        moe_layers = frozenset(
            i for i in range(layers) if i not in dense_only and experts > 0 and (i + 1) % step == 0
        )
        return cls(
            **common,
            num_experts=experts,
            moe_intermediate_size=need("moe_intermediate_size"),
            moe_layers=moe_layers,
        )

    def titan_tensors(self) -> list[TitanTensor]:
        """torchtitan's state dict, in model order (embeddings first, lm_head last)."""
        h, hd, v = self.hidden_size, self.head_dim, self.vocab_size
        out = [TitanTensor("tok_embeddings.weight", (v, h), ("model.embed_tokens.weight",))]
        shapes = {
            "q_proj": (self.num_heads * hd, h),
            "k_proj": (self.num_kv_heads * hd, h),
            "v_proj": (self.num_kv_heads * hd, h),
            "o_proj": (h, self.num_heads * hd),
            "q_norm": (hd,),
            "k_norm": (hd,),
            "input_layernorm": (h,),
            "post_attention_layernorm": (h,),
        }
        for i in range(self.num_layers):
            for hf, titan in HF_TO_TITAN.items():
                if not hf.startswith("model.layers.") or ".mlp." in hf:
                    continue
                part = hf.split(".")[-2]
                out.append(_plain(hf, titan, i, shapes[part]))
            if i in self.moe_layers:
                out.extend(self._moe_tensors(i))
            else:
                f = self.intermediate_size
                mlp = {"gate_proj": (f, h), "up_proj": (f, h), "down_proj": (h, f)}
                for part, shape in mlp.items():
                    hf = f"model.layers.{{layer}}.mlp.{part}.weight"
                    out.append(_plain(hf, HF_TO_TITAN[hf], i, shape))
        out.append(TitanTensor("norm.weight", (h,), ("model.norm.weight",)))
        if self.tie_word_embeddings:
            out.append(
                TitanTensor(
                    "lm_head.weight", (v, h), ("model.embed_tokens.weight",), exported=False
                )
            )
        else:
            out.append(TitanTensor("lm_head.weight", (v, h), ("lm_head.weight",)))
        return out

    def _moe_tensors(self, i: int) -> list[TitanTensor]:
        h, f, e = self.hidden_size, self.moe_intermediate_size, self.num_experts
        gate = "model.layers.{layer}.mlp.gate.weight"
        out = [_plain(gate, HF_TO_TITAN[gate], i, (e, h))]
        for part, shape in (
            ("gate_proj", (e, f, h)),
            ("up_proj", (e, f, h)),
            ("down_proj", (e, h, f)),
        ):
            hf = f"model.layers.{{layer}}.mlp.experts.{{expert}}.{part}.weight"
            names = tuple(hf.format(layer=i, expert=x) for x in range(e))
            out.append(TitanTensor(HF_TO_TITAN[hf].format(layer=i), shape, names, stacked=True))
        out.append(TitanTensor(EXPERT_BIAS.format(layer=i), (e,), ()))
        return out

    def hf_shapes(self) -> dict[str, tuple[int, ...]]:
        """Every tensor a Hugging Face folder of this model holds, with its shape."""
        shapes: dict[str, tuple[int, ...]] = {}
        for t in self.titan_tensors():
            if not t.exported:
                continue
            per_source = t.shape[1:] if t.stacked else t.shape
            for name in t.hf_names:
                shapes[name] = per_source
        return shapes


def _plain(hf: str, titan: str, layer: int, shape: tuple[int, ...]) -> TitanTensor:
    return TitanTensor(titan.format(layer=layer), shape, (hf.format(layer=layer),))


def read_config(path: Path | str) -> tuple[dict[str, Any], Path]:
    """config.json as a dict, from the file itself or the folder that holds it."""
    path = Path(path)
    file = path / "config.json" if path.is_dir() else path
    if not file.is_file():
        raise CheckpointError(
            f"{file} does not exist; pass the model's config.json (or the folder holding it)."
        )
    try:
        config = json.loads(file.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise CheckpointError(
            f"{file} is not valid JSON ({e}); restore the config.json that came with the model."
        ) from None
    if not isinstance(config, dict):
        raise CheckpointError(f"{file} is not a JSON object; restore the model's config.json.")
    return config, file


DTYPES: dict[str, torch.dtype] = {
    "bfloat16": torch.bfloat16,
    "float32": torch.float32,
    "float16": torch.float16,
}
