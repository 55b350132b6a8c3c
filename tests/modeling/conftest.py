"""Tiny Qwen3 checkpoints written by transformers itself (save_pretrained, through
`write_initial_checkpoint`), shared by the tests."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM

from qwentitan.modeling import write_initial_checkpoint

VOCAB = 151936


def _write_checkpoint(flavor: str, folder: Path, seed: int) -> Path:
    return write_initial_checkpoint(flavor, folder / "hf", seed=seed)


@pytest.fixture(scope="session")
def tiny_dense_folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return _write_checkpoint("tiny-dense", tmp_path_factory.mktemp("tiny-dense"), seed=0)


@pytest.fixture(scope="session")
def tiny_moe_folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return _write_checkpoint("tiny-moe", tmp_path_factory.mktemp("tiny-moe"), seed=1)


@pytest.fixture(scope="session")
def tokens() -> torch.Tensor:
    return torch.randint(0, VOCAB, (2, 48), generator=torch.Generator().manual_seed(7))


def hf_logits(folder: Path, tokens: torch.Tensor) -> torch.Tensor:
    """Logits of transformers' own Qwen3ForCausalLM / Qwen3MoeForCausalLM reading ``folder``."""
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    with torch.no_grad():
        return model(tokens).logits
