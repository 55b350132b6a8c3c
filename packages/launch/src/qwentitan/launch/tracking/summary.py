"""Warm-up apart from sustained: the few numbers a user compares first across runs.

The first step a process runs includes compilation (and, on CPU, allocator warm-up), so it is
reported on its own; throughput is the median of the steps after it, which a slow checkpoint
or validation step cannot drag.
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass, field

from qwentitan.launch.tracking.cost import cost_per_million_tokens

_SUSTAINED = (
    "step_time_s",
    "tokens_per_second",
    "tokens_per_second_per_device",
    "tflops_per_device",
    "mfu_percent",
)


@dataclass(slots=True)
class RunSummary:
    first_step: int | None = None
    last_step: int | None = None
    first_loss: float | None = None
    final_loss: float | None = None
    warmup_time_s: float | None = None
    _later: dict[str, list[float]] = field(default_factory=dict)

    def observe(self, step: int, values: dict[str, float]) -> None:
        if "loss" not in values:
            return  # validation or other off-step logs do not shape the training summary
        if self.first_step is None:
            self.first_step = step
            self.first_loss = values["loss"]
            self.warmup_time_s = values.get("step_time_s")
        else:
            for key in _SUSTAINED:
                if key in values:
                    self._later.setdefault(key, []).append(values[key])
        self.last_step = step
        self.final_loss = values["loss"]

    def metrics(self, usd_per_hour: float | None = None, instances: int = 1) -> dict[str, float]:
        """`summary/...` metrics; sustained ones only once a step after the warm-up was seen."""
        out: dict[str, float] = {}
        for name in ("first_loss", "final_loss", "warmup_time_s"):
            value = getattr(self, name)
            if value is not None:
                out[f"summary/{name}"] = value
        for key, values in self._later.items():
            out[f"summary/sustained_{key}"] = statistics.median(values)
        tps = out.get("summary/sustained_tokens_per_second")
        if usd_per_hour is not None and tps:
            cost = cost_per_million_tokens(usd_per_hour, tps, instances)
            if cost is not None:
                out["summary/cost_usd_per_million_tokens"] = cost
        return out
