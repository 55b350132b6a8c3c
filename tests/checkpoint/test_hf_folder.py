"""HFFolder, the workspace's one reader of Hugging Face model folders: shapes, files, regions."""

import os

import pytest
import torch

from qwentitan.checkpoint import CheckpointError, HFFolder, read_config

from .conftest import write_hf


def test_shapes_files_and_whole_reads_over_shards(tmp_path):
    tensors = {
        f"t{i}": torch.arange(12 * (i + 1), dtype=torch.float32).view(-1, 4) for i in range(3)
    }
    folder = write_hf(tmp_path / "hf", tensors, {"model_type": "qwen3"}, shards=2)
    hub = HFFolder(folder)
    assert [f.name for f in hub.files] == [
        "model-00001-of-00002.safetensors",
        "model-00002-of-00002.safetensors",
    ]
    assert {name: hub.shape(name) for name in hub.tensors} == {
        name: tuple(t.shape) for name, t in tensors.items()
    }
    for name, t in tensors.items():
        assert torch.equal(hub.read(name), t)
    assert read_config(folder) == ({"model_type": "qwen3"}, folder / "config.json")


def test_a_region_reads_only_its_rows_from_disk(tmp_path):
    weight = torch.randn(64, 32)
    folder = write_hf(tmp_path / "hf", {"w": weight}, {"model_type": "qwen3"})
    hub = HFFolder(folder)
    region = (slice(8, 24), slice(5, 30))
    assert torch.equal(hub.read_region("w", region), weight[region])
    assert hub.read_region("w", (slice(40, 40), slice(0, 32))).shape == (0, 32)
    # Cut the file right after row 24: the region still reads (its rows are all there) while a
    # whole read runs into the end of the file, so the region never touched later rows.
    stored = hub.tensors["w"]
    os.truncate(stored.file, stored.start + 24 * 32 * weight.itemsize)
    assert torch.equal(hub.read_region("w", region), weight[region])
    with pytest.raises(CheckpointError, match="ended while reading 'w'"):
        hub.read("w")
