"""The spot interruption watcher against a loopback stand-in of the instance metadata service:
IMDSv2 (token first), a notice mid-watch becomes the preemption path's stop, off EC2 one probe."""

from __future__ import annotations

import socket
import time

import pytest

from qwentitan.launch.runtime import spot
from qwentitan.launch.runtime.preemption import SPOT_NOTICE, PreemptionWatch


def _wait(predicate, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.02)


def test_a_notice_mid_watch_becomes_a_stop_agreed_like_a_signal(metadata_service):
    watch = PreemptionWatch()
    seen: list[str] = []

    def on_notice(text: str) -> None:
        seen.append(text)
        watch.request(SPOT_NOTICE)

    watcher = spot.SpotWatcher(metadata_service.url, on_notice, poll_s=0.05).start()
    try:
        _wait(
            lambda: (
                sum(path.endswith("instance-action") for _, path, _ in metadata_service.requests)
                >= 3
            )
        )
        assert watcher.state == "watching" and watch.stop_requested() is None
        metadata_service.notify()
        _wait(lambda: seen)
    finally:
        watcher.stop()
        watcher.join(5)
    assert seen == [metadata_service.notice] and watcher.state == "noticed"
    assert spot.describe_notice(seen[0]).startswith("terminate at 20")
    assert watch.stop_requested() == (
        "spot interruption notice from the instance metadata service: checkpointing and exiting"
    )
    # IMDSv2: one token, then every poll with it (none refused), and no poll after the notice.
    puts = [r for r in metadata_service.requests if r[0] == "PUT"]
    assert puts == [("PUT", "/latest/api/token", 200)]
    assert {code for method, _, code in metadata_service.requests if method == "GET"} == {404, 200}
    assert metadata_service.requests[-1][2] == 200


def test_an_expired_token_is_renewed(metadata_service):
    watcher = spot.SpotWatcher(metadata_service.url, lambda text: None, poll_s=0.05).start()
    try:
        _wait(lambda: watcher.state == "watching")
        metadata_service.TOKEN = "rotated"  # the watcher's token is refused (401) from now
        _wait(lambda: [r for r in metadata_service.requests if r[0] == "PUT"][1:])
        _wait(lambda: metadata_service.requests[-1][2] == 404)
    finally:
        watcher.stop()
        watcher.join(5)
    assert ("GET", "/latest/meta-data/spot/instance-action", 401) in metadata_service.requests


def test_off_ec2_one_failed_probe_and_the_watcher_ends():
    with socket.socket() as probe:  # a loopback port nothing listens on
        probe.bind(("127.0.0.1", 0))
        url = f"http://127.0.0.1:{probe.getsockname()[1]}"
    started = time.monotonic()
    watcher = spot.SpotWatcher(url, lambda text: None).start()
    watcher.join(10)
    assert watcher.state == "off EC2" and not watcher._thread.is_alive()
    assert time.monotonic() - started < spot.TIMEOUT_S + 1


@pytest.mark.parametrize(
    ("env", "expected"),
    [
        ({}, spot.DEFAULT_ENDPOINT),
        (
            {"AWS_EC2_METADATA_SERVICE_ENDPOINT": "http://[fd00:ec2::254]/"},
            "http://[fd00:ec2::254]",
        ),
        ({"AWS_EC2_METADATA_DISABLED": "true"}, None),
    ],
)
def test_the_endpoint_is_read_as_the_aws_sdks_read_it(env, expected, monkeypatch):
    for name in ("AWS_EC2_METADATA_SERVICE_ENDPOINT", "AWS_EC2_METADATA_DISABLED"):
        monkeypatch.delenv(name, raising=False)
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    assert spot.endpoint() == expected
    if expected is None:
        assert spot.start_watching(lambda text: None) is None
