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
import re
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from qwentitan.checkpoint.disk import Shape
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
    decoder_sparse_step: int = 1
    mlp_only_layers: frozenset[int] = frozenset()

    @classmethod
    def from_config(cls, config: dict[str, Any], where: Path | str) -> Qwen3Layout:
        """The layout config.json describes, every size checked to be a positive integer.

        Nothing here loops over a size: a folder's config is bounded by what the folder holds
        (`check_held`) before anything iterates over its layers or experts.
        """
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
        hidden = _size(config, where, "hidden_size")
        heads = _size(config, where, "num_attention_heads")
        common = dict(
            model_type=model_type,
            vocab_size=_size(config, where, "vocab_size"),
            hidden_size=hidden,
            num_layers=_size(config, where, "num_hidden_layers"),
            num_heads=heads,
            num_kv_heads=_size(config, where, "num_key_value_heads", default=heads),
            head_dim=_size(config, where, "head_dim", default=max(hidden // heads, 1)),
            intermediate_size=_size(config, where, "intermediate_size"),
            tie_word_embeddings=bool(config.get("tie_word_embeddings", False)),
        )
        if model_type == "qwen3":
            return cls(**common)
        dense_only = config.get("mlp_only_layers") or []
        if not isinstance(dense_only, list) or not all(
            _is_int(i) and 0 <= i < common["num_layers"] for i in dense_only
        ):
            raise CheckpointError(
                f"{where} sets mlp_only_layers to {_shown(dense_only)}; it must be a list of "
                "layer numbers below num_hidden_layers, pass the config.json that came with "
                "the weights."
            )
        return cls(
            **common,
            # transformers 5 writes num_local_experts; Hub configs say num_experts.
            num_experts=_size(config, where, "num_experts", "num_local_experts"),
            moe_intermediate_size=_size(config, where, "moe_intermediate_size"),
            decoder_sparse_step=_size(config, where, "decoder_sparse_step", default=1),
            mlp_only_layers=frozenset(dense_only),
        )

    def is_moe(self, layer: int) -> bool:
        """Whether `layer` holds routed experts (else a dense MLP)."""
        return (
            self.num_experts > 0
            and layer not in self.mlp_only_layers
            and (layer + 1) % self.decoder_sparse_step == 0
        )

    @property
    def moe_layers(self) -> frozenset[int]:
        return frozenset(i for i in range(self.num_layers) if self.is_moe(i))

    def check_held(
        self, tensors: Mapping[str, Shape], config_file: Path | str, folder: Path
    ) -> None:
        """Refuse a config.json whose layer or expert count exceeds what `folder` holds.

        `tensors` are the folder's tensor names and shapes (Hugging Face or torchtitan names):
        the layers are the distinct `layers.N` among them and the experts the distinct
        `experts.E`, or the leading dim of a stacked expert tensor, so every loop over a
        count from the config is bounded by the folder's own headers or metadata.
        """
        layers = {int(m.group(1)) for name in tensors if (m := _LAYER.match(name))}
        if self.num_layers > len(layers):
            raise CheckpointError(
                f"{config_file} sets num_hidden_layers={self.num_layers} but {folder} holds "
                f"the tensors of {len(layers)} layer(s); pass the config.json that belongs to "
                "these weights."
            )
        if not any(self.is_moe(i) for i in range(self.num_layers)):
            return
        experts = {int(m.group(1)) for name in tensors if (m := _EXPERT.search(name))}
        stacked = [s[0] for n, s in tensors.items() if n.endswith(_STACKED) and s]
        held = max(len(experts), min(stacked, default=0))
        if self.num_experts > held:
            raise CheckpointError(
                f"{config_file} sets num_experts={self.num_experts} but {folder} holds "
                f"{held} expert(s) per layer; pass the config.json that belongs to these "
                "weights."
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
            if self.is_moe(i):
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


_LAYER = re.compile(r"(?:model\.)?layers\.(\d+)\.")
_EXPERT = re.compile(r"\.experts\.(\d+)\.")
_STACKED = ("_EFD", "_EDF")


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _shown(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 40 else text[:37] + "..."


def _size(config: dict[str, Any], where: Path | str, key: str, *alternatives: str, **kw) -> int:
    """config[key] (or the first alternative present, else `default` when given): a positive
    integer, or one sentence naming the field."""
    for k in (key, *alternatives):
        if config.get(k) is not None:
            key, value = k, config[k]
            break
    else:
        if "default" in kw:
            return kw["default"]
        raise CheckpointError(
            f"{where} lacks the integer field {key!r}; pass the complete config.json "
            "that came with the weights."
        )
    if not _is_int(value) or value < 1:
        raise CheckpointError(
            f"{where} sets {key} to {_shown(value)}, not a positive integer; pass the "
            "config.json that came with the weights."
        )
    return value


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
