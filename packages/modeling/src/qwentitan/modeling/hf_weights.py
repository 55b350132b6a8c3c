"""Hub (safetensors) layout <-> transformers v5 in-memory layout of Qwen3 weights.

The Hub files, and what ``save_pretrained`` writes, hold one tensor per expert
(``mlp.experts.{e}.gate_proj.weight``, ``up_proj``, ``down_proj``); transformers v5 keeps them
fused in memory (``mlp.experts.gate_up_proj`` [E, 2I, D] with gate rows first, and
``mlp.experts.down_proj`` [E, D, I]). Everything entering or leaving the ``hf`` path goes
through these two functions, so only the Hub layout is ever seen outside it.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from pathlib import Path

import torch
from safetensors import safe_open

from qwentitan.modeling.errors import ModelingError
from qwentitan.modeling.flavors import Flavor

_HUB_EXPERT = re.compile(r"^(.*\.mlp\.experts)\.(\d+)\.(gate_proj|up_proj|down_proj)\.weight$")
_FUSED_EXPERT = re.compile(r"^(.*\.mlp\.experts)\.(gate_up_proj|down_proj)$")


def read_hub_state_dict(folder: str | Path) -> dict[str, torch.Tensor]:
    """Every tensor of the ``*.safetensors`` files in a model folder, keyed as on the Hub."""
    files = sorted(Path(folder).glob("*.safetensors"))
    if not files:
        raise ModelingError(
            f"No *.safetensors file in {folder}; pass a folder written by save_pretrained "
            "or downloaded from the Hub."
        )
    state: dict[str, torch.Tensor] = {}
    for file in files:
        with safe_open(file, framework="pt") as f:
            for key in f.keys():  # noqa: SIM118 (safe_open is not a mapping)
                state[key] = f.get_tensor(key)
    return state


def hub_to_memory(hub: Mapping[str, torch.Tensor], flavor: Flavor) -> dict[str, torch.Tensor]:
    """Hub-layout tensors -> transformers v5 in-memory keys (experts fused). Input untouched."""
    out: dict[str, torch.Tensor] = {}
    experts: dict[str, dict[str, dict[int, torch.Tensor]]] = {}
    for key, value in hub.items():
        if m := _HUB_EXPERT.match(key):
            prefix, expert, proj = m.group(1), int(m.group(2)), m.group(3)
            experts.setdefault(prefix, {}).setdefault(proj, {})[expert] = value
        else:
            out[key] = value
    if experts and not flavor.is_moe:
        raise ModelingError(
            f"The checkpoint holds MoE experts but flavor {flavor.name!r} is dense; pass the "
            "MoE flavor it was saved from."
        )
    for prefix, projs in experts.items():
        stacked = {}
        for proj in ("gate_proj", "up_proj", "down_proj"):
            found = projs.get(proj, {})
            if sorted(found) != list(range(flavor.num_experts)):
                missing = sorted(set(range(flavor.num_experts)) - set(found))
                raise ModelingError(
                    f"{prefix}.*.{proj}.weight has {len(found)} of {flavor.num_experts} experts "
                    f"(missing {missing[:8]}); the checkpoint does not match flavor {flavor.name!r}."
                )
            stacked[proj] = torch.stack([found[e] for e in range(flavor.num_experts)])
        out[f"{prefix}.gate_up_proj"] = torch.cat([stacked["gate_proj"], stacked["up_proj"]], dim=1)
        out[f"{prefix}.down_proj"] = stacked["down_proj"]
    if flavor.tie_word_embeddings:
        out.pop("lm_head.weight", None)  # the embedding is the head; save_pretrained omits it too
    return out


def memory_to_hub(state: Mapping[str, torch.Tensor], flavor: Flavor) -> dict[str, torch.Tensor]:
    """transformers v5 in-memory keys -> Hub layout (one tensor per expert). Input untouched."""
    out: dict[str, torch.Tensor] = {}
    for key, value in state.items():
        if m := _FUSED_EXPERT.match(key):
            prefix, kind = m.group(1), m.group(2)
            if kind == "gate_up_proj":
                gate, up = value.chunk(2, dim=1)
                for e in range(value.shape[0]):
                    out[f"{prefix}.{e}.gate_proj.weight"] = gate[e]
                    out[f"{prefix}.{e}.up_proj.weight"] = up[e]
            else:
                for e in range(value.shape[0]):
                    out[f"{prefix}.{e}.down_proj.weight"] = value[e]
        elif not (flavor.tie_word_embeddings and key == "lm_head.weight"):
            out[key] = value
    return out
