"""Run folders on S3 (`--run-dir s3://bucket/prefix`) against a loopback S3: moto's server on
127.0.0.1, reached through `$AWS_ENDPOINT_URL` as any AWS SDK reaches it. Checkpoints are
written to the bucket, `--resume` continues from it, and its `.metadata` is read by the
allow-list reader before any rank loads it."""

from __future__ import annotations

import pickle
import re
import socket

import pytest

from qwentitan.launch.base.errors import LaunchError
from qwentitan.launch.launcher import remote
from qwentitan.launch.launcher.request import RunRequest

BUCKET = "qwentitan-test"
_TINY = ["--ranks", "1", "--seq-len", "32", "--local-batch-size", "1", "--validate-every", "1000"]
_STEP = re.compile(r"\bstep:\s+(\d+)\s+loss")
_ANSI = re.compile(r"\x1b\[[0-9;]*m")


@pytest.fixture(scope="module")
def s3():
    """A moto S3 server on a free loopback port with BUCKET made, and the AWS environment
    (endpoint, dummy credentials) that points every SDK of this process and its ranks at it."""
    from moto.server import ThreadedMotoServer

    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=port, verbose=False)
    server.start()
    try:
        with pytest.MonkeyPatch.context() as patch:
            patch.setenv("AWS_ENDPOINT_URL", f"http://127.0.0.1:{port}")
            patch.setenv("AWS_ACCESS_KEY_ID", "testing")
            patch.setenv("AWS_SECRET_ACCESS_KEY", "testing")
            patch.setenv("AWS_DEFAULT_REGION", "us-east-1")
            import boto3

            boto3.client("s3").create_bucket(Bucket=BUCKET)
            import fsspec

            yield fsspec.filesystem("s3", skip_instance_cache=True)
    finally:
        server.stop()


def test_an_s3_run_dir_keeps_checkpoints_there_and_the_rest_in_a_local_folder():
    request = RunRequest(recipe="tiny_dense", run_dir="s3://bucket/runs/a b")
    words = request.trainer_overrides()
    assert words[words.index("--checkpoint.folder") + 1] == "s3://bucket/runs/a b/checkpoint"
    local = words[words.index("--dump-folder") + 1]
    assert local == str(remote.local_folder("s3://bucket/runs/a b"))
    assert local.endswith("outputs/s3/bucket/runs/a_b")


def test_a_missing_s3_backend_is_one_sentence_naming_the_extra(monkeypatch):
    import fsspec

    def missing(scheme):
        raise ImportError("Install s3fs to access S3")

    monkeypatch.setattr(fsspec, "get_filesystem_class", missing)
    with pytest.raises(LaunchError) as error:
        remote.require_backend("s3://bucket/run")
    assert "needs the Python package s3fs (install qwentitan-launch[s3])" in str(error.value)


@pytest.mark.slow
def test_train_on_s3_then_resume_from_it(s3, train_in_process, tmp_path, monkeypatch, capsys):
    """The issue's must-show: `--steps 2` into the bucket, then `--steps 4 --resume` continues
    at step 3 from it; the bucket holds step-2 and step-4."""
    monkeypatch.chdir(tmp_path)  # the local folder of the run: outputs/s3/BUCKET/run
    run_dir = f"s3://{BUCKET}/run"
    code, first = train_in_process(
        [*_TINY, "--steps", "2", "--run-dir", run_dir], tmp_path / "1.log"
    )
    assert code == 0, first[-3000:]
    assert "no free-space check for s3://" in capsys.readouterr().out  # the launcher's own
    code, second = train_in_process(
        [*_TINY, "--steps", "4", "--run-dir", run_dir, "--resume"], tmp_path / "2.log"
    )
    assert code == 0, second[-3000:]
    assert "Training starts at step 3" in second
    assert [int(s) for s in _STEP.findall(_ANSI.sub("", second))] == [3, 4]
    listed = sorted(p.rsplit("/", 1)[-1] for p in s3.ls(f"{BUCKET}/run/checkpoint"))
    assert listed == ["step-2", "step-4"]
    assert s3.isfile(f"{BUCKET}/run/checkpoint/step-4/.metadata")
    # Logs and reports stay local, in the run's local folder.
    assert (tmp_path / "outputs" / "s3" / BUCKET / "run" / "reports" / "summary.json").is_file()

    from qwentitan.checkpoint import safe_reader_for

    metadata = safe_reader_for(f"{run_dir}/checkpoint/step-4").read_metadata()
    assert "tok_embeddings.weight" in metadata.state_dict_metadata


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
