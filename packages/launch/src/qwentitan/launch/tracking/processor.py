"""`TrackedMetrics`: torchtitan's `MetricsProcessor` with MLflow added at its logger seam.

A recipe opts in with `metrics=TrackedMetrics.Config(mlflow=MLflowLogger.Config(recipe=...,
path=...))`. The processor adds an `MLflowLogger` to torchtitan's `LoggerContainer` on the
metrics rank only (the one torchtitan picks: rank 0, or the last pipeline stage's first rank),
logs every step by default, writes the end-of-run summary (`SummaryLogger`, MLflow on or
off), and adds what torchtitan leaves out: process RSS, and MFU from the peak its Config holds
(`peak_flops`, which qwentitan's Trainer sets from its Target), with no MFU at all where no peak
is known (CPU).
"""

from __future__ import annotations

import json
import logging
import math
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Annotated, Any

import psutil
import torch
import tyro
from torchtitan.components.metrics import (
    BaseLogger,
    LoggerContainer,
    MetricsProcessor,
    _get_metrics_rank,
)
from torchtitan.distributed import ParallelDims

from qwentitan.launch.base.target import NEURON_TARGET, get_target
from qwentitan.launch.tracking.logger import (
    FIRST_STEP,
    SUMMARY,
    MLflowLogger,
    attach_report,
    experiment_name,
    job_nodes,
)
from qwentitan.launch.tracking.store import REPORTS_FOLDER
from qwentitan.launch.tracking.summary import RunSummary, step_values

log = logging.getLogger(__name__)

_GIB = 1024**3


class TrackedMetrics(MetricsProcessor):
    @dataclass(kw_only=True, slots=True)
    class Config(MetricsProcessor.Config):
        log_freq: int = 1
        """Every step, so MLflow holds one point per step for each metric."""

        mlflow: MLflowLogger.Config = field(default_factory=MLflowLogger.Config)

        peak_flops: Annotated[float | None, tyro.conf.Suppress] = None
        """Peak dense BF16 FLOP/s of one rank, which MFU divides by; None: no published peak
        (CPU), so no MFU. Set by qwentitan's Trainer from its Target, not by the recipe."""

    config: Config
    mlflow: MLflowLogger | None

    def __init__(self, config: Config, **kwargs: Any) -> None:
        self.mlflow = None
        self.summary_logger: SummaryLogger | None = None
        # torchtitan leaves MFU out (console "N/A", no metric) only for its `has_quantization`
        # argument: a BF16 peak would mislead there. With no peak at all it would divide by its
        # guess (an A100 on CPU), so no peak is the same case.
        no_mfu = kwargs.pop("has_quantization", False) or config.peak_flops is None
        super().__init__(config, has_quantization=no_mfu, **kwargs)
        # torchtitan's constructor takes no peak; it looks one up by the device's name.
        self.gpu_peak_flops = math.nan if config.peak_flops is None else config.peak_flops
        self._process = psutil.Process()

    def _build_metric_logger(
        self,
        *,
        config: Config,
        parallel_dims: ParallelDims,
        dump_folder: str,
        pp_schedule: str,
        config_dict: dict[str, Any] | None = None,
        **kwargs: Any,
    ) -> BaseLogger:
        built = super()._build_metric_logger(
            config=config,
            parallel_dims=parallel_dims,
            dump_folder=dump_folder,
            pp_schedule=pp_schedule,
            config_dict=config_dict,
            **kwargs,
        )
        if _rank() != _get_metrics_rank(parallel_dims=parallel_dims, pp_schedule=pp_schedule):
            return built
        container = built if isinstance(built, LoggerContainer) else LoggerContainer()
        if config.mlflow.enable:
            self.mlflow = config.mlflow.build(
                run_dir=dump_folder,
                config_dict=config_dict,
                tags=_run_tags(config, parallel_dims, config_dict or {}),
                world_size=parallel_dims.world_size,
                nodes=job_nodes(parallel_dims.world_size),
            )
            container.add_logger(self.mlflow)
        # Added last, so it closes after MLflow's logger and can report its run id.
        self.summary_logger = SummaryLogger(dump_folder, parallel_dims.world_size, self.mlflow)
        container.add_logger(self.summary_logger)
        return container

    def record_stop(self, report: dict[str, Any]) -> None:
        """Why the run stopped before its last step (the Trainer's stop report): the summary's
        `stopped` line and MLflow tags (`stop.cause`: deadline, spot, signal or stop_after)."""
        if self.summary_logger is not None:
            self.summary_logger.stopped = f"after step {report['step']}: {report['reason']}"
        if self.mlflow is not None:
            tags = {"stop.cause": report["cause"], "stop.reason": report["reason"]}
            tags["stop.step"] = str(report["step"])
            if "spot_notice" in report:
                tags["spot.interruption_notice"] = report["spot_notice"][:5000]
            self.mlflow.set_tags(tags)

    def log(
        self,
        step: int,
        global_avg_loss: float,
        global_max_loss: float,
        grad_norm: float,
        extra_metrics: dict[str, Any] | None = None,
    ) -> None:
        extra = dict(extra_metrics or {})
        if self.mlflow is not None:
            extra["memory/rss_gib"] = self._process.memory_info().rss / _GIB
        super().log(step, global_avg_loss, global_max_loss, grad_norm, extra_metrics=extra)


def _rank() -> int:
    return torch.distributed.get_rank() if torch.distributed.is_initialized() else 0


def _placement(config_dict: dict[str, Any]) -> tuple[str, str]:
    """(device type, LNC) for the tags: torchtitan's device_type, which qwentitan's Trainer
    rebinds to its Target's (tracking imports nothing of the runtime layer), and the config's
    LNC (its Target's default when unset); "n/a" off Trainium."""
    from torchtitan.tools.utils import device_type

    if device_type != "neuron":
        return device_type, "n/a"
    lnc = (
        config_dict.get("lnc") or get_target(config_dict.get("target") or NEURON_TARGET).default_lnc
    )
    return device_type, str(lnc)


def tracked_metrics(recipe: str, path: str, **metrics: Any) -> TrackedMetrics.Config:
    """The metrics config a recipe sets: every step to the console and to MLflow.

    The MLflow fields take their defaults from the environment (`env_defaults`;
    `$QWENTITAN_MLFLOW=off` leaves the console metrics only) and the experiment from the
    recipe's family; `--metrics.mlflow.FIELD VALUE` overrides any of them.
    """
    mlflow = MLflowLogger.Config(recipe=recipe, path=path)
    mlflow.experiment = mlflow.experiment or experiment_name(recipe)
    return TrackedMetrics.Config(mlflow=mlflow, **metrics)


def _run_tags(
    config: TrackedMetrics.Config, parallel_dims: ParallelDims, config_dict: dict[str, Any]
) -> dict[str, str]:
    platform, lnc = _placement(config_dict)
    spec = config_dict.get("model_spec") or {}
    tags = {
        "platform": platform,
        "lnc": lnc,
        "flavor": str(spec.get("flavor", "unknown")) if isinstance(spec, dict) else "unknown",
        "model": str(spec.get("name", "unknown")) if isinstance(spec, dict) else "unknown",
    }
    for degree in ("dp_replicate", "dp_shard", "cp", "tp", "pp", "ep"):
        tags[f"parallel.{degree}"] = str(getattr(parallel_dims, degree))
    return tags


class SummaryLogger(BaseLogger):
    def __init__(
        self, run_dir: str | os.PathLike[str], world_size: int, mlflow: MLflowLogger | None
    ) -> None:
        self.run_dir = Path(run_dir).resolve()
        self.world_size = world_size
        self.mlflow = mlflow
        # With MLflow on, its logger already observes every step: one summary, read here.
        self.summary = mlflow.summary if mlflow is not None else RunSummary()
        self.stopped: str | None = None  # TrackedMetrics.record_stop
        self._first_step_read = False

    def log(self, metrics: dict[str, Any], step: int) -> None:
        if self.mlflow is None:
            self.summary.observe(step, step_values(metrics, self.world_size))
        self._adopt_first_step()

    def close(self) -> None:
        self._adopt_first_step()
        figures = {key.removeprefix("summary/"): v for key, v in self.summary.metrics().items()}
        mlflow = None
        if self.mlflow is not None:
            mlflow = self.mlflow.report()
        report = {
            "first_step": self.summary.first_step,
            "last_step": self.summary.last_step,
            "last_validation_step": self.summary.last_validation_step,
            "ranks": self.world_size,
            **figures,
            "run_dir": str(self.run_dir),
            "stopped": self.stopped,
            "mlflow": mlflow,
        }
        try:
            attach_report(self.run_dir, SUMMARY, report)
        except OSError as error:
            # At the very end (disk full, folder gone read-only): training and its checkpoint are
            # done, so one line instead of a traceback; the launcher then prints no block.
            log.warning(
                "The run summary could not be written to %s (%s); the figures are in the log "
                "above%s.",
                self.run_dir / REPORTS_FOLDER,
                error.strerror or error,
                " and the MLflow run" if self.mlflow is not None else "",
            )

    def _adopt_first_step(self) -> None:
        """The warm-up as the rank's console said it, the one figure: the first step's own
        time, which `Trainer.train_step` leaves in RUN_DIR/reports/first_step.json after the
        step's metrics are logged (so MLflow's summary, logged at close, gets it too).
        torchtitan's step-1 end-to-end time also counts the set-up before the step. Kept where
        no report of this run's first step is here (another node's rank 0 wrote it)."""
        if self._first_step_read or self.summary.first_step is None:
            return
        path = self.run_dir / REPORTS_FOLDER / f"{FIRST_STEP}.json"
        try:
            report = json.loads(path.read_text(encoding="utf-8"))
        except (OSError, ValueError):
            return
        if report.get("step") == self.summary.first_step and report.get("seconds") is not None:
            self.summary.warmup_time_s = report["seconds"]
            self._first_step_read = True
