"""HF -> DCP -> HF is exact, with torchtitan's names and layout in the middle."""

import json

import pytest
import torch

from qwentitan.checkpoint import convert, to_dcp, to_hf, verify

KINDS = [
    pytest.param(dict(moe=False, tied=True), id="dense-tied"),
    pytest.param(dict(moe=False, tied=False), id="dense-untied"),
    pytest.param(dict(moe=True, tied=False), id="moe"),
]


@pytest.mark.parametrize("chunk_bytes", [None, 100], ids=["whole", "row-chunks"])
@pytest.mark.parametrize("kind", KINDS)
def test_hf_to_dcp_to_hf_is_bitwise_identical(
    make_hf, helpers, tmp_path, kind, chunk_bytes, monkeypatch
):
    if chunk_bytes:  # every tensor of the tiny model in several DCP chunks, as large ones are
        monkeypatch.setattr(convert, "CHUNK_BYTES", chunk_bytes)
    src = make_hf(**kind)
    to_dcp(src, tmp_path / "dcp")
    to_hf(tmp_path / "dcp", tmp_path / "back")

    before, after = helpers.load_hf(src), helpers.load_hf(tmp_path / "back")
    assert before.keys() == after.keys()
    for name in before:
        assert helpers.bitwise_equal(before[name], after[name]), name
    # Sharded as the source was (two shards and an index, make_hf's default).
    index = json.loads((src / "model.safetensors.index.json").read_text())["weight_map"]
    back_index = json.loads((tmp_path / "back" / "model.safetensors.index.json").read_text())
    assert back_index["weight_map"] == index
    # save_pretrained's metadata: bytes and parameters of the tensors written (issue 56)
    assert back_index["metadata"] == {
        "total_parameters": sum(t.numel() for t in after.values()),
        "total_size": sum(t.numel() * t.element_size() for t in after.values()),
    }
    assert json.loads((tmp_path / "back" / "config.json").read_text()) == json.loads(
        (src / "config.json").read_text()
    )
    assert (tmp_path / "back" / "generation_config.json").is_file()


def test_dcp_holds_torchtitan_names_and_stacked_experts(make_hf, helpers, tmp_path):
    src = make_hf(moe=True, tied=False)
    to_dcp(src, tmp_path / "dcp")
    hf, titan = helpers.load_hf(src), helpers.load_dcp(tmp_path / "dcp")

    assert torch.equal(titan["tok_embeddings.weight"], hf["model.embed_tokens.weight"])
    assert torch.equal(
        titan["layers.1.attention.qkv_linear.wk.weight"],
        hf["model.layers.1.self_attn.k_proj.weight"],
    )
    assert torch.equal(
        titan["layers.0.attention_norm.weight"], hf["model.layers.0.input_layernorm.weight"]
    )
    assert torch.equal(
        titan["layers.0.moe.router.gate.weight"], hf["model.layers.0.mlp.gate.weight"]
    )
    e, f, d = helpers.EXPERTS, helpers.MOE_FFN, helpers.HIDDEN
    experts = "layers.1.moe.routed_experts.inner_experts."
    assert titan[experts + "w1_EFD"].shape == (e, f, d)
    assert titan[experts + "w2_EDF"].shape == (e, d, f)
    for x in range(e):
        p = f"model.layers.1.mlp.experts.{x}."
        assert torch.equal(titan[experts + "w1_EFD"][x], hf[p + "gate_proj.weight"])
        assert torch.equal(titan[experts + "w3_EFD"][x], hf[p + "up_proj.weight"])
        assert torch.equal(titan[experts + "w2_EDF"][x], hf[p + "down_proj.weight"])
    bias = titan["layers.0.moe.expert_bias_E"]
    assert bias.dtype == torch.float32 and bias.shape == (e,) and not bias.any()
    assert not any(k.startswith("model.") for k in titan)


def test_large_tensors_are_written_as_row_chunks_dcp_reassembles(
    make_hf, helpers, tmp_path, monkeypatch
):
    from torch.distributed.checkpoint import FileSystemReader

    monkeypatch.setattr(convert, "CHUNK_BYTES", 300)
    src = make_hf(moe=True, tied=False)
    to_dcp(src, tmp_path / "dcp")

    md = FileSystemReader(tmp_path / "dcp").read_metadata().state_dict_metadata
    experts = "layers.1.moe.routed_experts.inner_experts.w1_EFD"
    # One expert (256 bytes) per chunk; 9 embedding rows (288 bytes) per chunk.
    assert [tuple(c.offsets) for c in md[experts].chunks] == [(e, 0, 0) for e in range(4)]
    assert [c.sizes[0] for c in md["tok_embeddings.weight"].chunks] == [9] * 5 + [3]
    assert len(md["norm.weight"].chunks) == 1  # small tensors stay whole
    files = list((tmp_path / "dcp").glob("*.distcp"))
    assert len(files) == sum(len(m.chunks) for m in md.values())  # one file per chunk
    # DCP's own reader reassembles them into the source tensors.
    hf, titan = helpers.load_hf(src), helpers.load_dcp(tmp_path / "dcp")
    assert torch.equal(titan["tok_embeddings.weight"], hf["model.embed_tokens.weight"])
    for x in range(helpers.EXPERTS):
        assert torch.equal(
            titan[experts][x], hf[f"model.layers.1.mlp.experts.{x}.gate_proj.weight"]
        )
    assert verify(src, tmp_path / "dcp").ok


@pytest.mark.parametrize("kernel_copy", ["copy_file_range", "sendfile", "neither"])
def test_every_byte_is_copied_in_the_kernel_both_ways(
    make_hf, helpers, tmp_path, monkeypatch, kernel_copy
):
    """to-dcp and to-hf copy every tensor byte file to file (copy_file_range, else sendfile,
    else a buffer), experts included; the results are bitwise the same either way."""
    import errno
    import os

    monkeypatch.setattr(convert, "CHUNK_BYTES", 600)  # two experts (several regions) a piece
    copied = {"copy_file_range": 0, "sendfile": 0}
    real_cfr, real_sendfile = os.copy_file_range, os.sendfile

    def cfr(src, dst, count, offset_src, offset_dst):
        if kernel_copy != "copy_file_range":
            raise OSError(errno.EXDEV, "no copy between these file systems")
        got = real_cfr(src, dst, count, offset_src, offset_dst)
        copied["copy_file_range"] += got
        return got

    def sendfile(out, in_, offset, count):
        if kernel_copy == "neither":
            raise OSError(errno.EINVAL, "no sendfile here")
        got = real_sendfile(out, in_, offset, count)
        if not os.readlink(f"/proc/self/fd/{in_}").endswith(".json"):  # shutil copies configs
            copied["sendfile"] += got
        return got

    monkeypatch.setattr(os, "copy_file_range", cfr)
    monkeypatch.setattr(os, "sendfile", sendfile)
    src = make_hf(moe=True, tied=False)
    to_dcp(src, tmp_path / "dcp")
    to_dcp_copied = dict(copied)
    copied.update({"copy_file_range": 0, "sendfile": 0})
    to_hf(tmp_path / "dcp", tmp_path / "back")

    hf = helpers.load_hf(src)
    model_bytes = sum(t.nbytes for t in hf.values())
    if kernel_copy != "neither":  # every byte of every weight went through the kernel copy
        assert to_dcp_copied[kernel_copy] == copied[kernel_copy] == model_bytes
    assert verify(src, tmp_path / "dcp").ok
    back = helpers.load_hf(tmp_path / "back")
    assert back.keys() == hf.keys()
    assert all(helpers.bitwise_equal(hf[k], back[k]) for k in hf)


@pytest.mark.parametrize("dtype", [None, "float32"], ids=["copied", "cast"])
def test_writeback_starts_for_every_tensor_byte(make_hf, helpers, tmp_path, monkeypatch, dtype):
    """Each range written is handed to the kernel's writeback at once, so the final sync finds
    little left: every data byte of every output file, whether copied or cast, exactly once."""
    import os

    from qwentitan.checkpoint import disk, safetensors_io

    started: dict[str, list[tuple[int, int]]] = {}
    real = disk.start_writeback

    def start_writeback(fd, offset, nbytes):
        started.setdefault(os.path.basename(os.readlink(f"/proc/self/fd/{fd}")), []).append(
            (offset, offset + nbytes)
        )
        real(fd, offset, nbytes)

    monkeypatch.setattr(disk, "start_writeback", start_writeback)
    monkeypatch.setattr(safetensors_io, "start_writeback", start_writeback)
    src = make_hf(moe=True, tied=False, dtype=torch.bfloat16)
    to_dcp(src, tmp_path / "dcp")
    model_bytes = sum(t.nbytes for t in helpers.load_hf(src).values())
    assert sum(stop - start for ranges in started.values() for start, stop in ranges) == (
        model_bytes
    )

    started.clear()
    to_hf(tmp_path / "dcp", tmp_path / "back", dtype=dtype, max_shard_size="4KB")
    shards = sorted((tmp_path / "back").glob("*.safetensors"))
    assert len(shards) > 1 and sorted(started) == [s.name for s in shards]
    for shard in shards:
        data_start = 8 + int.from_bytes(shard.read_bytes()[:8], "little")
        ranges = sorted(started[shard.name])
        covered = data_start
        for start, stop in ranges:  # back to back, no gap, no byte twice
            assert start == covered, shard.name
            covered = stop
        assert covered == shard.stat().st_size, shard.name


@pytest.mark.parametrize("shards", [1, 3])
def test_to_hf_shards_as_the_source_was_unless_told(make_hf, helpers, tmp_path, shards):
    src = make_hf(moe=True, tied=False, shards=shards)
    to_dcp(src, tmp_path / "dcp")
    to_hf(tmp_path / "dcp", tmp_path / "back")
    assert sorted(p.name for p in (tmp_path / "back").iterdir()) == sorted(
        p.name for p in src.iterdir()
    )
    if shards > 1:
        index = "model.safetensors.index.json"
        assert (
            json.loads((tmp_path / "back" / index).read_text())["weight_map"]
            == json.loads((src / index).read_text())["weight_map"]
        )
    before, after = helpers.load_hf(src), helpers.load_hf(tmp_path / "back")
    assert all(helpers.bitwise_equal(before[k], after[k]) for k in before)
    # --max-shard-size, or a --dtype that changes the sizes, shards by size as before.
    to_hf(tmp_path / "dcp", tmp_path / "sized", max_shard_size="1GB")
    assert [p.name for p in (tmp_path / "sized").glob("*.safetensors")] == ["model.safetensors"]
    to_hf(tmp_path / "dcp", tmp_path / "cast", dtype="float32")
    assert [p.name for p in (tmp_path / "cast").glob("*.safetensors")] == ["model.safetensors"]


@pytest.mark.parametrize("name", ["../x.safetensors", "/tmp/x.safetensors", "a/b.safetensors"])
def test_a_shard_plan_naming_files_outside_the_output_is_refused(make_hf, tmp_path, name):
    from qwentitan.checkpoint import CheckpointError
    from qwentitan.checkpoint.convert import SHARD_PLAN

    to_dcp(make_hf(), tmp_path / "dcp")
    plan = json.loads((tmp_path / "dcp" / SHARD_PLAN).read_text())
    first = sorted(plan["weight_map"])[0]
    plan["weight_map"][first] = name
    (tmp_path / "dcp" / SHARD_PLAN).write_text(json.dumps(plan))
    with pytest.raises(CheckpointError, match="plain file name"):
        to_hf(tmp_path / "dcp", tmp_path / "back")
    assert not (tmp_path / "back").exists() and not (tmp_path / "x.safetensors").exists()


def test_copies_into_one_shard_take_turns(make_hf, helpers, tmp_path, monkeypatch):
    """Threads writing one destination file contend for its inode lock and spin in the kernel:
    to-hf's copies into one shard never overlap, and the export is still exact."""
    import os
    import threading
    import time

    from qwentitan.checkpoint import safetensors_io

    monkeypatch.setattr(convert, "CHUNK_BYTES", 600)  # many pieces
    monkeypatch.setattr(convert, "THREADS", 4)
    src = make_hf(moe=True, tied=False)
    to_dcp(src, tmp_path / "dcp")
    active: dict[str, int] = {}
    most = {"per_file": 0, "copies": 0}
    lock = threading.Lock()
    real_copy = safetensors_io.copy_range

    def copy_range(src_file, dst_fd, *args):
        target = os.readlink(f"/proc/self/fd/{dst_fd}")
        with lock:
            active[target] = active.get(target, 0) + 1
            most["per_file"] = max(most["per_file"], active[target])
            most["copies"] += 1
        time.sleep(0.005)  # long enough for another thread to arrive if it may
        try:
            real_copy(src_file, dst_fd, *args)
        finally:
            with lock:
                active[target] -= 1

    monkeypatch.setattr(safetensors_io, "copy_range", copy_range)
    to_hf(tmp_path / "dcp", tmp_path / "back")

    assert most["copies"] > 8 and most["per_file"] == 1
    before, after = helpers.load_hf(src), helpers.load_hf(tmp_path / "back")
    assert all(helpers.bitwise_equal(before[k], after[k]) for k in before)


def test_tied_lm_head_is_recreated_in_dcp_and_dropped_on_export(make_hf, helpers, tmp_path):
    src = make_hf(moe=False, tied=True)
    to_dcp(src, tmp_path / "dcp")
    titan = helpers.load_dcp(tmp_path / "dcp")
    assert torch.equal(titan["lm_head.weight"], titan["tok_embeddings.weight"])
    to_hf(tmp_path / "dcp", tmp_path / "back")
    assert "lm_head.weight" not in helpers.load_hf(tmp_path / "back")


def test_export_dtype_and_shard_size(make_hf, helpers, tmp_path):
    src = make_hf(moe=True, tied=False, dtype=torch.bfloat16)
    to_dcp(src, tmp_path / "dcp")
    to_hf(tmp_path / "dcp", tmp_path / "back", dtype="float32", max_shard_size="4KB")

    shards = sorted((tmp_path / "back").glob("model-*-of-*.safetensors"))
    assert len(shards) > 3
    assert all(s.stat().st_size <= 4000 + 4096 for s in shards)  # header + one tensor over
    index = json.loads((tmp_path / "back" / "model.safetensors.index.json").read_text())
    assert set(index["weight_map"]) == set(helpers.load_hf(src))
    assert set(index["weight_map"].values()) == {s.name for s in shards}
    before, after = helpers.load_hf(src), helpers.load_hf(tmp_path / "back")
    assert before.keys() == after.keys()
    for name in before:
        assert after[name].dtype == torch.float32
        assert torch.equal(after[name], before[name].float()), name
    config = json.loads((tmp_path / "back" / "config.json").read_text())
    assert config["dtype"] == "float32"


def test_to_hf_takes_the_config_from_elsewhere(make_hf, helpers, tmp_path):
    src = make_hf(moe=False, tied=False)
    to_dcp(src, tmp_path / "dcp")
    (tmp_path / "dcp" / "config.json").unlink()
    to_hf(tmp_path / "dcp", tmp_path / "back", config=src / "config.json")
    assert helpers.load_hf(tmp_path / "back").keys() == helpers.load_hf(src).keys()


@pytest.mark.parametrize("kind", KINDS)
def test_verify_passes_a_faithful_conversion(make_hf, tmp_path, kind):
    src = make_hf(**kind)
    to_dcp(src, tmp_path / "dcp")
    report = verify(src, tmp_path / "dcp")
    assert report.ok, report.format()
    assert report.compared > 0 and "identical" in report.format()


@pytest.mark.parametrize("moe", [False, True], ids=["dense", "moe"])
def test_verify_catches_a_single_flipped_value(make_hf, helpers, tmp_path, moe):
    src = make_hf(moe=moe, tied=False)
    to_dcp(src, tmp_path / "dcp")
    tensors = helpers.hf_tensors(moe=moe, tied=False, dtype=torch.bfloat16)
    name = (
        "model.layers.1.mlp.experts.2.down_proj.weight"
        if moe
        else "model.layers.1.mlp.up_proj.weight"
    )
    tensors[name][3, 5] = -tensors[name][3, 5]  # one sign bit
    changed = helpers.write_hf(
        tmp_path / "changed", tensors, helpers.hf_config(moe=moe, tied=False), 2
    )

    report = verify(changed, tmp_path / "dcp")
    assert not report.ok
    assert len(report.value_mismatches) == 1
    difference = report.value_mismatches[0]
    titan = (
        "layers.1.moe.routed_experts.inner_experts.w2_EDF"
        if moe
        else "layers.1.feed_forward.w3.weight"
    )
    assert difference.name == titan and difference.differing == 1
    assert "DIFFERENT" in report.format()


def test_verify_reports_missing_and_extra_keys(make_hf, tmp_path):
    dense, moe = make_hf("dense", moe=False, tied=False), make_hf("moe", moe=True, tied=False)
    to_dcp(moe, tmp_path / "dcp")
    report = verify(dense, tmp_path / "dcp")
    assert not report.ok
    assert "layers.0.feed_forward.w1.weight" in report.missing_in_dcp
    assert "layers.0.moe.routed_experts.inner_experts.w1_EFD" in report.unexpected_in_dcp
    assert "missing from the DCP" in report.format()


def test_cli_verify_exits_1_on_a_difference_and_0_when_identical(make_hf, tmp_path, capsys):
    from qwentitan.checkpoint.cli import main

    a, b = make_hf("a", tied=False), make_hf("b", tied=True)
    assert main(["to-dcp", str(a), str(tmp_path / "dcp")]) == 0
    assert main(["verify", str(a), str(tmp_path / "dcp")]) == 0
    assert "identical" in capsys.readouterr().out
    assert main(["verify", str(b), str(tmp_path / "dcp")]) == 1
    assert "DIFFERENT" in capsys.readouterr().out


@pytest.mark.parametrize("balancing", [True, False], ids=["expert-bias", "no-expert-bias"])
def test_to_hf_reads_a_training_checkpoint_saved_one_file_per_rank(
    make_hf, helpers, tmp_path, balancing
):
    """A torchtitan-style DCP: all tensors in one file, plus optimizer and train state to ignore;
    without expert_bias_E when the model trained with load balancing off (qwentitan's MoE)."""
    import shutil

    import torch.distributed.checkpoint as dcp

    src = make_hf(moe=True, tied=False)
    to_dcp(src, tmp_path / "ours")
    state = helpers.load_dcp(tmp_path / "ours")
    if not balancing:
        state = {k: v for k, v in state.items() if not k.endswith("expert_bias_E")}
    state["optimizer"] = {"state.norm.weight.exp_avg": torch.ones(3)}
    state["train_state"] = {"step": 7}
    dcp.save(state, checkpoint_id=tmp_path / "step-7", no_dist=True)
    assert len(list((tmp_path / "step-7").glob("*.distcp"))) == 1
    shutil.copy(src / "config.json", tmp_path / "config.json")

    to_hf(tmp_path / "step-7", tmp_path / "back", config=tmp_path / "config.json")
    before, after = helpers.load_hf(src), helpers.load_hf(tmp_path / "back")
    assert before.keys() == after.keys()
    assert all(helpers.bitwise_equal(before[k], after[k]) for k in before)
    assert verify(src, tmp_path / "step-7").ok


def test_to_hf_copies_from_a_training_checkpoint_one_file_per_rank(
    make_hf, helpers, tmp_path, monkeypatch
):
    """Records inside one shared file (torchtitan's one file per rank) are located to their data
    bytes and copied, not loaded through DCP."""
    import torch.distributed.checkpoint as dcp

    from qwentitan.checkpoint import dcp_read

    src = make_hf(moe=True, tied=False)
    to_dcp(src, tmp_path / "ours")
    dcp.save(helpers.load_dcp(tmp_path / "ours"), checkpoint_id=tmp_path / "step-1", no_dist=True)

    def no_dcp_load(self, fqn):
        raise AssertionError(f"{fqn} went through dcp.load")

    monkeypatch.setattr(dcp_read.DCPFolder, "_dcp_load", no_dcp_load)
    to_hf(tmp_path / "step-1", tmp_path / "back", config=src)
    before, after = helpers.load_hf(src), helpers.load_hf(tmp_path / "back")
    assert all(helpers.bitwise_equal(before[k], after[k]) for k in before)
