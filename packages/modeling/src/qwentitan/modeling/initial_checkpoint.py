"""`write_initial_checkpoint`: one seeded Hugging Face checkpoint every path can start from."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import torch

from qwentitan.modeling.errors import ModelingError
from qwentitan.modeling.flavors import Flavor, get_flavor
from qwentitan.modeling.hf_config import flavor_to_hf_config


def write_initial_checkpoint(flavor: str | Flavor, folder: str | Path, *, seed: int = 0) -> Path:
    """Write a freshly initialised ``flavor`` (transformers' init, seeded) to ``folder`` as a
    Hugging Face model folder (config.json, model.safetensors) and return it.

    The norms and the MoE router are drawn at random too (transformers starts them at one and
    at a small normal), so a tensor a path drops or swaps on loading changes the first loss.
    The folder is written beside its final name and renamed at the end; an existing folder is
    refused, never overwritten.
    """
    from transformers import AutoModelForCausalLM

    folder = Path(folder)
    if folder.exists():
        raise ModelingError(f"{folder} already exists; pass a new folder for the checkpoint.")
    generator = torch.Generator().manual_seed(seed)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = AutoModelForCausalLM.from_config(
            flavor_to_hf_config(get_flavor(flavor)), dtype=torch.float32
        )
    with torch.no_grad():
        for name, param in model.named_parameters():
            noise = torch.randn(param.shape, generator=generator)
            if "norm" in name:
                param.copy_(1.0 + 0.1 * noise)
            elif name.endswith("mlp.gate.weight"):  # the MoE router
                param.copy_(0.2 * noise)
    partial = folder.with_name(f".{folder.name}.partial-{os.getpid()}")
    shutil.rmtree(partial, ignore_errors=True)
    try:
        model.save_pretrained(partial)
        partial.rename(folder)
    finally:
        shutil.rmtree(partial, ignore_errors=True)
    return folder
