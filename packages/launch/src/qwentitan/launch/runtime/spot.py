"""`SpotWatcher`: a spot interruption notice becomes a stop through the preemption path.

EC2 gives a spot instance two minutes: the notice appears in the instance metadata service at
`/latest/meta-data/spot/instance-action` (404 until then). A daemon thread in one rank per
node polls it with IMDSv2 (a PUT to `/latest/api/token`, then the GET with that token) every
`POLL_S`, each request bounded by `TIMEOUT_S`, so a training step never waits on it. A notice
calls `PreemptionWatch.request(SPOT_NOTICE)`: the same flag a signal sets, all-reduced at the
next step boundary, so every rank of every node saves and stops together.

Only the documented notice counts: a JSON object whose `action` is `stop`, `terminate` or
`hibernate` and whose `time` is a UTC time such as `2017-09-18T08:22:00Z` (EC2 User Guide,
"Spot Instance interruption notices", the `instance-action` item:
https://docs.aws.amazon.com/AWSEC2/latest/UserGuide/spot-instance-termination-notices.html).
Anything else answered there (another body, more than `MAX_BODY` bytes) is not a notice: it is
logged once as unreadable, cut short and with control characters escaped, and the watch goes
on; the notice kept and reported is re-encoded from those two fields only.

The endpoint is `$AWS_EC2_METADATA_SERVICE_ENDPOINT`, as the AWS SDKs read it (default
http://169.254.169.254); `$AWS_EC2_METADATA_DISABLED=true` turns the watcher off, as it turns
the SDKs' metadata reads off. Off EC2 (no token from the first PUT) the watcher stops after
that one probe.
"""

from __future__ import annotations

import json
import re
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Callable

from torchtitan.tools.logging import logger

from qwentitan.launch.base import env_defaults

__all__ = ["DEFAULT_ENDPOINT", "POLL_S", "SpotWatcher", "endpoint", "parse_notice"]

DEFAULT_ENDPOINT = "http://169.254.169.254"
# AWS's guide to spot interruption notices suggests checking every 5 seconds.
POLL_S = 5.0
TIMEOUT_S = 2.0
_TOKEN_TTL_S = 21600  # IMDSv2's longest; renewed a minute before it ends
_ACTION = "/latest/meta-data/spot/instance-action"
# The documented notice is about 50 bytes; a longer answer is read no further.
MAX_BODY = 1024
_ACTIONS = ("stop", "terminate", "hibernate")
_UTC_TIME = re.compile(r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\dZ")
# The metadata service is link-local: never through an HTTP(S)_PROXY of the environment.
_OPEN = urllib.request.build_opener(urllib.request.ProxyHandler({})).open


def endpoint() -> str | None:
    """The metadata service to poll, or None when the environment turns it off."""
    return env_defaults.metadata_endpoint(DEFAULT_ENDPOINT)


class SpotWatcher:
    """Polls the metadata service in a daemon thread; `on_notice(text)` once on a notice."""

    def __init__(
        self,
        url: str,
        on_notice: Callable[[str], None],
        *,
        poll_s: float = POLL_S,
        timeout_s: float = TIMEOUT_S,
    ) -> None:
        self.url = url
        self.on_notice = on_notice
        self.poll_s = poll_s
        self.timeout_s = timeout_s
        self.notice: str | None = None  # the notice, re-encoded: {"action": ..., "time": ...}
        self.unreadable = 0  # answers to the notice's address that were not a notice
        self.state = "starting"  # then "watching", "off EC2" or "noticed"
        self._stop = threading.Event()
        self._token: tuple[str, float] | None = None
        self._thread = threading.Thread(target=self._run, name="spot-watcher", daemon=True)

    def start(self) -> SpotWatcher:
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()

    def join(self, timeout: float | None = None) -> None:
        self._thread.join(timeout)

    def _run(self) -> None:
        if self._fresh_token() is None:
            self.state = "off EC2"  # one probe: nothing answered IMDSv2 here
            return
        self.state = "watching"
        while not self._stop.is_set():
            notice = self._poll()
            if notice is not None:
                self.notice, self.state = notice, "noticed"
                self.on_notice(notice)
                return
            self._stop.wait(self.poll_s)

    def _poll(self) -> str | None:
        """The notice's text, or None (none yet, or this poll failed: the next one retries)."""
        token = self._fresh_token()
        if token is None:
            return None
        request = urllib.request.Request(
            self.url + _ACTION, headers={"X-aws-ec2-metadata-token": token}
        )
        try:
            with _OPEN(request, timeout=self.timeout_s) as response:
                body = response.read(MAX_BODY + 1)
        except urllib.error.HTTPError as error:
            if error.code == 401:
                self._token = None  # expired or revoked: a new one next time
            return None  # 404: no notice
        except (OSError, ValueError):
            return None
        notice = parse_notice(body)
        if notice is None:
            self._unreadable(body)
        return notice

    def _unreadable(self, body: bytes) -> None:
        """Said once (the service is polled every few seconds); never a stop."""
        self.unreadable += 1
        if self.unreadable == 1:
            logger.warning(
                f"The metadata service's spot/instance-action answered something that is not "
                f"an interruption notice ({shown(body)}); ignored, still watching."
            )

    def _fresh_token(self) -> str | None:
        now = time.monotonic()
        if self._token is not None and self._token[1] > now:
            return self._token[0]
        request = urllib.request.Request(
            self.url + "/latest/api/token",
            method="PUT",
            headers={"X-aws-ec2-metadata-token-ttl-seconds": str(_TOKEN_TTL_S)},
        )
        try:
            with _OPEN(request, timeout=self.timeout_s) as response:
                token = response.read().decode("ascii").strip()
        except (OSError, ValueError, UnicodeDecodeError):
            return None
        self._token = (token, now + _TOKEN_TTL_S - 60) if token else None
        return token or None


def parse_notice(body: bytes) -> str | None:
    """The documented notice in `body`, re-encoded from its `action` and `time` alone, else None."""
    if len(body) > MAX_BODY:
        return None
    try:
        notice = json.loads(body.decode("utf-8"))
    except (ValueError, RecursionError):  # not UTF-8 or not JSON
        return None
    if not isinstance(notice, dict):
        return None
    action, when = notice.get("action"), notice.get("time")
    if action not in _ACTIONS or not isinstance(when, str) or not _UTC_TIME.fullmatch(when):
        return None
    return json.dumps({"action": action, "time": when})


def shown(body: bytes, limit: int = 80) -> str:
    """A body for a log line: its size and its start, escaped (no terminal codes, no newline
    that would forge a log line)."""
    more = len(body) > limit
    text = repr(body[:limit].decode("utf-8", "replace"))
    size = f"more than {MAX_BODY} bytes" if len(body) > MAX_BODY else f"{len(body)} bytes"
    return f"{size}: {text}{'...' if more else ''}"


def describe_notice(text: str) -> str:
    """The notice's action and time (`terminate at 2026-...`), else the text escaped."""
    notice = parse_notice(text.encode("utf-8", "replace"))
    if notice is None:
        return shown(text.encode("utf-8", "replace"))
    fields = json.loads(notice)
    return f"{fields['action']} at {fields['time']}"


def start_watching(on_notice: Callable[[str], None]) -> SpotWatcher | None:
    """A started watcher on this host's metadata service, or None where it is turned off."""
    url = endpoint()
    if url is None:
        return None
    logger.debug(f"Watching {url} for a spot interruption notice every {POLL_S:g} s.")
    return SpotWatcher(url, on_notice).start()
