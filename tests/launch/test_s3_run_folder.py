"""Run folders on S3 (`--run-dir s3://bucket/prefix`) against a loopback S3: moto's server on
127.0.0.1, reached through `$AWS_ENDPOINT_URL` as any AWS SDK reaches it. Checkpoints are
written to the bucket, `--resume` continues from it, and its `.metadata` is read by the
allow-list reader before any rank loads it. A real training against the bucket (a resume from
it that saves there, reports kept local) is the one-rank resume of test_resume.py."""

from __future__ import annotations

import pickle

import pytest

from qwentitan.launch.base.errors import LaunchError
from qwentitan.launch.launcher import remote
from qwentitan.launch.launcher.request import RunRequest

from .conftest import BUCKET


def test_an_s3_run_dir_keeps_checkpoints_there_and_the_rest_in_a_local_folder():
    request = RunRequest(recipe="tiny_dense", run_dir="s3://bucket/runs/a b")
    words = request.trainer_overrides()
    assert words[words.index("--checkpoint.folder") + 1] == "s3://bucket/runs/a b/checkpoint"
    local = words[words.index("--dump-folder") + 1]
    assert local == str(remote.local_folder("s3://bucket/runs/a b"))
    assert "/outputs/s3/bucket/runs/a_b-" in local


def test_a_missing_s3_backend_is_one_sentence_naming_the_extra(monkeypatch):
    import fsspec

    def missing(scheme):
        raise ImportError("Install s3fs to access S3")

    monkeypatch.setattr(fsspec, "get_filesystem_class", missing)
    with pytest.raises(LaunchError) as error:
        remote.require_backend("s3://bucket/run")
    assert "needs the Python package s3fs (install qwentitan-launch[s3])" in str(error.value)


class _Payload:
    def __reduce__(self):
        import os

        return (os.system, ("echo ran",))


def test_a_remote_metadata_naming_code_is_refused_before_any_rank(s3):
    """The launcher's resume check reads the bucket's `.metadata` with the allow-list
    unpickler: one that names a function is refused in one sentence, never run."""
    from qwentitan.launch.launcher.resume import check_resumable

    with s3.open(f"{BUCKET}/evil/checkpoint/step-1/.metadata", "wb") as file:
        pickle.dump(_Payload(), file)
    folder = remote.RemotePath(f"s3://{BUCKET}/evil/checkpoint")
    with pytest.raises(LaunchError) as error:
        check_resumable(folder, {}, "tiny_dense")
    assert f"s3://{BUCKET}/evil/checkpoint/step-1/.metadata is not a checkpoint's metadata" in str(
        error.value
    )


# -- what a run folder may be, and one lock per remote folder on this host ---------------------


def _refusal(capsys, argv: list[str]) -> str:
    """Run the CLI: exit 2 and one line on stderr, which this returns without its prefix."""
    from qwentitan.launch.launcher import cli

    try:
        code = cli.main(argv)
    except SystemExit as exit_:
        code = exit_.code
    out, err = capsys.readouterr()
    assert code == 2 and "Traceback" not in out + err, out + err
    line = err.strip()
    assert "\n" not in line, err
    return line.removeprefix(f"qwentitan-launch {argv[0]}: ")


@pytest.mark.parametrize("url", ["memory://x/run", "file:///tmp/run", "http://h/run", "zip://a"])
@pytest.mark.parametrize("command", ["plan", "train"])
def test_a_run_folder_on_a_scheme_that_loses_checkpoints_is_refused(
    capsys, tmp_path, monkeypatch, command, url
):
    monkeypatch.chdir(tmp_path)
    line = _refusal(capsys, [command, "--recipe", "tiny_dense", "--run-dir", url])
    scheme = url.split("://")[0]
    assert line == (
        f"The run folder {url} is refused: a {scheme}:// folder would not keep the checkpoints; "
        "pass --run-dir as a local path or s3://BUCKET/PREFIX."
    )
    assert list(tmp_path.iterdir()) == []


def test_slurm_refuses_an_s3_run_folder_in_one_sentence(capsys, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    argv = ["slurm", "--recipe", "tiny_dense", "--nodes", "2", "--run-dir", "s3://b-1/run"]
    assert _refusal(capsys, argv) == (
        "slurm takes a local --run-dir on a file system every node shares (its requeue looks "
        "for the saved steps there); pass one, or train into S3 with `train` or `run`."
    )
    assert list(tmp_path.iterdir()) == []


def test_remote_run_folders_never_share_a_local_folder_or_leave_outputs(tmp_path):
    spaced, joined = (remote.local_folder(f"s3://bkt/runs/{n}", tmp_path) for n in ("a b", "a_b"))
    assert spaced != joined and spaced.parent == joined.parent == tmp_path / "s3/bkt/runs"
    # one address spelled two ways is one folder
    assert remote.local_folder("s3://bkt//runs/a b/", tmp_path) == spaced
    for url in ("s3://bkt/../../../../etc/cron.d", "s3://bkt/a/./b", "s3://../x", "s3:///x"):
        with pytest.raises(LaunchError, match=r"is refused: it needs an S3 bucket name"):
            remote.local_folder(url, tmp_path)
    assert not list(tmp_path.iterdir())


def test_one_remote_run_folder_has_one_lock_on_the_host_whatever_the_working_folder(
    tmp_path, monkeypatch
):
    from qwentitan.launch.launcher.run_folder import check_run_folder, hold_run_folder

    monkeypatch.setenv(remote.LOCK_DIR, str(tmp_path / "locks"))
    url = "s3://bkt/runs/a b/checkpoint"
    assert remote.lock_file(url) != remote.lock_file("s3://bkt/runs/a_b/checkpoint")
    assert remote.lock_file(url).parent == tmp_path / "locks"
    first, second = tmp_path / "one" / "run", tmp_path / "two" / "run"  # two working folders
    with hold_run_folder(first, url):
        with pytest.raises(LaunchError, match=r"^Run folder s3://bkt/runs/a b/checkpoint is in"):
            check_run_folder(second, url)
        busy = pytest.raises(LaunchError, match=r"in use by another run \(pid \d+, started")
        with busy, hold_run_folder(second, url):
            pass
        check_run_folder(second, "s3://bkt/runs/a_b/checkpoint")  # another folder: free
    with hold_run_folder(second, url):  # released with the first run
        pass


def test_a_bucket_that_does_not_exist_is_one_sentence_and_is_not_created(
    s3, capsys, tmp_path, monkeypatch
):
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv(remote.LOCK_DIR, str(tmp_path / "locks"))
    argv = ["train", "--recipe", "tiny_dense", "--steps", "1", "--run-dir", "s3://no-such-b/r"]
    assert _refusal(capsys, argv) == (
        "The S3 bucket no-such-b of s3://no-such-b/r/checkpoint does not exist; create it "
        "first, or pass a --run-dir in a bucket that does."
    )
    assert not s3.exists("no-such-b")


def test_no_aws_credentials_is_one_sentence_before_any_rank(s3, capsys, tmp_path, monkeypatch):
    from s3fs import S3FileSystem

    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv(remote.LOCK_DIR, str(tmp_path / "locks"))
    for name in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_PROFILE"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", str(tmp_path / "none"))
    monkeypatch.setenv("AWS_CONFIG_FILE", str(tmp_path / "none"))
    monkeypatch.setenv("AWS_EC2_METADATA_DISABLED", "true")
    S3FileSystem.clear_instance_cache()
    argv = ["train", "--recipe", "tiny_dense", "--steps", "1", "--run-dir", f"s3://{BUCKET}/c"]
    try:
        line = _refusal(capsys, argv)
    finally:
        S3FileSystem.clear_instance_cache()
    assert line == (
        f"No AWS credentials were found for s3://{BUCKET}/c/checkpoint; set AWS_ACCESS_KEY_ID "
        "and AWS_SECRET_ACCESS_KEY (or AWS_PROFILE), or run on an instance with a role."
    )


def test_an_s3_endpoint_that_never_answers_is_one_sentence_within_the_deadline(
    capsys, tmp_path, monkeypatch
):
    """A paused server (it accepts, then never answers): every request has a deadline."""
    import socket
    import time

    from s3fs import S3FileSystem

    from qwentitan.launch.base import s3 as s3_deadlines

    monkeypatch.setitem(s3_deadlines.CLIENT_CONFIG, "read_timeout", 1)
    monkeypatch.setattr(s3_deadlines, "DEADLINE_S", 15)
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "testing")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "testing")
    monkeypatch.setenv("AWS_DEFAULT_REGION", "us-east-1")
    with socket.socket() as silent:
        silent.bind(("127.0.0.1", 0))
        silent.listen(64)
        endpoint = f"http://127.0.0.1:{silent.getsockname()[1]}"
        monkeypatch.setenv("AWS_ENDPOINT_URL", endpoint)
        S3FileSystem.clear_instance_cache()
        started = time.monotonic()
        try:
            with pytest.raises(LaunchError) as error:
                remote.check_bucket("s3://bkt/run/checkpoint")
        finally:
            S3FileSystem.clear_instance_cache()
    assert time.monotonic() - started < 60
    assert str(error.value) == (
        f"S3 at {endpoint} did not answer within 15 s (ReadTimeoutError) for "
        "s3://bkt/run/checkpoint; check the endpoint and the network, then try again."
    )


def test_an_s3_endpoint_nobody_listens_on_is_said_at_once(monkeypatch):
    """A refused connection is not a wait: the sentence says the endpoint could not be reached."""
    import socket

    from s3fs import S3FileSystem

    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "testing")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "testing")
    monkeypatch.setenv("AWS_DEFAULT_REGION", "us-east-1")
    with socket.socket() as closed:  # bound, never listening: connections are refused
        closed.bind(("127.0.0.1", 0))
        endpoint = f"http://127.0.0.1:{closed.getsockname()[1]}"
        monkeypatch.setenv("AWS_ENDPOINT_URL", endpoint)
        S3FileSystem.clear_instance_cache()
        try:
            with pytest.raises(LaunchError) as error:
                remote.check_bucket("s3://bkt/run/checkpoint")
        finally:
            S3FileSystem.clear_instance_cache()
    assert str(error.value) == (
        f"S3 at {endpoint} could not be reached (EndpointConnectionError) for "
        "s3://bkt/run/checkpoint; check the endpoint and the network, then try again."
    )


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")  # one process, on purpose
def test_an_s3_server_dying_mid_save_is_one_sentence(tmp_path, monkeypatch, caplog):
    """The failed-save path says why in one line: no traceback, no wait on the dead server."""
    import logging
    import socket

    import boto3
    import torch
    from moto.server import ThreadedMotoServer
    from s3fs import S3FileSystem

    from qwentitan.launch.runtime.checkpointer import SAVE_FAILED_EXIT

    from .conftest import guarded_manager

    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=port, verbose=False)
    server.start()
    endpoint = f"http://127.0.0.1:{port}"
    for name, value in (
        ("AWS_ENDPOINT_URL", endpoint),
        ("AWS_ACCESS_KEY_ID", "testing"),
        ("AWS_SECRET_ACCESS_KEY", "testing"),
        ("AWS_DEFAULT_REGION", "us-east-1"),
    ):
        monkeypatch.setenv(name, value)  # fmt: skip
    S3FileSystem.clear_instance_cache()
    try:
        boto3.client("s3").create_bucket(Bucket="dying")
        manager = guarded_manager("s3://dying/run", {"w": torch.ones(1 << 16)})
        server.stop()  # the endpoint goes away before the save
        with caplog.at_level(logging.ERROR), pytest.raises(SystemExit) as stopped:
            manager.save(2, last_step=True)
        manager.close()
    finally:
        S3FileSystem.clear_instance_cache()
    assert stopped.value.code == SAVE_FAILED_EXIT
    said = [r.getMessage() for r in caplog.records if r.module == "checkpointer"]
    assert said == [
        f"Saving the checkpoint s3://dying/run/checkpoint/step-2 failed: S3 at {endpoint} could "
        "not be reached (EndpointConnectionError); its partial folder has no "
        ".metadata, so --resume continues from the previous checkpoint once the endpoint "
        "answers again."
    ]
