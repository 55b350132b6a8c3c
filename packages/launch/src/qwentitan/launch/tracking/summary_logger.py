"""`SummaryLogger`: the metrics rank's end-of-run figures, written for the launcher to print.

The ranks' console goes through torchrun, so the launcher prints the closing block after they
end, from RUN_DIR/reports/summary.json; this logger writes that file at close, with MLflow on
(the run id, read from the MLflow logger closed just before) or off.
"""

from __future__ import annotations

import logging
import os
from pathlib import Path
from typing import Any

from torchtitan.components.metrics import BaseLogger

from qwentitan.launch.tracking.logger import REPORTS_FOLDER, MLflowLogger
from qwentitan.launch.tracking.reports import SUMMARY, attach_report
from qwentitan.launch.tracking.summary import RunSummary, step_values

log = logging.getLogger(__name__)


class SummaryLogger(BaseLogger):
    def __init__(
        self, run_dir: str | os.PathLike[str], world_size: int, mlflow: MLflowLogger | None
    ) -> None:
        self.run_dir = Path(run_dir).resolve()
        self.world_size = world_size
        self.mlflow = mlflow
        # With MLflow on, its logger already observes every step: one summary, read here.
        self.summary = mlflow.summary if mlflow is not None else RunSummary()

    def log(self, metrics: dict[str, Any], step: int) -> None:
        if self.mlflow is None:
            self.summary.observe(step, step_values(metrics, self.world_size))

    def close(self) -> None:
        figures = {key.removeprefix("summary/"): v for key, v in self.summary.metrics().items()}
        mlflow = None
        if self.mlflow is not None:
            mlflow = {"run_id": self.mlflow.writer.run_id, "tracking_uri": self.mlflow.tracking_uri}
        report = {
            "first_step": self.summary.first_step,
            "last_step": self.summary.last_step,
            "last_validation_step": self.summary.last_validation_step,
            **figures,
            "run_dir": str(self.run_dir),
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
