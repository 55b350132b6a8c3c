"""MLflow names for torchtitan's metrics and configs.

torchtitan names its metrics for the console (`throughput(tps)`, `mfu(%)`); MLflow refuses
parentheses and percent signs in keys, and a user comparing runs wants short, stable names.
Every path (hf, native, moe-kernels) goes through this one table, so their metric names match.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Any

# torchtitan 0.3.0 key (components/metrics.py, trainer.py) -> MLflow key.
RENAMES: dict[str, str] = {
    "loss_metrics/global_avg_loss": "loss",
    "loss_metrics/global_max_loss": "loss_max",
    "grad_norm": "grad_norm",
    "throughput(tps)": "tokens_per_second_per_device",
    "tflops": "tflops_per_device",
    "mfu(%)": "mfu_percent",
    "time_metrics/end_to_end(s)": "step_time_s",
    "time_metrics/data_loading(s)": "data_loading_s",
    "time_metrics/data_loading(%)": "data_loading_percent",
    "n_tokens_seen": "tokens_seen",
    "validation_metrics/loss": "validation/loss",
    "validation_metrics/throughput(tps)": "validation/tokens_per_second_per_device",
}

_UNITS = (("(%)", "_percent"), ("(s)", "_s"), ("(GiB)", "_gib"), ("(tps)", "_tokens_per_second"))
_NOT_ALLOWED = re.compile(r"[^/\w.\- ]")

# Longest value MLflow stores for a parameter (mlflow.utils.validation.MAX_PARAM_VAL_LENGTH).
PARAM_VALUE_LIMIT = 6000


def metric_name(torchtitan_key: str) -> str:
    """The MLflow key for a torchtitan metric key: the table above, else a mechanical rewrite."""
    if torchtitan_key in RENAMES:
        return RENAMES[torchtitan_key]
    name = torchtitan_key.replace("validation_metrics/", "validation/")
    for unit, suffix in _UNITS:
        name = name.replace(unit, suffix)
    return _NOT_ALLOWED.sub("_", name)


def flatten_config(config: Mapping[str, Any], prefix: str = "") -> dict[str, str]:
    """`{"training": {"steps": 10}}` -> `{"training.steps": "10"}`, values cut to MLflow's limit."""
    flat: dict[str, str] = {}
    for key, value in config.items():
        name = f"{prefix}.{key}" if prefix else str(key)
        if isinstance(value, Mapping) and value:
            flat.update(flatten_config(value, name))
        else:
            flat[_NOT_ALLOWED.sub("_", name)] = str(value)[:PARAM_VALUE_LIMIT]
    return flat
