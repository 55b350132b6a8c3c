"""Input that tries to run code or slips past a check: refused in one sentence, exit 2."""

import json
import os
import pickle

import pytest
import torch
import torch.distributed.checkpoint as dcp
from safetensors.torch import load_file, save_file

from qwentitan.checkpoint import (
    CheckpointError,
    MetadataUnpickler,
    SafeFileSystemReader,
    read_dcp_metadata,
    to_dcp,
)
from qwentitan.checkpoint.cli import main


@pytest.fixture
def one_line_error(helpers):
    return helpers.one_line_error


class _Payload:
    """A pickle whose loading creates a marker file: what a hostile `.metadata` does."""

    def __init__(self, marker):
        self.marker = str(marker)

    def __reduce__(self):
        return (exec, (f"open({self.marker!r}, 'w').close()",))


@pytest.mark.parametrize("verb", ["to-hf", "verify"])
def test_a_pickled_payload_as_metadata_is_never_run(
    one_line_error, make_hf, capsys, tmp_path, verb
):
    src = make_hf()
    to_dcp(src, tmp_path / "dcp")
    marker = tmp_path / "marker"
    (tmp_path / "dcp" / ".metadata").write_bytes(pickle.dumps(_Payload(marker)))
    pickle.loads(pickle.dumps(_Payload(tmp_path / "proof")))  # the payload does work
    assert (tmp_path / "proof").exists()

    argv = [tmp_path / "dcp", tmp_path / "out"] if verb == "to-hf" else [src, tmp_path / "dcp"]
    line = one_line_error(capsys, verb, *argv)
    assert not marker.exists()
    assert str(tmp_path / "dcp" / ".metadata") in line and "builtins.exec" in line
    assert not (tmp_path / "out").exists()


def test_the_storage_reader_refuses_a_payload_and_loads_a_training_checkpoint(tmp_path):
    state = {
        "model": {"w": torch.randn(4, 3), "b": torch.randn(3).to(torch.bfloat16)},
        "optimizer": {"state": {"w": {"step": torch.tensor(7.0)}}, "param_groups": [{"lr": 0.1}]},
        "train_state": {"step": 7, "name": "run"},
    }
    dcp.save(state, checkpoint_id=tmp_path / "step-7", no_dist=True)
    loaded = {
        "model": {"w": torch.zeros(4, 3), "b": torch.zeros(3, dtype=torch.bfloat16)},
        "optimizer": {"state": {"w": {"step": torch.tensor(0.0)}}, "param_groups": [{"lr": 0}]},
        "train_state": {"step": 0, "name": ""},
    }
    dcp.load(loaded, storage_reader=SafeFileSystemReader(tmp_path / "step-7"), no_dist=True)
    assert torch.equal(loaded["model"]["w"], state["model"]["w"])
    assert torch.equal(loaded["model"]["b"], state["model"]["b"])
    assert loaded["optimizer"]["param_groups"][0]["lr"] == 0.1
    assert loaded["train_state"] == {"step": 7, "name": "run"}
    # The allow-list builds DCP's own classes, exactly what pickle.load gives.
    with open(tmp_path / "step-7" / ".metadata", "rb") as f:
        assert MetadataUnpickler(f).load() == pickle.loads(
            (tmp_path / "step-7" / ".metadata").read_bytes()
        )

    marker = tmp_path / "marker"
    (tmp_path / "step-7" / ".metadata").write_bytes(pickle.dumps(_Payload(marker)))
    # DCP wraps the reader's error in its CheckpointException (a BaseException), sentence kept.
    with pytest.raises(BaseException, match=r"builtins\.exec is not allowed"):
        dcp.load(loaded, storage_reader=SafeFileSystemReader(tmp_path / "step-7"), no_dist=True)
    with pytest.raises(CheckpointError, match=r"builtins\.exec is not allowed"):
        read_dcp_metadata(tmp_path / "step-7")
    assert not marker.exists()


def test_to_dcp_metadata_is_what_dcp_save_writes(make_hf, helpers, tmp_path, monkeypatch):
    """`.metadata` is pickled by hand (no DCP import): the same objects DCP pickles."""
    from qwentitan.checkpoint import convert

    monkeypatch.setattr(convert, "CHUNK_BYTES", 1 << 30)  # whole tensors, as dcp.save writes them
    src = make_hf(moe=True, tied=True)
    to_dcp(src, tmp_path / "ours")
    state = helpers.load_dcp(tmp_path / "ours")
    dcp.save(state, checkpoint_id=tmp_path / "theirs", no_dist=True)
    ours = read_dcp_metadata(tmp_path / "ours")
    theirs = dcp.FileSystemReader(tmp_path / "theirs").read_metadata()
    assert ours.state_dict_metadata == theirs.state_dict_metadata
    assert ours.planner_data == theirs.planner_data
    assert ours.version == theirs.version
    assert {i.fqn for i in ours.storage_data} == {i.fqn for i in theirs.storage_data}


def test_a_destination_that_is_a_symlink_loop(one_line_error, make_hf, capsys, tmp_path):
    src = make_hf()
    os.symlink(tmp_path / "loop", tmp_path / "loop")
    line = one_line_error(capsys, "to-dcp", src, tmp_path / "loop" / "out")
    assert str(tmp_path / "loop") in line and "symbolic link loop" in line
    line = one_line_error(capsys, "to-dcp", src, tmp_path / "loop")
    assert "symbolic link loop" in line


@pytest.mark.parametrize(
    "argv",
    [[], ["to-dcp"], ["to-hf", "a"], ["verify", "a", "b", "--bogus"], ["convert", "a", "b"]],
    ids=["no-verb", "no-args", "one-arg", "unknown-flag", "unknown-verb"],
)
def test_usage_errors_are_one_line_naming_the_fix(capsys, argv):
    with pytest.raises(SystemExit) as exit:
        main(argv)
    assert exit.value.code == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1, lines
    assert lines[0].startswith("qwentitan-ckpt") and "--help" in lines[0]


def _add_head(folder, head: torch.Tensor) -> None:
    (file,) = folder.glob("*.safetensors")
    tensors = load_file(file)
    save_file(tensors | {"lm_head.weight": head}, file, metadata={"format": "pt"})


def test_to_dcp_refuses_a_tied_config_over_a_different_head(
    one_line_error, make_hf, helpers, capsys, tmp_path
):
    src = make_hf(tied=True, shards=1)
    embedding = helpers.load_hf(src)["model.embed_tokens.weight"]
    head = embedding.clone()
    head[3, 5] += 1
    _add_head(src, head)
    line = one_line_error(capsys, "to-dcp", src, tmp_path / "out")
    assert "tie_word_embeddings=true" in line and "lm_head.weight" in line
    assert "1 of" in line and not (tmp_path / "out").exists()
    # verify would otherwise call the folders identical: it refuses the same folder.
    to_dcp(make_hf("other", tied=True), tmp_path / "dcp")
    assert "lm_head.weight" in one_line_error(capsys, "verify", src, tmp_path / "dcp")


def test_to_dcp_takes_a_tied_config_with_the_embedding_as_head(make_hf, helpers, tmp_path):
    src = make_hf(tied=True, shards=1)
    _add_head(src, helpers.load_hf(src)["model.embed_tokens.weight"].clone())
    to_dcp(src, tmp_path / "dcp")
    config = json.loads((src / "config.json").read_text())
    assert config["tie_word_embeddings"] is True
    titan = helpers.load_dcp(tmp_path / "dcp")
    assert torch.equal(titan["lm_head.weight"], titan["tok_embeddings.weight"])


def test_to_hf_drops_auto_map_and_says_so(make_hf, capsys, tmp_path):
    """An `auto_map` naming a Hub repository would make a later `trust_remote_code=True` load
    fetch and run that code: the export, transformers' own Qwen3, goes without it."""
    src = make_hf()
    config = json.loads((src / "config.json").read_text())
    auto_map = {"AutoModelForCausalLM": "evil/repo--modeling_evil.EvilForCausalLM"}
    (src / "config.json").write_text(json.dumps(config | {"auto_map": auto_map}))
    to_dcp(src, tmp_path / "dcp")
    assert main(["to-hf", str(tmp_path / "dcp"), str(tmp_path / "out")]) == 0
    err = capsys.readouterr().err
    assert "note: dropped auto_map from the exported config.json" in err
    exported = json.loads((tmp_path / "out" / "config.json").read_text())
    assert "auto_map" not in exported and exported == config
