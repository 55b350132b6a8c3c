"""Faults of the user's environment and of the destination: one sentence, exit 2, the source
untouched, nothing half-written left behind; a full disk and a read-only folder for real
(tmpfs, when this process may mount), SIGTERM / SIGKILL on a real subprocess."""

import os
import shutil
import signal
import subprocess
import sys
import textwrap
import time
from contextlib import contextmanager
from pathlib import Path

import pytest
import torch

from qwentitan.checkpoint import output, to_dcp, to_hf
from qwentitan.checkpoint.cli import main


def run_cli(capsys, *argv) -> tuple[int, str]:
    code = main([str(a) for a in argv])
    return code, capsys.readouterr().err


def one_sentence(err: str) -> str:
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("qwentitan-ckpt: error: "), err
    assert "Traceback" not in err
    return lines[0]


def snapshot(folder: Path) -> dict[str, bytes]:
    return {str(p.relative_to(folder)): p.read_bytes() for p in folder.rglob("*") if p.is_file()}


def leftovers(folder: Path, name: str) -> list[str]:
    return sorted(p.name for p in folder.iterdir() if p.name.startswith(f".{name}."))


@contextmanager
def tmpfs(where: Path, *options: str):
    """A small tmpfs mounted at `where` (root only); skips the test where mounting is refused."""
    where.mkdir()
    if os.geteuid() != 0 or not shutil.which("mount"):
        pytest.skip("mounting a tmpfs needs root")
    mounted = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", ",".join(options), "tmpfs", str(where)],
        capture_output=True,
        text=True,
    )
    if mounted.returncode:
        pytest.skip(f"cannot mount a tmpfs here: {mounted.stderr.strip()}")
    try:
        yield where
    finally:
        subprocess.run(["umount", str(where)], check=True)


def source_for(verb: str, hf: Path, tmp_path: Path) -> Path:
    """What `verb` reads: the HF folder itself, or (to-hf) a DCP folder converted from it."""
    if verb == "to-dcp":
        return hf
    to_dcp(hf, tmp_path / "dcp")
    return tmp_path / "dcp"


def big_hf(tmp_path: Path, helpers) -> Path:
    """A dense model of ~1.3 MB: more than a 1 MiB tmpfs holds."""
    vocab = 20_000
    tensors = helpers.hf_tensors(moe=False, tied=False, dtype=torch.bfloat16)
    g = torch.Generator().manual_seed(1)
    for name in ("model.embed_tokens.weight", "lm_head.weight"):
        tensors[name] = torch.randn(vocab, helpers.HIDDEN, generator=g).bfloat16()
    config = helpers.hf_config(moe=False, tied=False) | {"vocab_size": vocab}
    return helpers.write_hf(tmp_path / "big", tensors, config, shards=2)


# --- --overwrite replaces only a checkpoint of the same kind --------------------------------


def test_overwrite_replaces_a_checkpoint_of_the_same_kind(make_hf, capsys, tmp_path):
    src = make_hf()
    dst = tmp_path / "dcp"
    to_dcp(src, dst)
    code, err = run_cli(capsys, "to-dcp", src, dst)
    assert code == 2 and "already exists" in one_sentence(err) and "--overwrite" in err
    assert "overwrite=True" not in err  # the CLI's flag, not the Python keyword (issue 56)
    stale = dst / "__0_999.distcp"
    stale.write_bytes(b"from an older save")
    assert run_cli(capsys, "to-dcp", src, dst, "--overwrite")[0] == 0
    assert (dst / ".metadata").is_file() and not stale.exists()
    to_hf(dst, tmp_path / "back")
    assert run_cli(capsys, "to-hf", dst, tmp_path / "back", "--overwrite")[0] == 0
    empty = tmp_path / "empty"
    empty.mkdir()
    assert run_cli(capsys, "to-dcp", src, empty, "--overwrite")[0] == 0
    assert (empty / ".metadata").is_file()
    assert leftovers(tmp_path, "dcp") == leftovers(tmp_path, "back") == []


@pytest.mark.parametrize(
    ("verb", "setup", "mentions"),
    [
        ("to-dcp", "file", ["is a file, not a DCP checkpoint folder"]),
        ("to-dcp", "unrelated", ["not a DCP checkpoint folder", ".metadata"]),
        ("to-dcp", "dcp+notes", ["holds notes.txt", "would delete it"]),
        ("to-dcp", "hf", ["not a DCP checkpoint folder"]),
        ("to-hf", "dcp", ["not a Hugging Face safetensors folder"]),
        ("to-hf", "hf+folder", ["holds tokenizer", "would delete it"]),
    ],
)
def test_overwrite_refuses_anything_else(make_hf, capsys, tmp_path, verb, setup, mentions):
    src = make_hf()
    dcp = tmp_path / "dcp-src"
    to_dcp(src, dcp)
    dst = tmp_path / "out"
    if setup == "file":
        dst.write_text("my notes")
    elif setup == "unrelated":
        dst.mkdir()
        (dst / "notes.txt").write_text("my notes")
    elif setup.startswith("dcp"):
        to_dcp(src, dst)
    else:
        to_hf(dcp, dst)
    if setup.endswith("+notes"):
        (dst / "notes.txt").write_text("my notes")
    if setup.endswith("+folder"):
        (dst / "tokenizer").mkdir()
    before = snapshot(dst) if dst.is_dir() else dst.read_bytes()
    source = src if verb == "to-dcp" else dcp
    code, err = run_cli(capsys, verb, source, dst, "--overwrite")
    line = one_sentence(err)
    assert code == 2 and str(dst) in line
    for m in mentions:
        assert m in line, line
    assert (snapshot(dst) if dst.is_dir() else dst.read_bytes()) == before
    assert leftovers(tmp_path, "out") == []


# --- destination faults: parent is a file, read-only, no space ------------------------------


@pytest.mark.parametrize("verb", ["to-dcp", "to-hf"])
def test_destination_whose_parent_is_a_file(make_hf, capsys, tmp_path, verb):
    src = make_hf()
    src = source_for(verb, src, tmp_path)
    (tmp_path / "afile").write_text("not a folder")
    code, err = run_cli(capsys, verb, src, tmp_path / "afile" / "sub" / "out")
    line = one_sentence(err)
    assert code == 2 and f"{tmp_path / 'afile'} is a file, not a folder" in line
    assert (tmp_path / "afile").read_text() == "not a folder"


@pytest.mark.parametrize("verb", ["to-dcp", "to-hf"])
def test_read_only_destination(make_hf, capsys, tmp_path, verb):
    src = make_hf()
    src = source_for(verb, src, tmp_path)
    before = snapshot(src)
    with tmpfs(tmp_path / "ro", "ro", "size=1m") as ro:
        code, err = run_cli(capsys, verb, src, ro / "nested" / "out")
        line = one_sentence(err)
        assert code == 2 and f"{ro} is on a read-only file system" in line
        assert str(ro / "nested" / "out") in line
        assert list(ro.iterdir()) == []
    assert snapshot(src) == before


def test_not_enough_free_space_is_refused_before_writing(make_hf, capsys, tmp_path, monkeypatch):
    src = make_hf()
    real = shutil.disk_usage
    monkeypatch.setattr(output.shutil, "disk_usage", lambda p: real(p)._replace(free=5_000_000))
    needs = 3_400_000_000
    monkeypatch.setattr("qwentitan.checkpoint.convert._space_needed", lambda total, files: needs)
    code, err = run_cli(capsys, "to-dcp", src, tmp_path / "out")
    line = one_sentence(err)
    assert code == 2
    assert f"no space left on device for {tmp_path / 'out'}: {tmp_path} has 5 MB free" in line
    assert "needs about 3.57 GB" in line  # the workspace's one rule: 5% above the estimate
    assert not (tmp_path / "out").exists() and leftovers(tmp_path, "out") == []


@pytest.mark.parametrize("verb", ["to-dcp", "to-hf"])
def test_disk_full_for_real(helpers, capsys, tmp_path, verb):
    src = big_hf(tmp_path, helpers)
    src = source_for(verb, src, tmp_path)
    before = snapshot(src)
    with tmpfs(tmp_path / "small", "size=1m") as small:
        code, err = run_cli(capsys, verb, src, small / "out")
        line = one_sentence(err)
        assert code == 2 and f"no space left on device for {small / 'out'}: " in line
        assert list(small.iterdir()) == []
    assert snapshot(src) == before


@pytest.mark.parametrize("verb", ["to-dcp", "to-hf"])
def test_disk_full_midway_is_one_sentence_and_cleaned_up(
    helpers, capsys, tmp_path, monkeypatch, verb
):
    """The free-space check passes (faked), then the real 1 MiB tmpfs fills up mid-write."""
    src = big_hf(tmp_path, helpers)
    src = source_for(verb, src, tmp_path)
    with tmpfs(tmp_path / "small", "size=1m") as small:
        real, calls = shutil.disk_usage, []

        def plenty_at_first(path):
            calls.append(path)
            usage = real(path)
            return usage._replace(free=10**12) if len(calls) == 1 else usage

        monkeypatch.setattr(output.shutil, "disk_usage", plenty_at_first)
        code, err = run_cli(capsys, verb, src, small / "out")
        line = one_sentence(err)
        assert code == 2 and f"no space left on device for {small / 'out'}: " in line
        assert "unexpected pos" not in err
        assert len(calls) > 1  # the failure itself was recognised as a full disk
        assert list(small.iterdir()) == []


# --- signals -----------------------------------------------------------------------------

# Runs the CLI with the third copy a writer thread makes stalled (a DCP piece for to-dcp,
# a shard copy for to-hf), so a signal lands mid-write: the partial folder holds some files.
_STALLED_CLI = textwrap.dedent(
    """
    import sys, threading, time
    from pathlib import Path
    from qwentitan.checkpoint import dcp_write, safetensors_io
    from qwentitan.checkpoint.cli import main

    calls, lock = [], threading.Lock()
    def stall(real):
        def stalled(*args, **kwargs):
            with lock:
                calls.append(args)
                first = len(calls) == 3
            if first:
                Path(sys.argv[1]).touch()
                time.sleep(float(sys.argv[2]))
            return real(*args, **kwargs)
        return stalled
    writer = safetensors_io.ShardedWriter
    dcp_write.copy_range = stall(dcp_write.copy_range)
    writer.copy, writer.write = stall(writer.copy), stall(writer.write)
    sys.exit(main(sys.argv[3:]))
    """
)


def start_stalled(tmp_path: Path, stall: float, *argv) -> tuple[subprocess.Popen, Path]:
    started = tmp_path / "started"
    proc = subprocess.Popen(
        [sys.executable, "-c", _STALLED_CLI, str(started), str(stall), *map(str, argv)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    deadline = time.monotonic() + 120
    while not started.exists():
        assert proc.poll() is None, proc.communicate()
        assert time.monotonic() < deadline, "the conversion never started writing"
        time.sleep(0.05)
    return proc, started


@pytest.mark.slow
@pytest.mark.parametrize(
    ("verb", "sig"),
    [("to-dcp", signal.SIGTERM), ("to-dcp", signal.SIGINT), ("to-hf", signal.SIGTERM)],
    ids=["to-dcp-SIGTERM", "to-dcp-SIGINT", "to-hf-SIGTERM"],
)
def test_signal_midway_removes_the_partial_output(make_hf, tmp_path, verb, sig):
    src = make_hf(moe=True)
    src = source_for(verb, src, tmp_path)
    before = snapshot(src)
    proc, _ = start_stalled(tmp_path, 2.0, verb, src, tmp_path / "out")
    assert [p for p in tmp_path.iterdir() if p.name.startswith(".out.partial-")]
    proc.send_signal(sig)
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == 2, err
    line = one_sentence(err)
    assert (
        f"interrupted by {sig.name}: removed the partial output, {tmp_path / 'out'} was not" in line
    )
    assert not (tmp_path / "out").exists() and leftovers(tmp_path, "out") == []
    assert snapshot(src) == before


@pytest.mark.slow
def test_partial_output_of_a_killed_run_is_removed_by_the_next(make_hf, capsys, tmp_path):
    src = make_hf()
    proc, _ = start_stalled(tmp_path, 60.0, "to-dcp", src, tmp_path / "out")
    proc.kill()  # SIGKILL: no cleanup is possible
    proc.communicate(timeout=60)
    (left,) = leftovers(tmp_path, "out")
    assert left.startswith(f".out.partial-{proc.pid}-")
    alive = tmp_path / f".out.partial-{os.getpid()}-0a1b2c3d"  # a run still going: kept
    alive.mkdir()
    other = tmp_path / ".other.partial-1-0a1b2c3d"  # another destination's: kept
    other.mkdir()

    code, err = run_cli(capsys, "to-dcp", src, tmp_path / "out")
    assert code == 0 and (tmp_path / "out" / ".metadata").is_file()
    assert (
        f"note: removed 1 partial output(s) that an interrupted earlier run to {tmp_path / 'out'}"
        in err
    )
    assert left in err
    assert leftovers(tmp_path, "out") == [alive.name] and other.is_dir()


def test_only_this_tools_own_partial_outputs_are_removed(make_hf, capsys, tmp_path):
    """A name beside the destination that merely starts like a partial output is the user's."""
    src = make_hf()
    dead = tmp_path / ".out.partial-4194305-0a1b2c3d"  # above Linux's largest pid: no writer
    dead.mkdir()
    (dead / "x.distcp").write_bytes(b"x")
    users = [tmp_path / ".out.partial-backup", tmp_path / ".out.partial-12-backup"]
    for folder in users:
        folder.mkdir()
        (folder / "notes.txt").write_text("mine")
    as_file = tmp_path / ".out.partial-4194305-0a1b2c3e"  # the tool only ever makes folders
    as_file.write_text("mine")

    code, err = run_cli(capsys, "to-dcp", src, tmp_path / "out")
    assert code == 0 and (tmp_path / "out" / ".metadata").is_file(), err
    assert "removed 1 partial output(s)" in err and dead.name in err
    assert not dead.exists()
    assert all((f / "notes.txt").read_text() == "mine" for f in users)
    assert as_file.read_text() == "mine"


@pytest.mark.parametrize("verb", ["to-dcp", "to-hf"])
def test_two_writers_into_one_new_folder_cannot_both_succeed(
    make_hf, capsys, tmp_path, monkeypatch, verb
):
    """Another writer finishes `out` while this one runs: this one fails, theirs is kept."""
    src = source_for(verb, make_hf(moe=True), tmp_path)
    dst = tmp_path / "out"
    convert = to_dcp if verb == "to-dcp" else to_hf
    real, first = output._sync_tree, {}

    def the_other_writer_finishes_first(folder: Path) -> None:
        real(folder)
        if not first:  # this writer's; the other writer's own call comes through here too
            first["started"] = True
            first["ino"] = convert(src, dst).stat().st_ino
            first["files"] = snapshot(dst)

    monkeypatch.setattr(output, "_sync_tree", the_other_writer_finishes_first)
    code, err = run_cli(capsys, verb, src, dst)
    assert code == 2
    assert f"destination {dst} was created by another writer while this one ran" in one_sentence(
        err
    )
    assert dst.stat().st_ino == first["ino"] and snapshot(dst) == first["files"]
    assert leftovers(tmp_path, "out") == []


def test_overwrite_checks_the_destination_again_at_the_rename(
    make_hf, capsys, tmp_path, monkeypatch
):
    """With --overwrite, what another writer put at the destination meanwhile is replaced only
    if it is a checkpoint of the same kind."""
    src, dst = make_hf(), tmp_path / "out"
    real = output._sync_tree

    def a_user_folder_appears(folder: Path) -> None:
        real(folder)
        dst.mkdir(exist_ok=True)
        (dst / "notes.txt").write_text("mine")

    monkeypatch.setattr(output, "_sync_tree", a_user_folder_appears)
    code, err = run_cli(capsys, "to-dcp", src, dst, "--overwrite")
    assert code == 2 and "--overwrite replaces only a DCP checkpoint folder" in one_sentence(err)
    assert sorted(p.name for p in dst.iterdir()) == ["notes.txt"]
    assert leftovers(tmp_path, "out") == []


@pytest.mark.slow
def test_sigterm_during_overwrite_keeps_the_old_checkpoint(make_hf, tmp_path):
    src = make_hf()
    to_dcp(src, tmp_path / "out")
    before = snapshot(tmp_path / "out")
    proc, _ = start_stalled(tmp_path, 2.0, "to-dcp", src, tmp_path / "out", "--overwrite")
    proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == 2 and f"{tmp_path / 'out'} is unchanged" in one_sentence(err)
    assert snapshot(tmp_path / "out") == before and leftovers(tmp_path, "out") == []
