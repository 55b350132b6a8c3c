"""A model folder is a boundary: the files its index names lie in it, and the sizes its
config.json gives are bounded by the tensors it holds before any loop depends on them."""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import json
import os
import pickle
import signal
from pathlib import Path

import pytest

from qwentitan.checkpoint import read_dcp_metadata, to_dcp
from qwentitan.checkpoint.cli import main

INDEX = "model.safetensors.index.json"


def snapshot(folder: Path) -> dict[str, str]:
    """Every file under `folder` (links not followed) and a digest of its bytes."""
    out = {}
    for path in sorted(folder.rglob("*")):
        if path.is_symlink():
            out[str(path)] = "link:" + os.readlink(path)
        elif path.is_file():
            out[str(path)] = hashlib.sha256(path.read_bytes()).hexdigest()
    return out


@contextlib.contextmanager
def no_hang(seconds: int = 60):
    """A hang (the fault this file guards against) fails the test instead of stalling CI."""

    def stop(signum, frame):
        raise TimeoutError(f"still running after {seconds} s")

    previous = signal.signal(signal.SIGALRM, stop)
    signal.alarm(seconds)
    try:
        yield
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, previous)


@pytest.fixture
def refused(helpers):
    """The CLI's answer, exit 2 and one line, within a minute."""

    def run(capsys, *argv) -> str:
        with no_hang():
            return helpers.one_line_error(capsys, *argv)

    return run


# Names an index may not give a shard: `{out}` is a folder outside the model folder.
OUTSIDE_NAMES = [
    "../x.safetensors",
    "{out}/x.safetensors",  # absolute
    "sub/../../x.safetensors",
    "sub/x.safetensors",  # inside, but in a subfolder: Hub indexes name plain files
    "./../x.safetensors",
    "..",
    "",
]


def _point_index_outside(src: Path, tmp_path: Path, name: str) -> None:
    """Move one shard out of the folder and make the index name it there."""
    (tmp_path / "sub").mkdir(exist_ok=True)
    index = json.loads((src / INDEX).read_text())
    shard = sorted(set(index["weight_map"].values()))[0]
    os.replace(src / shard, tmp_path / "x.safetensors")
    (src / "sub").mkdir()
    os.symlink(tmp_path / "x.safetensors", src / "sub" / "x.safetensors")
    name = name.format(out=tmp_path)
    index["weight_map"] = {k: name if v == shard else v for k, v in index["weight_map"].items()}
    (src / INDEX).write_text(json.dumps(index))


@pytest.mark.parametrize("name", OUTSIDE_NAMES)
@pytest.mark.parametrize("verb", ["to-dcp", "verify"])
def test_an_index_naming_a_file_outside_the_folder_is_refused(
    refused, make_hf, capsys, tmp_path, name, verb
):
    src = make_hf()
    if verb == "verify":
        to_dcp(make_hf("twin"), tmp_path / "dcp")
    _point_index_outside(src, tmp_path, name)
    before = snapshot(tmp_path)
    argv = [src, tmp_path / "out"] if verb == "to-dcp" else [src, tmp_path / "dcp"]
    line = refused(capsys, verb, *argv)
    assert INDEX in line and "plain file name" in line, line
    assert snapshot(tmp_path) == before


@pytest.mark.parametrize("value", [7, None, ["a.safetensors"], {"f": 1}])
def test_an_index_naming_a_shard_by_a_non_string_is_refused(
    refused, make_hf, capsys, tmp_path, value
):
    src = make_hf()
    index = json.loads((src / INDEX).read_text())
    first = sorted(index["weight_map"])[0]
    index["weight_map"][first] = value
    (src / INDEX).write_text(json.dumps(index))
    before = snapshot(tmp_path)
    line = refused(capsys, "to-dcp", src, tmp_path / "out")
    assert INDEX in line and "plain file name" in line, line
    assert snapshot(tmp_path) == before


def test_a_symlinked_shard_as_the_hub_cache_makes_is_read(make_hf, helpers, tmp_path):
    src = make_hf()
    blobs = tmp_path / "blobs"
    blobs.mkdir()
    for shard in src.glob("*.safetensors"):
        os.replace(shard, blobs / shard.name)
        os.symlink(Path("..") / "blobs" / shard.name, shard)  # relative, as the Hub cache
    to_dcp(src, tmp_path / "dcp")
    assert main(["verify", str(src), str(tmp_path / "dcp")]) == 0


# DCP's `.metadata` is the DCP folder's index: the data files it names lie in the folder too.
@pytest.mark.parametrize("name", ["../{file}", "{out}/{file}", "sub/../../{file}"])
@pytest.mark.parametrize("verb", ["to-hf", "verify"])
def test_dcp_metadata_naming_a_file_outside_the_folder_is_refused(
    refused, make_hf, capsys, tmp_path, name, verb
):
    src = make_hf()
    dcp = to_dcp(src, tmp_path / "dcp")
    metadata = read_dcp_metadata(dcp)
    first = sorted({info.relative_path for info in metadata.storage_data.values()})[0]
    os.replace(dcp / first, tmp_path / first)
    moved = name.format(file=first, out=tmp_path)
    for key, info in metadata.storage_data.items():
        if info.relative_path == first:
            metadata.storage_data[key] = dataclasses.replace(info, relative_path=moved)
    (dcp / ".metadata").write_bytes(pickle.dumps(metadata))
    before = snapshot(tmp_path)
    argv = [dcp, tmp_path / "out"] if verb == "to-hf" else [src, dcp]
    line = refused(capsys, verb, *argv)
    assert ".metadata" in line and "plain file name" in line, line
    assert snapshot(tmp_path) == before


# Config sizes no folder of this test's 2 layers / 4 experts holds, and values of no size.
HUGE = 10**15
BAD_SIZES = [
    ("num_hidden_layers", HUGE, "num_hidden_layers"),
    ("num_hidden_layers", 2**63, "num_hidden_layers"),
    ("num_hidden_layers", 3, "num_hidden_layers"),
    ("num_hidden_layers", -1, "num_hidden_layers"),
    ("num_hidden_layers", 0, "num_hidden_layers"),
    ("num_hidden_layers", "2", "num_hidden_layers"),
    ("num_hidden_layers", 2.0, "num_hidden_layers"),
    ("num_hidden_layers", True, "num_hidden_layers"),
    ("hidden_size", -16, "hidden_size"),
    ("vocab_size", 0, "vocab_size"),
    ("num_attention_heads", [4], "num_attention_heads"),
    ("head_dim", -8, "head_dim"),
    ("num_key_value_heads", "2", "num_key_value_heads"),
]
MOE_BAD_SIZES = [
    ("num_experts", HUGE, "num_experts"),
    ("num_experts", 5, "num_experts"),
    ("num_experts", -4, "num_experts"),
    ("num_hidden_layers", HUGE, "num_hidden_layers"),
    ("moe_intermediate_size", "8", "moe_intermediate_size"),
    ("decoder_sparse_step", "x", "decoder_sparse_step"),
    ("decoder_sparse_step", -1, "decoder_sparse_step"),
    ("mlp_only_layers", "0,1", "mlp_only_layers"),
    ("mlp_only_layers", [HUGE, -1], "mlp_only_layers"),
]


def _set(folder: Path, key: str, value) -> None:
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps(config | {key: value}))


@pytest.mark.parametrize(
    ("moe", "key", "value", "named"),
    [(False, *case) for case in BAD_SIZES] + [(True, *case) for case in MOE_BAD_SIZES],
    ids=lambda v: str(v)[:20],
)
def test_config_sizes_beyond_the_folder_are_refused_at_once(
    refused, make_hf, capsys, tmp_path, moe, key, value, named
):
    src = make_hf(moe=moe)
    good = to_dcp(src, tmp_path / "dcp")
    _set(src, key, value)
    _set(good, key, value)  # to-hf reads the config to_dcp left beside the DCP
    before = snapshot(tmp_path)
    for argv in (
        ["to-dcp", src, tmp_path / "out"],
        ["verify", src, good],
        ["to-hf", good, tmp_path / "out"],
    ):
        line = refused(capsys, *argv)
        assert named in line and "config.json" in line, line
    assert snapshot(tmp_path) == before
