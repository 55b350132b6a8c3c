"""`qwentitan-launch train`: the local preset of the launch plan, refusing bad input in one
sentence (exit code 2) before starting ranks, never deleting an earlier run's checkpoints."""

import json
import os
import re
import sys

import pytest

from qwentitan.launch.base.target import cpu_cores
from qwentitan.launch.launcher import cli


def refused(capsys, *argv):
    assert cli.main(["train", *argv]) == 2
    out, err = capsys.readouterr()
    assert "Traceback" not in out + err
    message = err.strip()
    assert message.startswith("qwentitan-launch train: ") and "\n" not in message
    return message.removeprefix("qwentitan-launch train: ")


def test_unknown_recipe(capsys):
    message = refused(capsys, "--recipe", "tiny_gpt")
    assert (
        message == "Unknown recipe 'tiny_gpt'; choose one of qwen3_30b_a3b_tp4_fsdp16, "
        "qwen3_4b_hf, qwen3_4b_native, qwen3_8b_tp4_fsdp16_sac, qwen3_moe_kernels, tiny_dense, "
        "tiny_dense_untied, tiny_hf, tiny_moe, tiny_moe_kernels, tiny_tp2_fsdp2_sac."
    )


@pytest.mark.parametrize(
    ("typed", "hint"),
    [
        (["--training.steps", "5"], "use --steps (or torchtitan's options go after `--`, as "
         "`-- --training.steps VALUE`)."),
        (["--model.flavor", "x"], "torchtitan's options go after `--`, as "
         "`-- --model.flavor VALUE`."),
    ],
)  # fmt: skip
def test_a_torchtitan_option_where_a_flag_goes_gets_a_hint(capsys, typed, hint):
    with pytest.raises(SystemExit) as exited:
        cli.main(["train", *typed])
    assert exited.value.code == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("qwentitan-launch: unrecognized arguments: ") and err.endswith(hint)


def test_missing_dataset_path(capsys, tmp_path):
    missing = tmp_path / "nowhere" / "train.jsonl"
    message = refused(capsys, "--dataset", str(missing), "--run-dir", str(tmp_path))
    assert message.startswith(f"Dataset path {missing} does not exist;")


def test_sequence_length_the_model_cannot_take(capsys, tmp_path):
    message = refused(capsys, "--seq-len", "1000000", "--run-dir", str(tmp_path))
    assert "--seq-len 1000000 is longer than the model's" in message


def test_more_ranks_than_cores_train_after_a_one_line_note(capsys, launched, tmp_path):
    crowded = cpu_cores() + 1
    assert cli.main(["train", "--ranks", str(crowded), "--run-dir", str(tmp_path / "run")]) == 0
    out = capsys.readouterr().out
    note = f"qwentitan-launch train: note: {crowded} ranks share this host's {cpu_cores()} CPU"
    assert out.startswith(note) and launched
    assert f"--nproc-per-node={crowded}" in launched[0][0]


def test_resume_without_a_checkpoint(capsys, tmp_path):
    message = refused(capsys, "--resume", "--run-dir", str(tmp_path))
    assert message.startswith("There is no checkpoint to resume in ")


@pytest.fixture
def launched(monkeypatch):
    """What `train` / `run` would execute: supervise() records its argv and env instead."""
    from qwentitan.launch.launcher import supervisor

    calls = []
    monkeypatch.setattr(
        supervisor, "supervise", lambda argv, env, **_: calls.append((argv, env)) or 0
    )
    return calls


def test_plan_json_shows_the_torchrun_line_train_runs(capsys, launched, tmp_path):
    run_dir = tmp_path.resolve() / "run"
    assert cli.main(["train", "--run-dir", str(run_dir)]) == 0
    assert cli.main(["run", "--recipe", "tiny_dense", "--dump-folder", str(run_dir)]) == 0
    (train_argv, train_env), (run_argv, run_env) = launched
    capsys.readouterr()
    assert (
        cli.main(["plan", "--recipe", "tiny_dense", "--dump-folder", str(run_dir), "--json"]) == 0
    )
    planned = json.loads(capsys.readouterr().out)["torchrun"]
    assert train_argv[:3] == [sys.executable, "-m", "qwentitan.launch.launcher.agent"]
    assert train_argv[3:] == planned[1:] and planned[0] == "torchrun"
    assert "--rdzv-backend=c10d" in planned and f"--dump-folder {run_dir}" in " ".join(planned)
    # One pipeline: `run` launches the same line with the same rank environment.
    assert run_argv == train_argv and run_env == train_env


def test_fresh_runs_get_their_own_folders_and_resume_continues_the_latest(
    capsys, launched, tmp_path, monkeypatch
):
    monkeypatch.chdir(tmp_path)
    assert cli.main(["train"]) == 0
    first = (tmp_path / "outputs" / "tiny_dense" / "latest").resolve()
    (first / "checkpoint" / "step-40").mkdir(parents=True)  # stands for the first run's save
    assert cli.main(["train"]) == 0
    second = (tmp_path / "outputs" / "tiny_dense" / "latest").resolve()
    assert second != first and second.parent == first.parent
    assert (first / "checkpoint" / "step-40").is_dir()  # nothing of the first run was removed
    dump_folders = [argv[argv.index("--dump-folder") + 1] for argv, _ in launched]
    assert dump_folders == [str(first), str(second)]


def test_resume_without_an_earlier_run(capsys, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    message = refused(capsys, "--resume")
    assert message == (
        f"There is no run of tiny_dense with a checkpoint to resume in {tmp_path.resolve()}/"
        "outputs/tiny_dense; run once without --resume first, or pass the --run-dir of an "
        "earlier run."
    )


def test_resume_finds_the_newest_run_that_saved_a_checkpoint(tmp_path):
    """`latest` names the newest start; --resume continues the newest that holds a checkpoint,
    not a newer start stopped before its first save."""
    from qwentitan.launch.launcher.run_folder import point_latest, resumable_run_folder

    base = tmp_path / "outputs" / "tiny_dense"
    assert resumable_run_folder(base) is None
    for name in ("20261206-224537", "20261206-231404", "20261206-231404-2", "20261206-232617"):
        point_latest(base / name)
    for name, step in (("20261206-231404", 40), ("20261206-231404-2", 20)):
        (base / name / "checkpoint" / f"step-{step}").mkdir(parents=True)
        (base / name / "checkpoint" / f"step-{step}" / ".metadata").write_bytes(b"")
    assert (base / "latest").resolve().name == "20261206-232617"  # stopped before any save
    assert resumable_run_folder(base) == (base / "20261206-231404-2").resolve()


def test_run_dir_holding_checkpoints_is_refused_without_resume(capsys, launched, tmp_path):
    step = tmp_path / "checkpoint" / "step-3"
    step.mkdir(parents=True)
    (step / ".metadata").write_bytes(b"kept as it is")
    message = refused(capsys, "--run-dir", str(tmp_path))
    assert message == (
        f"{tmp_path / 'checkpoint'} already holds checkpoints (newest step-3); pass --resume to "
        "continue them, or another --run-dir to start a fresh run."
    )
    assert (step / ".metadata").read_bytes() == b"kept as it is" and not launched


def test_too_little_disk_for_the_planned_checkpoints_is_refused(
    capsys, launched, tmp_path, small_tmpfs
):
    with small_tmpfs(tmp_path / "small", "8m") as small:
        message = refused(capsys, "--run-dir", str(small / "run"))
        assert re.fullmatch(
            rf"{small} has 8\.39 MB free but this needs about [0-9.]+ MB; "
            r"free space there or pass another --run-dir\.",
            message,
        ), message
        assert not launched and not (small / "run").exists()


def test_ctrl_c_before_the_ranks_start_is_one_sentence_and_leaves_no_folder(
    capsys, launched, tmp_path, monkeypatch
):
    from qwentitan.launch.launcher import run_folder

    def interrupted(*_args, **_kwargs):
        raise KeyboardInterrupt

    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(run_folder, "check_free_disk", interrupted)
    assert refused(capsys) == "interrupted (Ctrl-C); run it again."
    assert not (tmp_path / "outputs" / "tiny_dense").exists() and not launched


def test_a_dataset_too_small_for_the_run_is_refused_before_any_rank(capsys, launched, tmp_path):
    data = tmp_path / "one.jsonl"
    data.write_text('{"text": "' + "a long single document " * 1000 + '"}\n')
    run_dir = tmp_path / "run"
    message = refused(capsys, "--ranks", "1", "--dataset", str(data), "--run-dir", str(run_dir))
    assert message.startswith(f"Dataset {data} holds 1 document(s) but this run needs at least 20")
    assert not launched and not run_dir.exists()
    # Without validation one document feeds one rank.
    argv = ["--ranks", "1", "--dataset", str(data), "--run-dir", str(run_dir)]
    assert cli.main(["train", *argv, "--", "--validator.no-enable"]) == 0 and launched


def test_a_second_run_into_a_busy_run_folder_is_refused_naming_the_first(
    capsys, launched, tmp_path
):
    from qwentitan.launch.launcher.run_folder import hold_run_folder

    run_dir = tmp_path.resolve() / "run"
    with hold_run_folder(run_dir):  # as the first run's launcher does
        for resume in ([], ["--resume"]):
            message = refused(capsys, "--run-dir", str(run_dir), *resume)
            assert re.fullmatch(
                rf"Run folder {run_dir} is in use by another run \(pid {os.getpid()}, started "
                r"[0-9-]+ [0-9:]+ UTC\); wait for it to end, or pass another --run-dir\.",
                message,
            ), message
    assert not launched
    assert cli.main(["train", "--run-dir", str(run_dir)]) == 0 and launched  # free again


def test_a_run_dir_that_is_a_file_or_read_only_is_one_sentence(capsys, launched, tmp_path):
    file = tmp_path / "file"
    file.write_text("not a folder")
    message = refused(capsys, "--run-dir", str(file))
    assert message == f"Run folder {file} is not a folder; pass another --run-dir."
    message = refused(capsys, "--run-dir", str(file / "run"))
    assert message.startswith(f"Run folder {file / 'run'} is inside {file}, which is not a folder")
    if os.geteuid() != 0:  # root writes into read-only folders
        locked = tmp_path / "locked"
        locked.mkdir(mode=0o555)
        message = refused(capsys, "--run-dir", str(locked / "run"))
        assert message.startswith(f"Run folder {locked / 'run'} cannot be written ({locked} is")
    assert not launched and file.read_text() == "not a folder"


def test_a_latest_link_that_loops_is_one_sentence(capsys, launched, tmp_path, monkeypatch):
    """--resume looks for the newest run that saved a checkpoint, not at `latest`: a `latest`
    that loops leaves the one sentence that there is none."""
    monkeypatch.chdir(tmp_path)
    latest = tmp_path / "outputs" / "tiny_dense" / "latest"
    latest.parent.mkdir(parents=True)
    latest.symlink_to("latest")
    message = refused(capsys, "--resume")
    assert message.startswith("There is no run of tiny_dense with a checkpoint to resume in ")
    assert not launched


def test_free_disk_counts_every_checkpoint_kept_at_once(capsys, launched, tmp_path, small_tmpfs):
    # 8 steps, a save every 2, two kept: three whole saves of about 150 MiB exist at once.
    with small_tmpfs(tmp_path / "disk", "420m") as disk:
        argv = ["--steps", "8", "--run-dir", str(disk / "run"), "--", "--checkpoint.interval", "2"]
        message = refused(capsys, *argv)
        assert message.startswith(f"{disk} has 440 MB free but this needs about 4"), message
        assert not launched


def test_a_corrupt_tokenizer_is_one_sentence(capsys, launched, tmp_path):
    folder = tmp_path / "tok"
    folder.mkdir()
    (folder / "tokenizer.json").write_text('{"model": {"type": "BPE", "vocab": ')
    message = refused(capsys, "--tokenizer", str(folder), "--run-dir", str(tmp_path / "run"))
    assert message.startswith(f"Tokenizer folder {folder} cannot be loaded (")
    assert not launched


def test_a_failed_run_s_summary_vouches_for_no_checkpoint(capsys, tmp_path, monkeypatch):
    """A rank that failed mid-save still leaves its summary; the block then names no checkpoint
    as written (the failed step's folder holds none)."""
    from qwentitan.launch.launcher import supervisor

    run_dir = tmp_path.resolve() / "run"

    def failed(argv, env, **_):
        (run_dir / "reports").mkdir(parents=True, exist_ok=True)
        report = {"first_step": 1, "last_step": 2, "first_loss": 2.0, "final_loss": 1.5}
        (run_dir / "reports" / "summary.json").write_text(json.dumps(report))
        return 2  # the rank's SAVE_FAILED_EXIT

    monkeypatch.setattr(supervisor, "supervise", failed)
    assert cli.main(["train", "--run-dir", str(run_dir), "--steps", "2"]) == 2
    rows = dict(
        line.strip().split("  ", 1)
        for line in capsys.readouterr().out.split("Summary\n")[1].splitlines()
    )
    assert rows["checkpoints"].strip() == (
        "not confirmed, the run failed (--resume takes the newest whole one in "
        f"{run_dir / 'checkpoint'})"
    )
