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


def test_existing_destination_needs_overwrite(make_hf, capsys, tmp_path):
    src = make_hf()
    dst = tmp_path / "dcp"
    dst.mkdir()
    (dst / "keep.txt").write_text("mine")
    code, err = run_cli(capsys, "to-dcp", src, dst)
    assert code == 2 and "--overwrite" in err
    assert (dst / "keep.txt").read_text() == "mine"
    code, _ = run_cli(capsys, "to-dcp", src, dst, "--overwrite")
    assert code == 0 and (dst / ".metadata").is_file() and not (dst / "keep.txt").exists()


def test_bad_dtype_and_shard_size_are_user_errors(make_hf, tmp_path):
    src = make_hf()
    to_dcp(src, tmp_path / "dcp")
    with pytest.raises(CheckpointError, match="--dtype"):
        from qwentitan.checkpoint import to_hf

        to_hf(tmp_path / "dcp", tmp_path / "out", dtype="int8")
    with pytest.raises(CheckpointError, match="--max-shard-size"):
        to_hf(tmp_path / "dcp", tmp_path / "out", max_shard_size="lots")
    assert not (tmp_path / "out").exists()


def test_failure_midway_leaves_no_output_and_source_untouched(make_hf, tmp_path, monkeypatch):
    src = make_hf(moe=True, tied=False)
    before = {p.name: p.read_bytes() for p in src.iterdir()}
    from qwentitan.checkpoint import safetensors_io

    calls = {"n": 0}
    real = safetensors_io.read_into

    def failing(stored, out):
        calls["n"] += 1
        if calls["n"] == 5:
            raise OSError("disk went away")
        real(stored, out)

    monkeypatch.setattr("qwentitan.checkpoint.convert.read_into", failing)
    monkeypatch.setattr("qwentitan.checkpoint.safetensors_io.read_into", failing)
    with pytest.raises(OSError, match="disk went away"):
        to_dcp(src, tmp_path / "out")
    assert not (tmp_path / "out").exists()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["hf"]
    assert {p.name: p.read_bytes() for p in src.iterdir()} == before
    shutil.rmtree(src)
