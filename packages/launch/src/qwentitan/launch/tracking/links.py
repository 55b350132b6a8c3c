"""The MLflow UI pages that show a run's curves, for the Summary of `train` and for the pilot.

MLflow 3.x's UI opens an experiment on its GenAI overview (traces, evaluations: no plot) unless
the URL asks for the model-training view (`workflowType=machine_learning`, a parameter of the
UI's own URLs); a run opens on its overview tab unless the URL names a tab (`model-metrics`:
the run's metric charts). No torch, no MLflow import: the launcher prints these.
"""

from __future__ import annotations

import json
import urllib.parse
from collections.abc import Sequence

from qwentitan.launch.tracking.store import without_credentials

# Where `mlflow ui` (and `nox -s mlflow_ui`) serves a local store by default.
LOCAL_UI = "http://127.0.0.1:5000"
MODEL_TRAINING = {"workflowType": "machine_learning"}


def ui_address(tracking_uri: str) -> str:
    """The UI of a tracking server (`http(s)://...`), else the local `mlflow ui` address; never
    with a user or password."""
    uri = without_credentials(tracking_uri)
    served = uri.startswith(("http://", "https://"))
    return (uri if served else LOCAL_UI).rstrip("/")


def run_charts_url(tracking_uri: str, experiment_id: str, run_id: str) -> str:
    """The run's own page on its metric-charts tab (`.../runs/<run>/model-metrics`): one chart
    per metric, in MLflow 3.17's order: the `memory/`, `summary/` and `validation/` sections
    first, the step metrics (loss, grad_norm, lr, ...) in the last, "Model metrics"."""
    query = urllib.parse.urlencode(MODEL_TRAINING)
    return (
        f"{ui_address(tracking_uri)}/#/experiments/{experiment_id}/runs/{run_id}/model-metrics"
        f"?{query}"
    )


def loss_url(
    tracking_uri: str,
    experiment_id: str,
    run_ids: Sequence[str],
    metrics: Sequence[str] = ("loss",),
) -> str:
    """The UI's metric page: these runs' `metrics` curves (the first named in the URL's path)
    on one plot against the step, with a table of their latest, min and max (its own route,
    with the parameters its getMetricPageRoute writes)."""
    query = {
        "runs": _json(list(run_ids)),
        "metric": _json(metrics[0]),
        "experiments": _json([experiment_id]),
        "plot_metric_keys": _json(list(metrics)),
        "plot_layout": "{}",
        "x_axis": "step",
        "y_axis_scale": "linear",
        "line_smoothness": "1",
        "show_point": "true",
        "deselected_curves": "[]",
        "last_linear_y_axis_range": "[]",
        **MODEL_TRAINING,
    }
    path = urllib.parse.quote(metrics[0], safe="")
    return f"{ui_address(tracking_uri)}/#/metric/{path}?{urllib.parse.urlencode(query)}"


def compare_url(tracking_uri: str, experiment_id: str, run_ids: Sequence[str]) -> str:
    """The UI's compare-runs page: these runs' params, metrics and charts side by side."""
    query = {
        "runs": _json(list(run_ids)),
        "experiments": _json([experiment_id]),
        **MODEL_TRAINING,
    }
    return f"{ui_address(tracking_uri)}/#/compare-runs?{urllib.parse.urlencode(query)}"


def runs_url(tracking_uri: str, experiment_id: str) -> str:
    """The experiment's runs with their metric charts, in the model-training view."""
    query = urllib.parse.urlencode({**MODEL_TRAINING, "compareRunsMode": "CHART"})
    return f"{ui_address(tracking_uri)}/#/experiments/{experiment_id}/runs?{query}"


def _json(value: object) -> str:
    return json.dumps(value, separators=(",", ":"))
