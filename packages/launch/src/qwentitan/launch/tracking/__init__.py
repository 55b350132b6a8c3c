"""MLflow tracking for torchtitan runs: see packages/launch/README.md ("Tracking")."""

from qwentitan.launch.tracking.logger import MLflowLogger, attach_report, resolve_tracking_uri
from qwentitan.launch.tracking.processor import SummaryLogger, TrackedMetrics, tracked_metrics
from qwentitan.launch.tracking.store import sync_run_dir
from qwentitan.launch.tracking.summary import (
    RunSummary,
    cost_per_million_tokens,
    format_summary,
    hourly_price,
)

__all__ = [
    "MLflowLogger",
    "RunSummary",
    "SummaryLogger",
    "TrackedMetrics",
    "attach_report",
    "cost_per_million_tokens",
    "format_summary",
    "hourly_price",
    "resolve_tracking_uri",
    "sync_run_dir",
    "tracked_metrics",
]
