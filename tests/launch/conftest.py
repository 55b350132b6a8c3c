"""Fixtures of the launch tests."""

from __future__ import annotations

import contextlib
import subprocess
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest


@contextlib.contextmanager
def _mounted_tmpfs(folder: Path, size: str) -> Iterator[Path]:
    folder.mkdir()
    mounted = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(folder)], capture_output=True
    )
    if mounted.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {mounted.stderr.decode().strip()}")
    try:
        yield folder
    finally:
        subprocess.run(["umount", str(folder)], check=True)


@pytest.fixture
def small_tmpfs() -> Callable[[Path, str], contextlib.AbstractContextManager[Path]]:
    """`with small_tmpfs(folder, "8m") as disk:` a tmpfs of that size mounted on `folder` (a
    small full disk; you are root in CI), unmounted after; skips where mounting is not permitted."""
    return _mounted_tmpfs


@pytest.fixture
def torchtitan_recipes(monkeypatch):
    """torchtitan's own Qwen3 configs (`torchtitan.models.qwen3.config_registry`) as recipes of
    qwentitan's registry, each re-homed as qwentitan's `Trainer.Config` as the trn2 recipes are:
    the planner checked on recipes qwentitan did not write. Registered for this test only."""
    import dataclasses
    import sys
    import types

    from torchtitan.models.qwen3 import config_registry
    from torchtitan.trainer import Trainer as TorchtitanTrainer

    from qwentitan.launch import recipes
    from qwentitan.launch.runtime.trainer import Trainer

    given = [f.name for f in dataclasses.fields(TorchtitanTrainer.Config) if f.init]
    module = types.ModuleType("qwentitan_test_torchtitan_recipes")

    def rehomed(function):
        def recipe() -> Trainer.Config:
            config = function()
            return Trainer.Config(**{name: getattr(config, name) for name in given})

        return recipe

    names = [n for n in dir(config_registry) if n.startswith("qwen3_")]
    for name in names:
        setattr(module, name, rehomed(getattr(config_registry, name)))
        entry = recipes.Recipe(name, module.__name__, "native")
        monkeypatch.setitem(recipes._RECIPES, name, entry)
    monkeypatch.setitem(sys.modules, module.__name__, module)
    return names


class MetadataStandIn:
    """A loopback stand-in of EC2's instance metadata service (IMDSv2): a token from
    `PUT /latest/api/token`, then `spot/instance-action` answers 404 until `notify()`, and 401
    to a request without the token. `url` is what AWS_EC2_METADATA_SERVICE_ENDPOINT names."""

    TOKEN = "stand-in-token"

    def __init__(self) -> None:
        import http.server
        import threading

        self.notice: str | None = None
        self.requests: list[tuple[str, str, int]] = []
        stand_in = self

        class Handler(http.server.BaseHTTPRequestHandler):
            def do_PUT(self) -> None:
                ok = self.path == "/latest/api/token" and self.headers.get(
                    "X-aws-ec2-metadata-token-ttl-seconds"
                )
                self._answer(200 if ok else 400, stand_in.TOKEN if ok else "")

            def do_GET(self) -> None:
                if self.headers.get("X-aws-ec2-metadata-token") != stand_in.TOKEN:
                    self._answer(401, "")
                elif self.path == "/latest/meta-data/spot/instance-action" and stand_in.notice:
                    self._answer(200, stand_in.notice)
                else:
                    self._answer(404, "")

            def _answer(self, code: int, body: str) -> None:
                stand_in.requests.append((self.command, self.path, code))
                self.send_response(code)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body.encode())

            def log_message(self, *args: object) -> None:
                pass

        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def notify(self, action: str = "terminate") -> None:
        """Begin answering the two-minute notice, as EC2 does when it reclaims the instance."""
        import json
        from datetime import UTC, datetime, timedelta

        when = (datetime.now(UTC) + timedelta(minutes=2)).strftime("%Y-%m-%dT%H:%M:%SZ")
        self.notice = json.dumps({"action": action, "time": when})

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


@pytest.fixture
def metadata_service() -> Iterator[MetadataStandIn]:
    """A `MetadataStandIn` on a free loopback port, closed after the test."""
    stand_in = MetadataStandIn()
    try:
        yield stand_in
    finally:
        stand_in.close()


# The bucket of the `s3` fixture.
BUCKET = "qwentitan-test"


@pytest.fixture(scope="module")
def s3():
    """A moto S3 server on a free loopback port with BUCKET made, and the AWS environment
    (endpoint, dummy credentials) that points every SDK of this process and its ranks at it;
    yields an fsspec filesystem on it."""
    import socket

    from moto.server import ThreadedMotoServer

    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=port, verbose=False)
    server.start()
    # fsspec keeps one S3FileSystem per set of arguments, and the endpoint is not among them: a
    # filesystem made against an earlier module's server (now stopped, on another port) would
    # answer `url_to_fs` here. None is kept past this server.
    from s3fs import S3FileSystem

    S3FileSystem.clear_instance_cache()
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
        S3FileSystem.clear_instance_cache()
        server.stop()


@pytest.fixture(autouse=True)
def plans_in_this_process(monkeypatch):
    """`train` resolves its plan in a forked child so that its supervising process keeps no
    torch (test_child checks that in a fresh process); a test process holds torch already, so
    here the plan is resolved in it, as the pilot does."""
    from qwentitan.launch.launcher import child

    monkeypatch.setattr(child, "in_child", lambda function, *args: function(*args))


def guarded_manager(base_folder: Path, state: dict, **settings):
    """A `GuardedCheckpointManager` (enabled) of one module holding `state`'s tensors as its
    parameters, saving under `base_folder`/checkpoint, as the Trainer builds it."""
    import torch
    from torchtitan.components.optimizer import LRSchedulersContainer, default_adamw

    from qwentitan.launch.runtime.checkpointer import GuardedCheckpointManager

    model = torch.nn.Module()
    for name, tensor in state.items():
        model.register_parameter(name, torch.nn.Parameter(tensor.clone()))
    optimizers = default_adamw(lr=1e-3).build(model_parts=[model])
    return GuardedCheckpointManager.Config(enable=True, **settings).build(
        dataloader=None,
        model_parts=[model],
        optimizers=optimizers,
        lr_schedulers=LRSchedulersContainer.Config().build(
            optimizers=optimizers, training_steps=10
        ),
        states={},
        sd_adapter=None,
        base_folder=str(base_folder),
    )


@pytest.fixture
def no_hang():
    """A regression fails in 60 s instead of blocking the suite (a FIFO's open waits for a
    writer for ever): SIGALRM interrupts the blocked call with an exception."""
    import signal

    def hung(signum, frame):
        raise TimeoutError("blocked on a file that is not a file")

    previous = signal.signal(signal.SIGALRM, hung)
    signal.alarm(60)
    yield
    signal.alarm(0)
    signal.signal(signal.SIGALRM, previous)


@pytest.fixture(scope="module")
def qwen():
    """The bundled Qwen3 tokenizer, as the data loaders' tests build their windows with it."""
    from torchtitan.components.tokenizer import HuggingFaceTokenizer

    from qwentitan.launch.runtime.data import qwen_tokenizer_folder

    return HuggingFaceTokenizer(tokenizer_path=str(qwen_tokenizer_folder()))
