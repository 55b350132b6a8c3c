"""A run's numbers: MLflow names for torchtitan's metrics, warm-up apart from sustained, cost.

torchtitan names its metrics for the console (`throughput(tps)`, `mfu(%)`); MLflow refuses
parentheses and percent signs in keys, and a user comparing runs wants short, stable names, so
every path (hf, native, moe-kernels) goes through one table (`RENAMES`). The first step a
process runs includes compilation (and, on CPU, allocator warm-up), so it is reported on its
own; throughput is the median of the steps after it, which a slow checkpoint or validation step
cannot drag. Cost per million tokens uses the Targets' dated on-demand prices (`base.target`;
`MLflowLogger.Config.price_per_hour` overrides them); an instance without a price gets no cost
metric rather than a made-up one. The same figures end every `train` on the console
(`format_summary`), read from RUN_DIR/reports/summary.json, which the metrics rank writes.
"""

from __future__ import annotations

import functools
import math
import re
import statistics
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from qwentitan.launch.base.target import PRICE_AS_OF, PRICE_SOURCE, TARGETS
from qwentitan.launch.tracking.links import LOCAL_UI, loss_url, run_charts_url, runs_url
from qwentitan.launch.tracking.store import without_credentials

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
            flat[_NOT_ALLOWED.sub("_", name)] = comparable(value)[:PARAM_VALUE_LIMIT]
    return flat


# A repr that holds a memory address (`<function normal_ at 0x7f6f43657100>`) differs between
# any two runs, so two runs with the same setting would seem to differ.
_ADDRESS = re.compile(r" at 0x[0-9a-fA-F]+")


def qualified_name(value: Any) -> str | None:
    """`torch.nn.init.normal_` for a function, class or other named object; None for a value."""
    if isinstance(value, functools.partial):
        args = [comparable(a) for a in value.args]
        args += [f"{k}={comparable(v)}" for k, v in value.keywords.items()]
        return f"functools.partial({comparable(value.func)}{''.join(', ' + a for a in args)})"
    name = getattr(value, "__qualname__", None)
    if not isinstance(name, str) or not (callable(value) or isinstance(value, type)):
        return None
    module = getattr(value, "__module__", None)
    return f"{module}.{name}" if isinstance(module, str) and module else name


def comparable(value: Any) -> str:
    """A config value as text two runs can compare: a function or class by its qualified name,
    an object's repr without its memory address, anything else as `str` gives it."""
    named = qualified_name(value)
    if named is not None:
        return named
    return _ADDRESS.sub("", str(value))


def hourly_price(instance_type: str, configured: float | None = None) -> tuple[float, str] | None:
    """(USD per instance-hour, where the figure came from), or None when nothing is known."""
    if configured is not None:
        return configured, "config"  # MLflowLogger.Config checked it is positive
    target = TARGETS.get(instance_type)
    if target is None or target.price_per_hour is None:
        return None
    return target.price_per_hour, f"catalogue {PRICE_AS_OF} ({PRICE_SOURCE})"


def cost_per_million_tokens(
    usd_per_hour: float, tokens_per_second: float, instances: int = 1
) -> float | None:
    """USD per 10^6 tokens at a whole-job throughput, paying for `instances` hosts."""
    if tokens_per_second <= 0:
        return None
    return usd_per_hour * instances / (tokens_per_second * 3600.0) * 1e6


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
    last_validation_loss: float | None = None
    last_validation_step: int | None = None
    _later: dict[str, list[float]] = field(default_factory=dict)

    def observe(self, step: int, values: dict[str, float]) -> None:
        if "validation/loss" in values:
            self.last_validation_loss = values["validation/loss"]
            self.last_validation_step = step
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
        for name in ("first_loss", "final_loss", "last_validation_loss", "warmup_time_s"):
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


def step_values(metrics: Mapping[str, Any], world_size: int) -> dict[str, float]:
    """torchtitan's metrics of one log call under MLflow names, with the job's tokens/s added.

    A metric with no meaning here (MFU where the platform has no known peak) is NaN: left out.
    """
    values = {}
    for key, value in metrics.items():
        number = float(value)
        if math.isfinite(number):
            values[metric_name(key)] = number
    if "tokens_per_second_per_device" in values:
        values["tokens_per_second"] = values["tokens_per_second_per_device"] * world_size
    return values


def format_summary(
    report: Mapping[str, Any], checkpoint_folder: str | Path | None, ended: Sequence[str] = ()
) -> str:
    """The block that ends `train`: what a user reads first, from RUN_DIR/reports/summary.json;
    `ended`: the lines of `end_abandoned_runs`, said after the MLflow rows."""

    def number(key: str) -> str:
        value = report.get(key)
        return "n/a" if value is None else f"{value:.4f}"

    first, last = report.get("first_step"), report.get("last_step")
    steps = f" (step {first} -> {last})" if first is not None else ""
    validated_at = report.get("last_validation_step")
    validated = f" (step {validated_at})" if validated_at is not None else ""
    warmup = report.get("warmup_time_s")
    rows = [
        ("loss", f"{number('first_loss')} -> {number('final_loss')}{steps}"),
        ("validation loss", number("last_validation_loss") + validated),
        ("tokens/s", _tokens_per_second(report)),
        ("warm-up", f"{warmup:.1f} s (first step, compilation included)" if warmup else "n/a"),
        ("checkpoints", str(checkpoint_folder) if checkpoint_folder else "off"),
    ]
    if export := report.get("hf_export"):  # the last Hugging Face export (--hf-every)
        result = "verified" if export.get("ok") else f"FAILED: {export.get('error')}"
        rows.append(("HF export", f"{export.get('folder')} ({result})"))
    if report.get("stopped"):
        rows.append(("stopped", f"{report['stopped']}; --resume continues"))
    mlflow = report.get("mlflow")
    if not mlflow:
        rows.append(("MLflow", "off"))
    elif not mlflow.get("run_id"):
        rows.append(
            (
                "MLflow",
                f"not confirmed; replay with `qwentitan-launch sync-mlflow {report.get('run_dir', 'RUN_DIR')}`",
            )
        )
    else:
        rows += _mlflow_rows(mlflow)
    rows += [("earlier start", line) for line in ended]
    width = max(len(name) for name, _ in rows)
    lines = [f"  {name:<{width}}  {text}" for name, text in rows]
    return "\n".join(["Summary", *lines])


# What the Summary's first link plots: the training loss, and the held-out loss beside it.
CURVES = ("loss", "validation/loss")


def _mlflow_rows(mlflow: Mapping[str, Any]) -> list[tuple[str, str]]:
    """The run, how to serve the UI for a local store, and the pages that show its curves: its
    loss and validation loss on one plot, all its metric charts, and the experiment's runs to
    compare it with (`tracking.links`)."""
    uri = without_credentials(str(mlflow["tracking_uri"]))  # a report written before the filter
    run_id, experiment_id = mlflow["run_id"], mlflow.get("experiment_id")
    rows = [("MLflow run", f"{run_id} in {uri}")]
    if experiment_id is None:  # a report that does not name the experiment: the run's overview
        rows.append(
            (
                "open it",
                f"uv run mlflow ui --backend-store-uri {uri}  then {LOCAL_UI}/#/runs/{run_id}",
            )
        )
        return rows
    if not uri.startswith(("http://", "https://")):
        rows.append(("serve the UI", f"uv run mlflow ui --backend-store-uri {uri}"))
    experiment_id, run_id = str(experiment_id), str(run_id)
    rows.append(("loss curve", loss_url(uri, experiment_id, [run_id], CURVES)))
    rows.append(("all charts", run_charts_url(uri, experiment_id, run_id)))
    rows.append(("compare runs", runs_url(uri, experiment_id)))
    return rows


def _tokens_per_second(report: Mapping[str, Any]) -> str:
    """The job's sustained tokens/s, and each rank's (what a step line's `tps` shows)."""
    total = report.get("sustained_tokens_per_second")
    if not total:
        return "n/a (no step after the first)"
    per_rank, ranks = report.get("sustained_tokens_per_second_per_device"), report.get("ranks")
    split = f" = {per_rank:.0f} per rank x {ranks} (a step line's tps is per rank)"
    return (
        f"{total:.0f} in total{split if per_rank and ranks else ''}; sustained: the median of "
        "the steps after the first"
    )
