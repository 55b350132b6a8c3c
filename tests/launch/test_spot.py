"""The spot interruption watcher against a loopback stand-in of the instance metadata service:
IMDSv2 (token first), a notice mid-watch becomes the preemption path's stop, off EC2 one probe."""

from __future__ import annotations

import json
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


def test_only_the_documented_notice_is_one(metadata_service, caplog):
    """Any other answer at the notice's address is logged once, short and escaped, and the
    watch goes on; the notice kept is re-encoded from `action` and `time` alone."""
    seen: list[str] = []
    watcher = spot.SpotWatcher(metadata_service.url, seen.append, poll_s=0.02).start()
    hostile = "\x1b[2J\x1b[31m" + "\n2026-01-01 00:00:00 INFO forged: all good" + "A" * (1 << 20)
    try:
        _wait(lambda: watcher.state == "watching")
        metadata_service.notice = hostile
        answered = lambda: sum(  # noqa: E731
            code == 200 and path.endswith("instance-action")
            for _, path, code in metadata_service.requests
        )
        _wait(lambda: seen or answered() >= 3)
        assert seen == [] and watcher.state == "watching" and watcher.notice is None
        metadata_service.notice = json.dumps(
            {"action": "terminate", "time": "2026-12-07T02:00:00Z", "extra": "\x1b[31m" * 10}
        )
        _wait(lambda: seen)
    finally:
        watcher.stop()
        watcher.join(5)
    assert seen == ['{"action": "terminate", "time": "2026-12-07T02:00:00Z"}']
    assert watcher.notice == seen[0] and spot.describe_notice(seen[0]) == (
        "terminate at 2026-12-07T02:00:00Z"
    )
    (said,) = [r.getMessage() for r in caplog.records if "instance-action" in r.getMessage()]
    assert said.startswith(
        "The metadata service's spot/instance-action answered something that is not an "
        "interruption notice (more than 1024 bytes: '\\x1b[2J\\x1b[31m\\n2026-01-01"
    )
    assert said.endswith("...); ignored, still watching.")
    assert len(said) < 300 and "\x1b" not in said and "\n" not in said


@pytest.mark.parametrize(
    "body",
    [
        b"",
        b"{}",
        b"terminate",
        b'["terminate", "2026-12-07T02:00:00Z"]',
        b'{"action": "reboot", "time": "2026-12-07T02:00:00Z"}',
        b'{"action": "terminate", "time": "in two minutes"}',
        b'{"action": "terminate", "time": 1765072800}',
        b'{"action": "stop"}',
        b"\xff\xfe",
        b"[" * 100_000,
    ],
)
def test_what_is_not_a_notice(body):
    assert spot.parse_notice(body) is None


@pytest.mark.parametrize("action", ["stop", "terminate", "hibernate"])
def test_the_documented_actions_are_notices(action):
    body = json.dumps({"action": action, "time": "2017-09-18T08:22:00Z"}).encode()
    assert spot.parse_notice(body) == body.decode()
