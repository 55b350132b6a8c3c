"""Bad input is refused in one sentence with exit code 2 before any rank starts, writing nothing.

Every case runs `qwentitan-launch` in this process (no torchrun): numeric flags out of range in
plan, train, run and slurm; damaged dataset files; checkpoints `train --resume` or `run`
would fail to resume from.
"""

from __future__ import annotations

import gzip
import logging
import os
import pickle
import signal
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp

from qwentitan.launch.base.errors import LaunchError
from qwentitan.launch.launcher import cli
from qwentitan.launch.launcher.memory import meta_model
from qwentitan.launch.launcher.resume import check_resumable
from qwentitan.launch.recipes import get_recipe
from qwentitan.launch.runtime.data import check_json_lines


def refusal(capsys, argv: list[str]) -> str:
    """Run the CLI, check exit code 2 and a one-line stderr; return that line without its prefix."""
    try:
        code = cli.main(argv)
    except SystemExit as exit_:  # argparse's own refusals exit from parse_args
        code = exit_.code
    out, err = capsys.readouterr()
    assert code == 2, out + err
    assert "Traceback" not in out + err and "usage:" not in err
    line = err.strip()
    prefix = f"qwentitan-launch {argv[0]}: "
    assert line.startswith(prefix) and "\n" not in line, err
    return line.removeprefix(prefix)


@pytest.fixture(autouse=True)
def nothing_logged_before_the_sentence(caplog):
    """Outside pytest a logged warning reaches stderr too, before the one sentence."""
    yield
    assert [
        r.getMessage() for r in caplog.get_records("call") if r.levelno >= logging.WARNING
    ] == []


@pytest.fixture
def in_tmp(tmp_path, monkeypatch):
    """Run in an empty folder, so that anything a refused command wrote would show up here."""
    monkeypatch.chdir(tmp_path)
    return tmp_path


NUMERIC = [
    (["plan", "--recipe", "tiny_dense", "--seq-len", "0"], "--seq-len: 0 is out of range"),
    (["plan", "--recipe", "tiny_dense", "--seq-len", "-256"], "--seq-len: -256 is out of range"),
    (["plan", "--recipe", "tiny_dense", "--steps", "0"], "--steps: 0 is out of range"),
    (["plan", "--recipe", "tiny_dense", "--local-batch-size", "0"], "--local-batch-size: 0 is"),
    (["plan", "--recipe", "tiny_dense", "--global-batch-size", "0"], "--global-batch-size: 0"),
    (["plan", "--recipe", "tiny_dense", "--nodes", "0"], "--nodes/--nnodes: 0 is out of range"),
    (["plan", "--recipe", "tiny_dense", "--tp", "-1"], "--tp: -1 is out of range"),
    (["plan", "--recipe", "tiny_dense", "--checkpoint-interval", "0"], "--checkpoint-interval"),
    (["plan", "--recipe", "tiny_dense", "--hf-every", "0"], "--hf-every: 0 is out of range"),
    (["plan", "--recipe", "tiny_dense", "--seq-len", "1e3"], "'1e3' is not a whole number"),
    (["train", "--steps", "0"], "--steps: 0 is out of range"),
    (["train", "--validate-every", "0"], "--validate-every: 0 is out of range"),
    (["train", "--local-batch-size", "0"], "--local-batch-size: 0 is out of range"),
    (["train", "--seq-len", "-256"], "--seq-len: -256 is out of range"),
    (["train", "--ranks", "0"], "--ranks: 0 is out of range"),
    (["train", "--stop-after", "0"], "--stop-after: 0 is out of range"),
    (["run", "--recipe", "tiny_dense", "--max-restarts", "-2"], "--max-restarts: -2 is out"),
    (["slurm", "--recipe", "tiny_dense", "--port", "99999"], "--port: 99999 is out of range"),
    (["slurm", "--recipe", "tiny_dense", "--port", "0"], "--port: 0 is out of range"),
    (["slurm", "--recipe", "tiny_dense", "--grace-seconds", "-5"], "--grace-seconds: -5 is"),
    (["slurm", "--recipe", "tiny_dense", "--nodes", "-4"], "--nodes/--nnodes: -4 is out"),
]


@pytest.mark.parametrize(("argv", "expected"), NUMERIC, ids=[" ".join(a) for a, _ in NUMERIC])
def test_numeric_flags_out_of_range(capsys, in_tmp, argv, expected):
    message = refusal(capsys, argv)
    assert message.startswith("argument ") and expected in message
    assert message.endswith(("pass a whole number of 1 or more.", "or more.", "65535."))
    assert os.listdir(in_tmp) == []  # no plan, script, run folder or checkpoint


def test_the_range_names_a_value_that_works(capsys, in_tmp):
    message = refusal(capsys, ["slurm", "--recipe", "tiny_dense", "--port", "70000"])
    assert message == "argument --port: 70000 is out of range; pass a whole number from 1 to 65535."
    message = refusal(capsys, ["train", "--steps", "0"])
    assert message == "argument --steps: 0 is out of range; pass a whole number of 1 or more."


def test_usage_errors_are_one_line_too(capsys, in_tmp):
    message = refusal(capsys, ["plan", "--seq-len", "256"])
    assert message == (
        "the following arguments are required: --recipe; see qwentitan-launch plan --help."
    )


def test_stop_after_must_come_before_the_last_step(capsys, in_tmp):
    message = refusal(capsys, ["train", "--steps", "3", "--stop-after", "3"])
    assert message.startswith("--stop-after 3 is not before the last step 3; pass --stop-after 2")
    assert os.listdir(in_tmp) == []


GOOD = '{"text": "a document"}\n'


def damaged(tmp_path: Path, name: str, content: bytes) -> Path:
    path = tmp_path / "data" / name
    path.parent.mkdir(exist_ok=True)
    path.write_bytes(content)
    return path


BAD_LINES = [
    (
        (GOOD * 2 + '{"text": "cut off\n' + GOOD).encode(),
        3,
        "is not JSON (Unterminated string starting at column 10)",
    ),
    ((GOOD + '{"content": "no text"}\n').encode(), 2, "has no `text` string"),
    ((GOOD * 3 + '{"text": 42}\n').encode(), 4, "has no `text` string"),
    ((GOOD + "[1, 2]\n").encode(), 2, "has no `text` string"),
    (GOOD.encode() * 4 + '{"text": "caf\xe9"}\n'.encode("latin-1"), 5, "is not UTF-8 (byte 14"),
    (b"\x7fELF\x02\x01\x01\x00\xff\xfe\x00\x00" * 8, 1, "is not UTF-8 (byte 9 of the line)"),
    (
        (GOOD + '{"text": "a", "x": ' + "[" * 100_000 + "]" * 100_000 + "}\n").encode(),
        2,
        "nests deeper than Python's JSON reader goes",
    ),
    (
        (GOOD * 2 + '{"text": "a", "n": ' + "9" * 5000 + "}\n").encode(),
        3,
        "is not JSON Python can read (Exceeds the limit (4300 digits) for integer string",
    ),
]
BAD_LINE_IDS = [
    "broken-json",
    "no-text",
    "text-not-a-string",
    "not-an-object",
    "latin-1",
    "binary",
    "nested-100k-deep",
    "5000-digit-integer",
]


@pytest.mark.parametrize(("content", "line", "words"), BAD_LINES, ids=BAD_LINE_IDS)
def test_a_bad_dataset_line_is_named_by_file_and_line(capsys, in_tmp, content, line, words):
    data = damaged(in_tmp, "train.jsonl", content)
    message = refusal(capsys, ["train", "--dataset", str(data)])
    assert message.startswith(f"Dataset file {data} line {line} {words}")
    assert message.endswith('write one {"text": ...} object per line (c4 style), UTF-8.')
    assert data.read_bytes() == content  # input is never modified
    assert os.listdir(in_tmp) == ["data"]  # no run folder: refused before anything was written


@pytest.mark.parametrize(("content", "line", "words"), BAD_LINES, ids=BAD_LINE_IDS)
def test_preflight_names_a_bad_dataset_line_as_train_does(capsys, in_tmp, content, line, words):
    from qwentitan.launch.launcher.plan import resolve_plan
    from qwentitan.launch.launcher.preflight.dataset import check_dataset
    from qwentitan.launch.launcher.request import RunRequest

    data = damaged(in_tmp, "train.jsonl", content)
    said_by_train = refusal(capsys, ["train", "--dataset", str(data)])
    result = check_dataset(resolve_plan(RunRequest(recipe="tiny_dense", dataset=str(data))))
    assert result.status == "fail" and result.detail + "." == said_by_train
    assert result.detail.startswith(f"Dataset file {data} line {line} {words}")
    assert data.read_bytes() == content


@pytest.mark.parametrize(("content", "line", "words"), BAD_LINES, ids=BAD_LINE_IDS)
def test_run_plan_checks_the_plans_dataset_before_any_rank(
    capsys, in_tmp, monkeypatch, content, line, words
):
    from qwentitan.launch.launcher import supervisor
    from qwentitan.launch.launcher.plan import resolve_plan
    from qwentitan.launch.launcher.plan_file import save_plan
    from qwentitan.launch.launcher.request import RunRequest

    data = damaged(in_tmp, "train.jsonl", content)
    request = RunRequest(recipe="tiny_dense", dataset=str(data), run_dir=str(in_tmp / "run"))
    path = save_plan(resolve_plan(request), in_tmp / "job.plan.json")
    monkeypatch.setattr(supervisor, "supervise", lambda *a, **k: pytest.fail("a rank started"))
    message = refusal(capsys, ["run", "--plan", str(path)])
    assert message.startswith(f"Dataset file {data} line {line} {words}")
    assert data.read_bytes() == content and sorted(os.listdir(in_tmp)) == ["data", "job.plan.json"]


def test_every_file_of_a_dataset_folder_is_checked(capsys, in_tmp):
    damaged(in_tmp, "a.jsonl", GOOD.encode() * 3)
    bad = damaged(in_tmp, "b.jsonl.gz", gzip.compress((GOOD + "{oops\n").encode()))
    message = refusal(capsys, ["train", "--dataset", str(in_tmp / "data")])
    assert message.startswith(f"Dataset file {bad} line 2 is not JSON")


def test_an_empty_or_unreadable_dataset_file(capsys, in_tmp):
    empty = damaged(in_tmp, "empty.jsonl", b"\n\n")
    assert refusal(capsys, ["train", "--dataset", str(empty)]).startswith(
        f"Dataset file {empty} holds no documents;"
    )
    truncated = damaged(in_tmp, "cut.jsonl.gz", gzip.compress(GOOD.encode() * 100)[:-12])
    assert refusal(capsys, ["train", "--dataset", str(truncated)]).startswith(
        f"Dataset file {truncated} cannot be read ("
    )


def test_dataset_files_that_are_not_files_are_refused_not_read(capsys, in_tmp, no_hang):
    damaged(in_tmp, "a.jsonl", GOOD.encode() * 3)
    fifo = in_tmp / "data" / "b.jsonl"
    os.mkfifo(fifo)
    message = refusal(capsys, ["train", "--dataset", str(in_tmp / "data")])
    assert message.startswith(f"Dataset file {fifo} is a FIFO (named pipe), not a regular file;")
    assert refusal(capsys, ["train", "--dataset", str(fifo)]).startswith(
        f"Dataset file {fifo} is a FIFO (named pipe), not a regular file;"
    )
    fifo.unlink()
    endless = in_tmp / "data" / "c.jsonl"
    endless.symlink_to("/dev/zero")
    assert refusal(capsys, ["train", "--dataset", str(in_tmp / "data")]).startswith(
        f"Dataset file {endless} is a character device, not a regular file;"
    )
    # Swapped in after the folder was listed: the reader refuses it too, without blocking.
    endless.unlink()
    os.mkfifo(endless)
    with pytest.raises(LaunchError, match=r"cannot be read \(a FIFO \(named pipe\), not a"):
        check_json_lines(endless)
    assert sorted(os.listdir(in_tmp)) == ["data"]


def test_a_line_longer_than_the_limit_is_refused_unread(capsys, in_tmp, monkeypatch):
    from qwentitan.launch.runtime.data import check

    monkeypatch.setattr(check, "MAX_LINE_BYTES", 4 << 20, raising=False)
    data = damaged(in_tmp, "long.jsonl", GOOD.encode() + b"x" * (5 << 20) + b"\n" + GOOD.encode())
    assert refusal(capsys, ["train", "--dataset", str(data)]).startswith(
        f"Dataset file {data} line 2 is longer than 4 MiB;"
    )


def test_a_good_dataset_passes_blank_lines_included(tmp_path):
    data = damaged(tmp_path, "ok.jsonl", (GOOD * 3 + "\n" + '{"text": "é 字"}').encode())
    assert check_json_lines(data) == 4
    packed = damaged(tmp_path, "ok.jsonl.gz", gzip.compress(GOOD.encode() * 5))
    assert check_json_lines(packed) == 5


def save_checkpoint(step_dir: Path, state: dict[str, torch.Tensor]) -> Path:
    """A DCP checkpoint as torchtitan lays it out (RUN/checkpoint/step-N), without training."""
    dcp.save(state, checkpoint_id=str(step_dir), no_dist=True)
    return step_dir


def snapshot(folder: Path) -> dict[str, int]:
    return {str(p.relative_to(folder)): p.stat().st_size for p in folder.rglob("*") if p.is_file()}


SMALL = {"w": torch.arange(1000, dtype=torch.float32), "b": torch.ones(10)}


def _missing_data(step: Path) -> str:
    (step / "__0_0.distcp").unlink()
    return f"{step / '__0_0.distcp'} is missing"


def _truncated_data(step: Path) -> str:
    data = step / "__0_0.distcp"
    size = data.stat().st_size
    os.truncate(data, size // 2)
    return f"{data} is truncated ({size // 2} of at least "


def _truncated_metadata(step: Path) -> str:
    metadata = step / ".metadata"
    os.truncate(metadata, metadata.stat().st_size // 2)
    return f"{metadata} is truncated or damaged ("


class _Payload:
    """A pickle whose loading would create a marker file: what a hostile `.metadata` holds."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


def _pickled_code(step: Path) -> str:
    marker = step.parent.parent.parent / "ran"
    (step / ".metadata").write_bytes(pickle.dumps(_Payload(marker)))
    return f"{step / '.metadata'} is not a checkpoint's metadata (posix.system is not allowed "


@pytest.mark.parametrize(
    "damage", [_missing_data, _truncated_data, _truncated_metadata, _pickled_code]
)
def test_a_damaged_checkpoint_is_named_before_resuming(capsys, in_tmp, damage):
    step = save_checkpoint(in_tmp / "run" / "checkpoint" / "step-2", SMALL)
    what = damage(step)
    before = snapshot(in_tmp)
    argv = ["train", "--resume", "--run-dir", str(in_tmp / "run"), "--steps", "5"]
    message = refusal(capsys, argv)
    assert message.startswith(f"The checkpoint to resume is damaged: {what}")
    assert message.endswith("; pass another --run-dir to start fresh.")
    assert snapshot(in_tmp) == before  # nothing removed, nothing written, no code run
    assert not (in_tmp / "ran").exists()


def test_another_recipes_checkpoint_is_named(capsys, in_tmp):
    moe = meta_model(get_recipe("tiny_moe")())
    state = {k: torch.zeros(v.shape, dtype=torch.bfloat16) for k, v in moe.state_dict().items()}
    step = save_checkpoint(in_tmp / "run" / "checkpoint" / "step-3", state)
    before = snapshot(in_tmp)
    argv = ["train", "--recipe", "tiny_dense", "--resume", "--run-dir", str(in_tmp / "run")]
    message = refusal(capsys, [*argv, "--steps", "5"])
    assert message == (
        f"{step} holds no tensor layers.0.feed_forward.w1.weight, so it is another model's "
        "checkpoint; pass the --run-dir of a tiny_dense run, or another --run-dir to start fresh."
    )
    assert snapshot(in_tmp) == before


def test_a_damaged_latest_checkpoint_points_at_the_newest_good_one(tmp_path):
    folder = tmp_path / "checkpoint"
    model = {name: tuple(t.shape) for name, t in SMALL.items()}
    save_checkpoint(folder / "step-2", SMALL)
    save_checkpoint(folder / "step-4", SMALL)
    save_checkpoint(folder / "step-6", SMALL)
    assert check_resumable(folder, model, "tiny_dense") == 6
    _missing_data(folder / "step-6")
    _truncated_data(folder / "step-4")
    with pytest.raises(LaunchError) as info:
        check_resumable(folder, model, "tiny_dense")
    assert str(info.value).endswith(f"; move step-6 out of {folder} to resume from step-2.")
    # The advice works: what torchtitan would then resume is step-2, whole.
    (folder / "step-6").rename(tmp_path / "step-6")
    with pytest.raises(LaunchError, match=r"step-4/__0_0\.distcp is truncated"):
        check_resumable(folder, model, "tiny_dense")
    (folder / "step-4").rename(tmp_path / "step-4")
    assert check_resumable(folder, model, "tiny_dense") == 2
    with pytest.raises(LaunchError, match=r"holds w as \[1000\], not \[999\]"):
        check_resumable(folder, {"w": (999,)}, "tiny_dense")


def test_run_refuses_a_damaged_checkpoint_it_would_resume(capsys, in_tmp, monkeypatch):
    from qwentitan.launch.launcher import supervisor

    def never(*_):
        raise AssertionError("torchrun was started")

    monkeypatch.setattr(supervisor, "supervise", never)
    step = save_checkpoint(in_tmp / "out" / "checkpoint" / "step-1", SMALL)
    what = _truncated_metadata(step)
    before = snapshot(in_tmp)
    argv = ["run", "--recipe", "tiny_dense", "--instance", "cpu", "--ranks-per-node", "1"]
    message = refusal(capsys, [*argv, "--dump-folder", str(in_tmp / "out")])
    assert message.startswith(f"The checkpoint to resume is damaged: {what}")
    assert message.endswith("; pass another --dump-folder to start fresh.")
    assert snapshot(in_tmp) == before


@pytest.mark.parametrize(
    ("flag", "value", "said"),
    [
        (
            "--partition",
            "p\nsrun touch /tmp/owned",
            "--partition 'p\\nsrun touch /tmp/owned' is not",
        ),
        ("--time", "abc; rm -rf /", "--time 'abc; rm -rf /' is not a SLURM time"),
        ("--dump-folder", "out\nrm -rf /", "A value of --dump-folder and the overrides holds"),
    ],
)
def test_a_value_the_script_cannot_carry_is_refused_and_nothing_written(
    capsys, in_tmp, flag, value, said
):
    argv = ["slurm", "--recipe", "tiny_dense", "--nodes", "2", "-o", "job.sbatch", flag, value]
    assert refusal(capsys, argv).startswith(said)
    assert os.listdir(in_tmp) == []


def test_slurm_output_that_is_a_folder_is_one_sentence_and_leaves_nothing(capsys, in_tmp):
    folder = in_tmp / "scripts"
    folder.mkdir()
    argv = ["slurm", "--recipe", "tiny_dense", "--nodes", "2", "-o", str(folder)]
    assert refusal(capsys, argv) == (
        f"{folder} is a folder; pass -o with a file name for the sbatch script."
    )
    assert os.listdir(in_tmp) == ["scripts"] and os.listdir(folder) == []


@pytest.mark.parametrize("endpoint", ["not a host:port", "node-1:99999", "host:port", "a;b:1"])
def test_a_rendezvous_endpoint_torchrun_cannot_take_is_one_sentence(capsys, in_tmp, endpoint):
    argv = ["run", "--recipe", "tiny_dense", "--rdzv-endpoint", endpoint, "--dry-run"]
    assert refusal(capsys, argv) == (
        f"--rdzv-endpoint {endpoint!r} is not HOST:PORT; pass the first node's host name or "
        "address and a free port, e.g. node-1:29500."
    )
    assert os.listdir(in_tmp) == []


def test_a_checkpoint_with_per_rank_data_positions_is_one_sentence(capsys, in_tmp):
    saved_by_two = {**SMALL, "dataloader": {"dp_rank_0": 0, "dp_rank_1": 1}}
    step = save_checkpoint(in_tmp / "run" / "checkpoint" / "step-2", saved_by_two)
    argv = ["train", "--resume", "--ranks", "2", "--run-dir", str(in_tmp / "run"), "--steps", "5"]
    assert refusal(capsys, argv) == (
        f"{step} holds one data position per data-parallel rank (2), as qwentitan saved them "
        "before it kept one for all ranks, and this loader cannot read them; pass another "
        "--run-dir to start fresh."
    )


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")  # one process, on purpose
def test_the_ranks_load_only_a_checked_metadata(in_tmp, caplog):
    """torchtitan's own load in the ranks goes through the same allow-list first."""
    from torchtitan.components.checkpoint import MODEL

    from .conftest import guarded_manager

    manager = guarded_manager(in_tmp, {name: torch.zeros_like(t) for name, t in SMALL.items()})
    model = manager.states[MODEL]
    good = save_checkpoint(in_tmp / "good", SMALL)
    manager.dcp_load(model.state_dict(), str(good), False, False)
    assert torch.equal(model.state_dict()["w"], SMALL["w"])
    bad = save_checkpoint(in_tmp / "run" / "checkpoint" / "step-1", {"w": SMALL["w"] + 1})
    _pickled_code(bad)
    with pytest.raises(SystemExit) as ended:
        manager.dcp_load(model.state_dict(), str(bad), False, False)
    manager.close()
    assert ended.value.code == 2 and torch.equal(model.state_dict()["w"], SMALL["w"])
    assert not (in_tmp / "ran").exists()
    said = [r.getMessage() for r in caplog.records if r.levelno >= logging.ERROR]
    assert len(said) == 1 and "posix.system is not allowed" in said[0]
    caplog.clear()  # the rank's one sentence, expected here


@pytest.fixture(scope="module")
def plan_record(tmp_path_factory) -> dict:
    """A good plan file's record, as `slurm` writes it (tiny_dense on this host)."""
    import json

    from qwentitan.launch.launcher.plan import resolve_plan
    from qwentitan.launch.launcher.plan_file import save_plan
    from qwentitan.launch.launcher.request import RunRequest

    path = save_plan(
        resolve_plan(RunRequest(recipe="tiny_dense", steps=3)),
        tmp_path_factory.mktemp("plan") / "job.plan.json",
    )
    return json.loads(path.read_text())


def _changed(field: str, value: object):
    return lambda record: record.__setitem__(field, value)


def _env(name: str, value: object = "1"):
    return lambda record: record["env"].__setitem__(name, value)


# Each damages a good plan file one way; `said` is the start of the refusal after the path.
PLAN_FILE_FAULTS = {
    "PYTHONPATH in env": (_env("PYTHONPATH", "/tmp/x"), "'env' holds \"PYTHONPATH\", which a plan"),
    "LD_PRELOAD in env": (_env("LD_PRELOAD", "/tmp/x.so"), "'env' holds \"LD_PRELOAD\", which"),
    "PYTHONSTARTUP in env": (_env("PYTHONSTARTUP", "/tmp/s.py"), "'env' holds \"PYTHONSTARTUP\""),
    "BASH_ENV in env": (_env("BASH_ENV", "/tmp/s.sh"), "'env' holds \"BASH_ENV\", which a plan"),
    "env key with =": (_env("NEURON_A=B"), "'env' holds \"NEURON_A=B\", which is not a variable"),
    "env key with NUL": (_env("NEURON_\0X"), "'env' holds \"NEURON_\\u0000X\", which is not a"),
    "lower-case env key": (_env("neuron_x"), "'env' holds \"neuron_x\", which is not a variable"),
    "multi-line env value": (_env("NEURON_X", "a\nb"), "'env' holds \"NEURON_X\", whose value"),
    "env value a number": (_env("NEURON_X", 7), "'env' holds \"NEURON_X\", whose value 7 is not"),
    "env a string": (
        _changed("env", "PYTHONPATH=/tmp"),
        "'env' \"PYTHONPATH=/tmp\" is not a table",
    ),
    "--module override": (
        _changed("overrides", ["--module", "marker_module"]),
        "'overrides' holds --modu",
    ),
    "--module= override": (
        _changed("overrides", ["--module=marker_module"]),
        "'overrides' holds --modul",
    ),
    "--config override": (_changed("overrides", ["--config", "x"]), "'overrides' holds --config"),
    "--job override": (_changed("overrides", ["--job.config-file", "a"]), "'overrides' holds --j"),
    # torchtitan's Trainer imports the module each `override.imports` target names
    "--override.imports": (
        _changed("overrides", ["--override.imports", "marker_module.f"]),
        "'overrides' holds --override.imports (torchtitan would import the module it names",
    ),
    "--override.imports=": (
        _changed("overrides", ["--training.steps", "3", "--override.imports=marker_module.f"]),
        "'overrides' holds --override.imports (torchtitan would import",
    ),
    "string overrides": (
        _changed("overrides", "--training.steps 3"),
        "'overrides' \"--training.steps 3\" is not a",
    ),
    "integer overrides": (_changed("overrides", [3]), "'overrides' holds 3, which is not an over"),
    "no overrides": (lambda record: record.pop("overrides"), "has no 'overrides' field"),
    "nodes a word": (_changed("nodes", "two"), "'nodes' \"two\" is not a whole number"),
    "nodes 0": (_changed("nodes", 0), "'nodes' 0 is below 1"),
    "nodes -3": (_changed("nodes", -3), "'nodes' -3 is below 1"),
    "nodes true": (_changed("nodes", True), "'nodes' true is not a whole number"),
    "nodes 1.5": (_changed("nodes", 1.5), "'nodes' 1.5 is not a whole number"),
    "ranks_per_node a string": (_changed("ranks_per_node", "4"), "'ranks_per_node' \"4\" is not"),
    "max_restarts -1": (_changed("max_restarts", -1), "'max_restarts' -1 is below 0"),
    "max_restarts a word": (_changed("max_restarts", "three"), "'max_restarts' \"three\" is not"),
    "resume rm -rf": (_changed("resume", "rm -rf"), "'resume' \"rm -rf\" is not one of fresh"),
    "lnc null": (_changed("lnc", None), "'lnc' null is not one of 1, 2"),
    "lnc 3": (_changed("lnc", 3), "'lnc' 3 is not one of 1, 2"),
    "instance unknown": (_changed("instance", "z9.huge"), "'instance' \"z9.huge\" is not"),
    "recipe a path": (_changed("recipe", "../x"), "'recipe' \"../x\" is no recipe name"),
}


@pytest.mark.parametrize("damage", PLAN_FILE_FAULTS.values(), ids=list(PLAN_FILE_FAULTS))
def test_a_plan_file_is_checked_against_its_schema_before_use(
    capsys, in_tmp, plan_record, monkeypatch, damage
):
    import copy
    import json
    import sys

    # a module that leaves a mark if anything imports it (a `--module` override would)
    (in_tmp / "marker_module.py").write_text("open(__file__ + '.imported', 'w').close()\n")
    monkeypatch.syspath_prepend(str(in_tmp))
    record = copy.deepcopy(plan_record)
    change, said = damage
    change(record)
    path = in_tmp / "job.plan.json"
    path.write_text(json.dumps(record))
    before = path.read_bytes()
    line = refusal(capsys, ["run", "--plan", str(path), "--dry-run"])
    assert line.startswith(f"The plan file {path} "), line
    assert said in line and line.endswith("; write it again with `slurm`."), line
    assert "marker_module" not in sys.modules and not list(in_tmp.glob("*.imported"))
    assert path.read_bytes() == before and sorted(os.listdir(in_tmp)) == [
        "job.plan.json",
        "marker_module.py",
    ]


def test_a_good_plan_file_runs_dry(capsys, in_tmp, plan_record):
    import json

    path = in_tmp / "job.plan.json"
    path.write_text(json.dumps(plan_record))
    assert cli.main(["run", "--plan", str(path), "--dry-run"]) == 0
    assert "tiny_dense" in capsys.readouterr().out


@pytest.mark.parametrize("word", ["--module", "--module=os", "--config=tiny_moe", "--job.dump"])
def test_an_override_naming_the_module_or_config_is_refused(capsys, in_tmp, word):
    line = refusal(capsys, ["plan", "--recipe", "tiny_dense", "--", word, "x"])
    assert line == (
        f"The override {word} is refused: the recipe alone chooses torchtitan's module and "
        "config; pass --recipe NAME instead."
    )


@pytest.mark.parametrize("word", ["--override.imports", "--override.imports=marker_module.f"])
@pytest.mark.parametrize("command", ["plan", "train", "slurm"])
def test_an_override_that_imports_code_is_refused(capsys, in_tmp, monkeypatch, command, word):
    """torchtitan's Trainer imports each `override.imports` target's module: refused, on every
    command's passthrough, before anything imports it."""
    import sys

    (in_tmp / "marker_module.py").write_text("open(__file__ + '.imported', 'w').close()\n")
    monkeypatch.syspath_prepend(str(in_tmp))
    line = refusal(capsys, [command, "--recipe", "tiny_dense", "--", word, "marker_module.f"])
    assert line == (
        f"The override {word} is refused: torchtitan would import the module it names, and a "
        "run imports no code by name; drop it."
    )
    assert "marker_module" not in sys.modules and not list(in_tmp.glob("*.imported"))
    assert sorted(os.listdir(in_tmp)) == ["marker_module.py"]


@pytest.mark.parametrize("sig", ["SIGTERM", "SIGHUP"])
@pytest.mark.parametrize("command", ["train", "run"])
def test_a_signal_while_the_launcher_checks_is_one_line(capsys, in_tmp, monkeypatch, command, sig):
    """Before any rank runs: the launcher's own start-up (plan, checks) ends in one line, exit
    128 + the signal, and the next signal is the shell's own again."""
    import time

    from qwentitan.launch.launcher import start, supervisor

    def signalled(*_args, **_kwargs):
        os.kill(os.getpid(), getattr(signal, sig))
        time.sleep(5)
        pytest.fail("the signal did not stop the command")

    monkeypatch.setattr(start.run_folder, "check_free_disk", signalled)
    monkeypatch.setattr(supervisor, "supervise", lambda *a, **k: pytest.fail("a rank started"))
    before = signal.getsignal(signal.SIGTERM)
    argv = [command, "--recipe", "tiny_dense", "--steps", "2", "--run-dir", str(in_tmp / "run")]
    assert cli.main(argv) == 128 + getattr(signal, sig)
    said = capsys.readouterr().err
    assert said == f"qwentitan-launch {command}: stopped by {sig}; run it again.\n"
    assert signal.getsignal(signal.SIGTERM) == before


@pytest.mark.parametrize(
    ("instance", "named"),
    [([], ["tiny_dense", "qwen3_4b_hf"]), (["--instance", "trn2.48xlarge"], ["qwen3_4b_hf"])],
)
def test_a_run_without_a_recipe_lists_the_names(capsys, in_tmp, instance, named):
    """`nox -s train_trn2 -- --dry-run` without --recipe: the refusal lists what to pass (the
    instance's recipes when one is named)."""
    line = refusal(capsys, ["run", "--dry-run", *instance])
    assert line.startswith("Name the run: pass --recipe NAME (or --plan FILE); NAME is one of ")
    for name in named:
        assert name in line
    assert ("tiny_dense" in line) == (not instance)


def test_slurm_keeps_an_existing_script_and_plan_file_unless_told(capsys, in_tmp):
    """Issue 56: a queued job may run the script and its plan file; `-o` over them is refused
    until --overwrite, and each is left as it was."""
    argv = ["slurm", "--recipe", "tiny_dense", "--nodes", "2", "-o", "job.sbatch"]
    for existing in ("job.sbatch", "job.plan.json"):
        (in_tmp / existing).write_text("queued\n")
        assert refusal(capsys, argv) == (
            f"{(in_tmp / existing) if existing.endswith('json') else existing} already exists (a "
            "queued job may run it); pass --overwrite to replace the script and its plan file, "
            "or -o another path."
        )
        assert (in_tmp / existing).read_text() == "queued\n"
        (in_tmp / existing).unlink()
    (in_tmp / "job.sbatch").write_text("queued\n")
    assert cli.main([*argv, "--overwrite"]) == 0
    assert "srun" in (in_tmp / "job.sbatch").read_text()
