"""`StopClock`: when a run with `--stop-by` must stop so its checkpoint is written in time.

At each step boundary the rank asks `due()`: would one more step, then a save, then the margin
still end before the deadline? If not, it stops now through the preemption path (a checkpoint
of this step, the same exit as a signal). The figures are measured where they can be:

- a save: the last one this process timed (`saved`); before the first, the rank's own state
  bytes (its shards of the weights and the optimizer's moments) over `ASSUMED_WRITE_BYTES_PER_S`;
- a step: the slowest of the last few boundary-to-boundary intervals (validation included, a
  save taken out); until a second, the first step's (compilation included), the worst case,
  and while the first runs, the time since training started;
- `MARGIN_S`: the process exit after the save, and a clock drift between nodes.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Iterable
from dataclasses import dataclass, field
from datetime import UTC, datetime

from qwentitan.launch.base.deadline import format_utc, parse_stop_by

__all__ = ["ASSUMED_WRITE_BYTES_PER_S", "MARGIN_S", "StopClock", "state_bytes"]

# Before a save was timed: a cloud block volume's baseline write rate (an EBS gp3 volume gives
# 125 MiB/s unless provisioned higher), so the first estimate errs long, never short.
ASSUMED_WRITE_BYTES_PER_S = 100e6
# After the save: the ranks' and torchrun's exit and the launcher's summary (27 s measured on
# a loaded 2-core CPU host), and clocks a little apart on several nodes.
MARGIN_S = 30.0
# Steps whose intervals are kept: a validation step or a slow data read is remembered this long.
_RECENT = 8


@dataclass(slots=True)
class StopClock:
    """The budget of one rank against `deadline` (seconds since the epoch)."""

    deadline: float
    save_s: float
    """The last save's seconds, or the estimate until one was timed (`save_measured`)."""
    margin_s: float = MARGIN_S
    save_measured: bool = False
    step_s: float | None = None
    decision: dict[str, float | bool | str] | None = None
    """The figures when `due()` first said stop: the report's, since the stop's own save then
    replaces `save_s` with its time."""
    _recent: deque[float] = field(default_factory=lambda: deque(maxlen=_RECENT))
    _first: float | None = None
    _last_boundary: float | None = None
    _saving_s: float = 0.0  # save seconds since the last boundary, taken out of the interval

    @classmethod
    def until(cls, stop_by: str, state: int) -> StopClock:
        """The clock for `--stop-by` text and `state` bytes this rank saves."""
        deadline = parse_stop_by(stop_by).timestamp()
        return cls(deadline=deadline, save_s=state / ASSUMED_WRITE_BYTES_PER_S)

    def saved(self, seconds: float) -> None:
        """A save of this rank took `seconds`."""
        self.save_s, self.save_measured = seconds, True
        self._saving_s += seconds

    def boundary(self, now: float | None = None) -> None:
        """A step boundary was reached: the interval since the last one is a step."""
        now = time.time() if now is None else now
        if self._last_boundary is not None:
            interval = max(0.0, now - self._last_boundary - self._saving_s)
            if self._first is None:
                self._first = interval  # compilation included: used until a second step
            else:
                self._recent.append(interval)
            self.step_s = max(self._recent) if self._recent else self._first
        self._last_boundary, self._saving_s = now, 0.0

    def _step(self, now: float) -> float:
        """The step the budget counts: the measured one, else (before a step was measured) the
        one running since the last boundary."""
        if self.step_s is not None:
            return self.step_s
        return now - self._last_boundary if self._last_boundary is not None else 0.0

    def due(self, now: float | None = None) -> bool:
        """True when one more step and a save would not end `margin_s` before the deadline."""
        now = time.time() if now is None else now
        due = now + self._step(now) + self.save_s + self.margin_s >= self.deadline
        if due and self.decision is None:
            self.decision = self.figures(now)
        return due

    def figures(self, now: float | None = None) -> dict[str, float | bool | str]:
        """The budget as the stop report and the log say it."""
        now = time.time() if now is None else now
        return {
            "stop_by": format_utc(datetime.fromtimestamp(self.deadline, UTC)),
            "seconds_left": round(self.deadline - now, 2),
            "save_s": round(self.save_s, 2),
            "save_measured": self.save_measured,
            "step_s": round(self._step(now), 2),  # what `due` counted, also mid-first-step
            "margin_s": self.margin_s,
        }


def state_bytes(tensors: Iterable[object], moments: int = 2) -> int:
    """Bytes this rank saves for `tensors` (its parameters; DTensor shards count locally) and,
    per parameter, `moments` optimizer tensors of the same size (AdamW's two)."""
    total = 0
    for tensor in tensors:
        local = getattr(tensor, "_local_tensor", tensor)
        total += local.numel() * local.element_size()  # type: ignore[attr-defined]
    return total * (1 + moments)
