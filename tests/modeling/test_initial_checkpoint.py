"""write_initial_checkpoint: seeded, whole or absent, never over an existing folder."""

import pytest
import torch
from safetensors.torch import load_file
from transformers import PreTrainedModel

from qwentitan.modeling import ModelingError, write_initial_checkpoint


def _tensors(folder):
    return load_file(folder / "model.safetensors")


def test_the_seed_decides_every_weight(tmp_path):
    a = _tensors(write_initial_checkpoint("tiny-moe", tmp_path / "a", seed=3))
    b = _tensors(write_initial_checkpoint("tiny-moe", tmp_path / "b", seed=3))
    c = _tensors(write_initial_checkpoint("tiny-moe", tmp_path / "c", seed=4))
    assert a.keys() == b.keys() == c.keys()
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert not any(torch.equal(a[k], c[k]) for k in a)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a", "b", "c"]  # no partial folder
    norm = a["model.norm.weight"]
    assert not torch.equal(norm, torch.ones_like(norm))  # drawn, so a dropped norm shows


def test_an_existing_folder_is_refused_and_a_failed_write_leaves_nothing(tmp_path, monkeypatch):
    (tmp_path / "taken").mkdir()
    (tmp_path / "taken" / "mine.txt").write_text("keep")
    with pytest.raises(ModelingError, match="already exists; pass a new folder"):
        write_initial_checkpoint("tiny-dense", tmp_path / "taken")
    assert (tmp_path / "taken" / "mine.txt").read_text() == "keep"

    def disk_full(self, folder, **kwargs):
        (folder / "model.safetensors").parent.mkdir(parents=True, exist_ok=True)
        (folder / "model.safetensors").write_bytes(b"half")
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(PreTrainedModel, "save_pretrained", disk_full)
    with pytest.raises(OSError):
        write_initial_checkpoint("tiny-dense", tmp_path / "new")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["taken"]
