"""Hub (safetensors) layout <-> transformers v5 in-memory layout of Qwen3 weights.

The Hub files, and what ``save_pretrained`` writes, hold one tensor per expert
(``mlp.experts.{e}.gate_proj.weight``, ``up_proj``, ``down_proj``); transformers v5 keeps them
fused in memory (``mlp.experts.gate_up_proj`` [E, 2I, D] with gate rows first, and
``mlp.experts.down_proj`` [E, D, I]). Everything entering or leaving the ``hf`` path goes
through these two functions, so only the Hub layout is ever seen outside it.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping
from pathlib import Path

import torch

from qwentitan.checkpoint import CheckpointError, HFFolder
from qwentitan.modeling.errors import ModelingError
from qwentitan.modeling.flavors import Flavor

_HUB_EXPERT = re.compile(r"^(.*\.mlp\.experts)\.(\d+)\.(gate_proj|up_proj|down_proj)\.weight$")
_FUSED_EXPERT = re.compile(r"^(.*\.mlp\.experts)\.(gate_up_proj|down_proj)$")


Region = tuple[slice, ...]


def open_hub_folder(folder: str | Path) -> HFFolder:
    """A model folder's safetensors, through qwentitan.checkpoint's one reader (headers and
    index checked, nothing read until asked; under FSDP each rank reads only its own rows, so
    a 30B model on 64 ranks is read once in total, not 64 times)."""
    try:
        return HFFolder(folder)
    except CheckpointError as error:
        raise ModelingError(str(error)) from None


def read_hub_state_dict(folder: str | Path) -> dict[str, torch.Tensor]:
    """Every tensor of a model folder's safetensors, keyed as on the Hub."""
    hub = open_hub_folder(folder)
    return {key: hub.read(key) for key in hub.tensors}


def memory_keys(hub_keys: Iterable[str], flavor: Flavor) -> set[str]:
    """The in-memory keys a set of Hub keys converts to; incomplete experts are an error."""
    out: set[str] = set()
    experts: dict[str, dict[str, set[int]]] = {}
    for key in hub_keys:
        if m := _HUB_EXPERT.match(key):
            experts.setdefault(m.group(1), {}).setdefault(m.group(3), set()).add(int(m.group(2)))
        elif not (flavor.tie_word_embeddings and key == "lm_head.weight"):
            out.add(key)
    if experts and not flavor.is_moe:
        raise ModelingError(
            f"The checkpoint holds MoE experts but flavor {flavor.name!r} is dense; pass the "
            "MoE flavor it was saved from."
        )
    for prefix, projs in experts.items():
        for proj in ("gate_proj", "up_proj", "down_proj"):
            missing = sorted(set(range(flavor.num_experts)) - projs.get(proj, set()))
            if missing or len(projs.get(proj, ())) != flavor.num_experts:
                raise ModelingError(
                    f"{prefix}.*.{proj}.weight has {len(projs.get(proj, ()))} of "
                    f"{flavor.num_experts} experts (missing {missing[:8]}); the checkpoint does "
                    f"not match flavor {flavor.name!r}."
                )
        out |= {f"{prefix}.gate_up_proj", f"{prefix}.down_proj"}
    return out


def read_memory_tensor(
    hub: HFFolder, key: str, flavor: Flavor, region: Region, shape: tuple[int, ...]
) -> torch.Tensor:
    """The ``region`` (one slice per dim) of in-memory tensor ``key``, read from the Hub files;
    for fused experts only the experts inside the region are read."""
    m = _FUSED_EXPERT.match(key)
    if m is None:
        return hub.read_region(key, region)
    prefix, kind = m.group(1), m.group(2)
    rows, rest = region[0], region[1:]
    parts = []
    for e in range(flavor.num_experts)[rows]:
        if kind == "gate_up_proj":
            gate, up = (hub.read(f"{prefix}.{e}.{p}.weight") for p in ("gate_proj", "up_proj"))
            parts.append(torch.cat([gate, up])[rest])
        else:
            parts.append(hub.read(f"{prefix}.{e}.down_proj.weight")[rest])
    if not parts:  # an FSDP rank that holds no expert of this layer
        return torch.empty(shape)
    return torch.stack(parts)


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
    memory_keys(list(hub), flavor)  # validates: experts complete, MoE only for MoE flavors
    for prefix, projs in experts.items():
        stacked = {}
        for proj in ("gate_proj", "up_proj", "down_proj"):
            found = projs[proj]
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
