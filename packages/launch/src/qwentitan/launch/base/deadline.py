"""`--stop-by TIME`: the moment rented hardware ends, as one absolute UTC time.

A Capacity Block ends on the hour it was booked for, a reservation or a budget at a time the
user knows: TIME is an ISO 8601 time with its UTC offset (`2026-12-03T18:00Z`,
`2026-12-03 20:00:00+02:00`: the same moment on every node, kept in UTC) or a duration from now (`+90m`, `+1h30m`, `+45s`, `+2h`). A duration is turned into an absolute
time once, where the request is made, so a rank restarted by torchrun keeps the same deadline.
"""

from __future__ import annotations

import re
from datetime import UTC, datetime, timedelta

from qwentitan.launch.base.errors import LaunchError

__all__ = ["format_utc", "parse_stop_by"]

_DURATION = re.compile(r"\+(?:(?P<h>\d+)h)?(?:(?P<m>\d+)m)?(?:(?P<s>\d+)s?)?")
_FIX = (
    "pass {stop_by} an ISO 8601 UTC time such as 2026-12-03T18:00:00Z, or a duration from now "
    "such as +90m or +1h30m."
)
_TOO_FAR = "lies beyond the year 9999, where Python's calendar ends"


def parse_stop_by(text: str, now: datetime | None = None) -> datetime:
    """The UTC time `text` names (a duration counts from `now`, default this moment)."""
    now = now or datetime.now(UTC)
    text = text.strip()
    if text.startswith("+"):
        match = _DURATION.fullmatch(text)
        if match is None or not any(match.groups()):
            raise LaunchError(f"{{stop_by}} {text!r} is not a duration; {_FIX}", field="stop_by")
        try:
            h, m, s = (int(match.group(k) or 0) for k in "hms")
            return now + timedelta(hours=h, minutes=m, seconds=s)
        except (OverflowError, ValueError):  # ValueError: more digits than int() takes
            raise LaunchError(f"{{stop_by}} {text!r} {_TOO_FAR}; {_FIX}", field="stop_by") from None
    try:
        when = datetime.fromisoformat(text.replace("z", "Z"))
    except ValueError:
        raise LaunchError(f"{{stop_by}} {text!r} is not a time; {_FIX}", field="stop_by") from None
    if when.tzinfo is None:
        raise LaunchError(
            f"{{stop_by}} {text!r} names no UTC offset; add Z (UTC) or the offset of its time "
            "zone so every node reads the same moment, e.g. 2026-12-03T18:00:00Z.",
            field="stop_by",
        )
    try:
        return when.astimezone(UTC)
    except OverflowError:  # 9999-12-31T23:00-02:00 is in the year 10000 in UTC
        raise LaunchError(f"{{stop_by}} {text!r} {_TOO_FAR}; {_FIX}", field="stop_by") from None


def format_utc(when: datetime) -> str:
    """`when` as the ISO 8601 UTC text `parse_stop_by` reads back, to the second."""
    return when.astimezone(UTC).strftime("%Y-%m-%dT%H:%M:%SZ")
