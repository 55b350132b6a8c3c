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
    assert local.endswith("outputs/s3/bucket/runs/a_b")


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
