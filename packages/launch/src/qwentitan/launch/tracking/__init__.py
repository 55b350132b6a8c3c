"""MLflow tracking for torchtitan runs: see packages/launch/README.md ("Tracking")."""

from qwentitan.launch.tracking.cost import cost_per_million_tokens, hourly_price
from qwentitan.launch.tracking.logger import MLflowLogger, resolve_tracking_uri
from qwentitan.launch.tracking.processor import TrackedMetrics, tracked_metrics
from qwentitan.launch.tracking.replay import sync_run_dir
from qwentitan.launch.tracking.reports import attach_report
from qwentitan.launch.tracking.summary import RunSummary, format_summary
from qwentitan.launch.tracking.summary_logger import SummaryLogger

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
