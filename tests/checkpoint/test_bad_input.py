"""Each bad input: one sentence naming the file and the fix, exit 2, no traceback, no output."""

import json
import shutil

import pytest
import torch
from safetensors.torch import save_file

from qwentitan.checkpoint import CheckpointError, to_dcp
from qwentitan.checkpoint.cli import main


def run_cli(capsys, *argv: str) -> tuple[int, str]:
    code = main([str(a) for a in argv])
    captured = capsys.readouterr()
    return code, captured.err


def assert_refused(capsys, tmp_path, argv, *mentions: str) -> str:
    code, err = run_cli(capsys, *argv)
    assert code == 2, err
    assert "Traceback" not in err
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("qwentitan-ckpt: error: ")
    for m in mentions:
        assert m in err, err
    out = tmp_path / "out"
    assert not out.exists()
    assert not [p for p in out.parent.iterdir() if p.name.startswith(".out.")], (
        "partial output left"
    )
    return err


def test_truncated_safetensors(make_hf, capsys, tmp_path):
    src = make_hf(shards=2)
    shard = src / "model-00002-of-00002.safetensors"
    shard.write_bytes(shard.read_bytes()[:-100])
    assert_refused(capsys, tmp_path, ["to-dcp", src, tmp_path / "out"], str(shard), "truncated")


def test_corrupt_safetensors_header(make_hf, capsys, tmp_path):
    src = make_hf(shards=1)
    file = src / "model.safetensors"
    data = bytearray(file.read_bytes())
    data[8:20] = b"not json!!!!"
    file.write_bytes(bytes(data))
    assert_refused(capsys, tmp_path, ["to-dcp", src, tmp_path / "out"], str(file), "corrupt")


def test_shard_named_in_index_but_missing(make_hf, capsys, tmp_path):
    src = make_hf(shards=2)
    (src / "model-00001-of-00002.safetensors").unlink()
    assert_refused(
        capsys,
        tmp_path,
        ["to-dcp", src, tmp_path / "out"],
        "model-00001-of-00002.safetensors",
        "missing",
    )


def test_shape_disagrees_with_config(make_hf, capsys, tmp_path):
    src = make_hf(shards=1)
    config = json.loads((src / "config.json").read_text())
    config["intermediate_size"] += 8
    (src / "config.json").write_text(json.dumps(config))
    assert_refused(
        capsys, tmp_path, ["to-dcp", src, tmp_path / "out"], "config.json", "shape", "mlp."
    )


def _rewrite(src, change) -> None:
    from safetensors.torch import load_file

    file = src / "model.safetensors"
    tensors = load_file(file)
    change(tensors)
    save_file(tensors, file)


def test_unknown_key(make_hf, capsys, tmp_path):
    src = make_hf(shards=1)
    _rewrite(
        src, lambda t: t.__setitem__("model.layers.0.mlp.shared_expert.weight", torch.zeros(2))
    )
    assert_refused(
        capsys,
        tmp_path,
        ["to-dcp", src, tmp_path / "out"],
        "model.layers.0.mlp.shared_expert.weight",
    )


def test_missing_key(make_hf, capsys, tmp_path):
    src = make_hf(shards=1)
    _rewrite(src, lambda t: t.pop("model.layers.1.self_attn.k_norm.weight"))
    assert_refused(
        capsys,
        tmp_path,
        ["to-dcp", src, tmp_path / "out"],
        "model.layers.1.self_attn.k_norm.weight",
        "lacks",
    )


def test_key_present_in_two_shards(make_hf, capsys, tmp_path):
    src = make_hf(shards=2)
    from safetensors.torch import load_file

    first = src / "model-00001-of-00002.safetensors"
    second = src / "model-00002-of-00002.safetensors"
    extra = load_file(first)
    name = next(iter(extra))
    save_file(load_file(second) | {name: extra[name]}, second)
    assert_refused(capsys, tmp_path, ["to-dcp", src, tmp_path / "out"], name, "two shards")


def test_config_not_qwen3(make_hf, capsys, tmp_path):
    src = make_hf(shards=1)
    config = json.loads((src / "config.json").read_text())
    config["model_type"] = "llama"
    (src / "config.json").write_text(json.dumps(config))
    assert_refused(
        capsys, tmp_path, ["to-dcp", src, tmp_path / "out"], "config.json", "llama", "Qwen3"
    )


def test_dcp_folder_without_metadata(make_hf, capsys, tmp_path):
    src = make_hf()
    to_dcp(src, tmp_path / "dcp")
    (tmp_path / "dcp" / ".metadata").unlink()
    assert_refused(
        capsys,
        tmp_path,
        ["to-hf", tmp_path / "dcp", tmp_path / "out"],
        str(tmp_path / "dcp"),
        ".metadata",
    )
    code, err = run_cli(capsys, "verify", src, tmp_path / "dcp")
    assert code == 2 and ".metadata" in err and "Traceback" not in err


def test_destination_inside_source(make_hf, capsys, tmp_path):
    src = make_hf()
    code, err = run_cli(capsys, "to-dcp", src, src / "dcp")
    assert code == 2 and "inside the source" in err and "Traceback" not in err
    assert not (src / "dcp").exists()
    to_dcp(src, tmp_path / "dcp")
    code, err = run_cli(capsys, "to-hf", tmp_path / "dcp", tmp_path / "dcp" / "hf")
    assert code == 2 and "inside the source" in err
    assert not (tmp_path / "dcp" / "hf").exists()


def test_bad_dtype_and_shard_size_are_user_errors(make_hf, tmp_path):
    src = make_hf()
    to_dcp(src, tmp_path / "dcp")
    with pytest.raises(CheckpointError, match="--dtype"):
        from qwentitan.checkpoint import to_hf

        to_hf(tmp_path / "dcp", tmp_path / "out", dtype="int8")
    with pytest.raises(CheckpointError, match="--max-shard-size"):
        to_hf(tmp_path / "dcp", tmp_path / "out", max_shard_size="lots")
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("size", ["1e400GB", "inf", "nan", "-infMB", "1e309", "0.5"])
def test_a_shard_size_beyond_reason_is_one_sentence(make_hf, capsys, tmp_path, size):
    to_dcp(make_hf(), tmp_path / "dcp")
    err = assert_refused(
        capsys, tmp_path, ["to-hf", tmp_path / "dcp", tmp_path / "out", f"--max-shard-size={size}"]
    )
    assert "--max-shard-size" in err and repr(size) in err


@pytest.mark.parametrize("dst", ["/proc/qwentitan-x", "/proc/qwentitan-x/y", "/sys/qwentitan-x"])
def test_a_folder_that_takes_no_files_is_not_called_full(make_hf, capsys, tmp_path, dst):
    to_dcp(make_hf(), tmp_path / "dcp")
    code, err = run_cli(capsys, "to-hf", tmp_path / "dcp", dst)
    assert code == 2 and "Traceback" not in err, err
    assert len(err.strip().splitlines()) == 1, err
    assert "cannot write" in err and "no space" not in err, err


def test_failure_midway_leaves_no_output_and_source_untouched(make_hf, tmp_path, monkeypatch):
    src = make_hf(moe=True, tied=False)
    before = {p.name: p.read_bytes() for p in src.iterdir()}
    from qwentitan.checkpoint import dcp_write

    calls = {"n": 0}
    real = dcp_write.copy_range

    def failing(*args):
        calls["n"] += 1
        if calls["n"] == 5:
            raise OSError("disk went away")
        real(*args)

    monkeypatch.setattr(dcp_write, "copy_range", failing)
    with pytest.raises(OSError, match="disk went away"):
        to_dcp(src, tmp_path / "out")
    assert not (tmp_path / "out").exists()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["hf"]
    assert {p.name: p.read_bytes() for p in src.iterdir()} == before
    shutil.rmtree(src)


@pytest.mark.parametrize("dtype", [torch.int32, torch.int64, torch.bool])
def test_integer_weight_is_refused(make_hf, capsys, tmp_path, dtype):
    src = make_hf(shards=1)
    _rewrite(src, lambda t: t.__setitem__("model.norm.weight", t["model.norm.weight"].to(dtype)))
    name = str(dtype).removeprefix("torch.")
    err = assert_refused(
        capsys, tmp_path, ["to-dcp", src, tmp_path / "out"], "'model.norm.weight'", name
    )
    assert "floating point" in err
    code, err = run_cli(capsys, "verify", src, tmp_path / "dcp")
    assert code == 2 and "'model.norm.weight'" in err and "Traceback" not in err


def test_integer_weight_in_a_dcp_is_refused(make_hf, capsys, tmp_path):
    src = make_hf()
    to_dcp(src, tmp_path / "dcp")
    _save_dcp(tmp_path / "dcp", {"norm.weight": torch.ones(16, dtype=torch.int32)})
    assert_refused(
        capsys,
        tmp_path,
        ["to-hf", tmp_path / "dcp", tmp_path / "out"],
        "'norm.weight'",
        "int32",
        "floating point",
    )


def _save_dcp(folder, changes: dict) -> None:
    """Re-save a DCP folder with some tensors replaced, through DCP itself."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import FileSystemReader

    md = FileSystemReader(folder).read_metadata()
    state = {
        k: torch.empty(v.size, dtype=v.properties.dtype) for k, v in md.state_dict_metadata.items()
    }
    dcp.load(state, storage_reader=FileSystemReader(folder), no_dist=True)
    side = {p.name: p.read_bytes() for p in folder.glob("*.json")}
    shutil.rmtree(folder)
    dcp.save(state | changes, checkpoint_id=folder, no_dist=True)
    for name, data in side.items():
        (folder / name).write_bytes(data)


def test_tied_config_over_a_trained_head_is_refused(make_hf, capsys, tmp_path):
    untied = make_hf("untied", tied=False)
    to_dcp(untied, tmp_path / "dcp")
    tied_config = json.loads((untied / "config.json").read_text()) | {"tie_word_embeddings": True}
    (tmp_path / "tied.json").write_text(json.dumps(tied_config))
    before = sorted(p.read_bytes() for p in (tmp_path / "dcp").iterdir())
    err = assert_refused(
        capsys,
        tmp_path,
        ["to-hf", tmp_path / "dcp", tmp_path / "out", "--config", tmp_path / "tied.json"],
        "tie_word_embeddings=true",
        "lm_head.weight",
        str(tmp_path / "dcp"),
        "tie_word_embeddings=false",
    )
    assert "differs from tok_embeddings.weight" in err
    assert sorted(p.read_bytes() for p in (tmp_path / "dcp").iterdir()) == before


def test_tied_config_with_an_equal_head_exports(make_hf, helpers, capsys, tmp_path):
    """A training job saves the tied head as its own copy of the embedding: not a loss."""
    tied = make_hf("tied", tied=True)
    to_dcp(tied, tmp_path / "dcp")
    embedding = helpers.load_dcp(tmp_path / "dcp")["tok_embeddings.weight"]
    _save_dcp(tmp_path / "dcp", {"lm_head.weight": embedding.clone()})
    code, err = run_cli(capsys, "to-hf", tmp_path / "dcp", tmp_path / "out", "--config", tied)
    assert code == 0, err
    assert "lm_head.weight" not in helpers.load_hf(tmp_path / "out")


def _dcp_with_norm(make_hf, tmp_path, values: torch.Tensor):
    src = make_hf(dtype=torch.float32)
    to_dcp(src, tmp_path / "dcp")
    _save_dcp(tmp_path / "dcp", {"norm.weight": values})
    return tmp_path / "dcp"


def test_float16_overflow_is_refused_unless_allowed(make_hf, helpers, capsys, tmp_path):
    values = torch.ones(16)
    values[:3] = torch.tensor([1e5, -7e4, 3e38])
    dcp = _dcp_with_norm(make_hf, tmp_path, values)
    err = assert_refused(
        capsys,
        tmp_path,
        ["to-hf", dcp, tmp_path / "out", "--dtype", "float16"],
        "'norm.weight'",
        "inf",
        "--allow-overflow",
    )
    assert "65504" in err and "3e+38" in err
    code, err = run_cli(
        capsys, "to-hf", dcp, tmp_path / "out", "--dtype", "float16", "--allow-overflow"
    )
    assert code == 0, err
    assert "note: --dtype float16 turned 3 finite values into inf" in err
    assert torch.isinf(helpers.load_hf(tmp_path / "out")["model.norm.weight"]).sum() == 3


def test_float16_underflow_is_counted(make_hf, helpers, capsys, tmp_path):
    values = torch.ones(16)
    values[:4] = torch.tensor([1e-9, -1e-10, 0.0, 1e-6])  # two below float16's subnormals
    dcp = _dcp_with_norm(make_hf, tmp_path, values)
    code, err = run_cli(capsys, "to-hf", dcp, tmp_path / "out", "--dtype", "float16")
    assert code == 0, err
    assert "note: --dtype float16 turned 2 non-zero values into 0" in err
    assert "2 in 'norm.weight'" in err
    out = helpers.load_hf(tmp_path / "out")["model.norm.weight"]
    assert (out == 0).sum() == 3 and out.dtype == torch.float16


@pytest.mark.parametrize("damage", ["missing", "truncated", "corrupt"])
def test_verify_damaged_dcp_is_exit_2_naming_the_file(make_hf, capsys, tmp_path, damage):
    src = make_hf()
    to_dcp(src, tmp_path / "dcp")
    file = tmp_path / "dcp" / "__0_3.distcp"
    if damage == "missing":
        file.unlink()
    elif damage == "truncated":
        file.write_bytes(file.read_bytes()[:100])
    else:  # the zip directory at its end overwritten: same size, unreadable
        data = bytearray(file.read_bytes())
        data[-22:] = b"x" * 22
        file.write_bytes(bytes(data))
    code, err = run_cli(capsys, "verify", src, tmp_path / "dcp")
    assert code == 2, err
    lines = err.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in err
    assert str(file) in lines[0] and damage in lines[0]
    code, err = run_cli(capsys, "to-hf", tmp_path / "dcp", tmp_path / "out")
    assert code == 2 and str(file) in err and not (tmp_path / "out").exists()
