"""MLflow tracking for torchtitan runs: see packages/launch/README.md ("Tracking").

The names load lazily: the launcher reads the summary (`tracking.summary`, no torch) while its
ranks train, and must not import torchtitan and MLflow through this package to do so.
"""

from __future__ import annotations

import importlib
from typing import Any

# Each public name and the module that holds it.
_HOME = {
    "MLflowLogger": "logger",
    "attach_report": "logger",
    "resolve_tracking_uri": "logger",
    "SummaryLogger": "processor",
    "TrackedMetrics": "processor",
    "tracked_metrics": "processor",
    "end_abandoned_runs": "store",
    "sync_run_dir": "store",
    "RunSummary": "summary",
    "cost_per_million_tokens": "summary",
    "format_summary": "summary",
    "hourly_price": "summary",
}

__all__ = sorted(_HOME)


def __getattr__(name: str) -> Any:
    if name not in _HOME:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(f"{__name__}.{_HOME[name]}"), name)
