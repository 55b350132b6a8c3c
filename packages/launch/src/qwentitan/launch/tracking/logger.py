"""`MLflowLogger`: torchtitan's `BaseLogger` interface, backed by a spool and a background writer.

`log(metrics, step)` renames torchtitan's keys (`names.py`), appends one spool line and hands
the record to the writer thread; it does no network or database work, so a slow or absent
tracking server never slows a training step. `close()` adds the summary, attaches the reports
and waits a bounded time for MLflow to confirm.
"""

from __future__ import annotations

import json
import logging
import os
import threading
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from torchtitan.components.metrics import BaseLogger
from torchtitan.config import Configurable

from qwentitan.checkpoint.files import atomic_file
from qwentitan.launch.base import env_defaults
from qwentitan.launch.base.errors import LaunchError
from qwentitan.launch.tracking import context, cost
from qwentitan.launch.tracking.names import flatten_config
from qwentitan.launch.tracking.spool import SPOOL_FOLDER, SpoolWriter
from qwentitan.launch.tracking.store import REQUEST_TIMEOUT_S, now_ms
from qwentitan.launch.tracking.summary import RunSummary, step_values
from qwentitan.launch.tracking.writer import BackgroundWriter

log = logging.getLogger(__name__)

REPORTS_FOLDER = "reports"

# Loggers open in this process, so `attach_report` can reach a live run.
_ACTIVE: list[MLflowLogger] = []
_ACTIVE_LOCK = threading.Lock()


def resolve_tracking_uri(configured: str | None = None) -> str:
    """The given URI, else the default: `$MLFLOW_TRACKING_URI`, else `<cwd>/mlflow.db`."""
    return configured or env_defaults.tracking_uri()


def experiment_name(recipe: str) -> str:
    """One experiment per recipe family: `tiny_dense` and `tiny_moe` both land in `qwentitan-tiny`."""
    family = recipe.split("_", 1)[0] if recipe else "runs"
    return f"qwentitan-{family}"


class MLflowLogger(BaseLogger, Configurable):
    @dataclass(kw_only=True, slots=True)
    class Config(Configurable.Config):
        # Defaults come from the environment (env_defaults, read when the config is built);
        # torchtitan's overrides (--metrics.mlflow.FIELD) set them per run.
        enable: bool = field(default_factory=env_defaults.mlflow_enabled)
        """Log to MLflow from the metrics rank (spool first); default off if $QWENTITAN_MLFLOW=off."""

        tracking_uri: str = field(default_factory=env_defaults.tracking_uri)
        """MLflow store; default $MLFLOW_TRACKING_URI, else sqlite:///<cwd>/mlflow.db."""

        experiment: str | None = field(default_factory=env_defaults.experiment)
        """Default $QWENTITAN_MLFLOW_EXPERIMENT / $MLFLOW_EXPERIMENT_NAME; None: qwentitan-<family>."""

        run_name: str | None = field(default_factory=env_defaults.run_name)
        """Default $QWENTITAN_MLFLOW_RUN_NAME; None: <recipe>-<time>."""

        parent_run_id: str | None = field(default_factory=env_defaults.parent_run_id)
        """Nest the run under this MLflow run (the pilot sets it); default
        $QWENTITAN_MLFLOW_PARENT_RUN_ID; None: a top-level run."""

        recipe: str = ""
        """Recipe name, e.g. tiny_dense; its prefix names the experiment."""

        path: str = ""
        """Implementation path: hf, native or moe-kernels."""

        instance_type: str | None = field(default_factory=env_defaults.instance_type)
        """Tagged, and prices the run; default $QWENTITAN_INSTANCE_TYPE; None: EC2's DMI name."""

        price_per_hour: float | None = field(default_factory=env_defaults.price_per_hour)
        """USD per instance-hour; default $QWENTITAN_PRICE_PER_HOUR; None: the dated catalogue."""

        close_timeout_s: float = 30.0
        """Longest wait at the end of training for MLflow to confirm; the spool keeps the rest."""

        request_timeout_s: int = REQUEST_TIMEOUT_S
        """HTTP timeout per MLflow request (a hung server costs the writer thread this, never training)."""

        retry_after_s: float = 60.0
        """After a failure, how long the writer waits before catching up from the spool."""

        def __post_init__(self) -> None:
            # Checked where torchtitan checks its configs, on construction (which its override
            # parser does), so `train` refuses a bad value before any rank starts.
            numbers = {
                "price_per_hour": self.price_per_hour,
                "close_timeout_s": self.close_timeout_s,
                "request_timeout_s": self.request_timeout_s,
                "retry_after_s": self.retry_after_s,
            }
            for name, value in numbers.items():
                if value is not None and not value > 0:
                    also = f" or ${env_defaults.PRICE}" if name == "price_per_hour" else ""
                    raise LaunchError(
                        f"metrics.mlflow.{name} is {value}; give a positive number with "
                        f"--metrics.mlflow.{name}{also}."
                    )

    def __init__(
        self,
        config: Config,
        *,
        run_dir: str | os.PathLike[str],
        config_dict: dict[str, Any] | None = None,
        tags: dict[str, str] | None = None,
        world_size: int = 1,
        nodes: int = 1,
    ) -> None:
        self.config = config
        self.run_dir = Path(run_dir).resolve()
        self.world_size = world_size
        self.instances = nodes
        self.tracking_uri = resolve_tracking_uri(config.tracking_uri)
        self.run_key = uuid.uuid4().hex
        self.summary = RunSummary()
        self._closed = False
        self._attached: set[Path] = set()
        self._last_step = 0
        all_tags = {
            "recipe": config.recipe or "unknown",
            "path": config.path or "unknown",
            "instance_type": context.instance_type(config.instance_type),
            "world_size": str(world_size),
            "git_commit": context.git_commit(),
            **context.package_versions(),
            **(tags or {}),
        }
        all_tags["mlflow.source.git.commit"] = all_tags["git_commit"]
        price = cost.hourly_price(all_tags["instance_type"], config.price_per_hour)
        self.usd_per_hour = price[0] if price else None
        if price:
            all_tags["cost.usd_per_hour"] = f"{price[0]:g}"
            all_tags["cost.price_source"] = price[1]

        stamp = time.strftime("%Y%m%d-%H%M%S")
        self.spool = SpoolWriter(self.run_dir / SPOOL_FOLDER / f"{stamp}-{self.run_key[:8]}.jsonl")
        self.spool.write(
            "run",
            run_key=self.run_key,
            experiment=config.experiment or experiment_name(config.recipe),
            run_name=config.run_name or f"{config.recipe or 'run'}-{stamp}",
            parent_run_id=config.parent_run_id,
            tracking_uri=self.tracking_uri,
            start_ms=now_ms(),
        )
        self.writer = BackgroundWriter(
            self.tracking_uri,
            self.spool.path,
            self.run_dir,
            retry_after_s=config.retry_after_s,
            records=self.spool.records,
        )
        self._emit("params", params=flatten_config(config_dict or {}))
        self._emit("tags", tags=all_tags)
        if config_dict is not None:
            resolved = self.spool.path.with_suffix("") / "resolved_config.json"
            try:
                write_text_atomically(resolved, json.dumps(config_dict, indent=2, default=repr))
                self.attach(resolved, "config")
            except OSError:
                pass  # a spool folder without room: its warning is said by the spool
        self.writer.start()
        with _ACTIVE_LOCK:
            _ACTIVE.append(self)

    def log(self, metrics: dict[str, Any], step: int) -> None:
        values = step_values(metrics, self.world_size)
        self.summary.observe(step, values)
        self._last_step = max(self._last_step, step)
        self._emit("metrics", step=step, time_ms=now_ms(), values=values)

    def set_tags(self, tags: dict[str, str]) -> None:
        """Add or change tags of the run while it logs (for facts known only after a step)."""
        if not self._closed:
            self._emit("tags", tags=dict(tags))

    def attach(self, file: str | os.PathLike[str], artifact_path: str = REPORTS_FOLDER) -> None:
        """Upload `file` (inside the run folder) as an artifact of this run, once."""
        path = Path(file).resolve()
        if path in self._attached or self._closed:
            return
        self._attached.add(path)
        self._emit(
            "artifact", file=os.path.relpath(path, self.run_dir), artifact_path=artifact_path
        )

    def close(self) -> None:
        if self._closed:
            return
        with _ACTIVE_LOCK:
            if self in _ACTIVE:
                _ACTIVE.remove(self)
        summary = self.summary.metrics(self.usd_per_hour, self.instances)
        if summary:
            self._emit("metrics", step=self._last_step, time_ms=now_ms(), values=summary)
        for report in sorted((self.run_dir / REPORTS_FOLDER).glob("*")):
            if report.is_file():
                self.attach(report)
        self._emit("end", status="FINISHED", end_ms=now_ms())
        self._closed = True
        confirmed = self.writer.finish(self.config.close_timeout_s)
        self.spool.close()
        if confirmed:
            log.info("MLflow run %s logged to %s", self.writer.run_id, self.tracking_uri)
        elif self.writer.error is not None:
            log.warning(
                "MLflow at %s could not be reached; every metric is in %s. Replay it with "
                "`qwentitan-launch sync-mlflow %s`.",
                self.tracking_uri,
                self.spool.path,
                self.run_dir,
            )
        else:
            log.warning(
                "MLflow at %s did not confirm this run within %.0f s; everything is in %s. "
                "Replay it with `qwentitan-launch sync-mlflow %s`.",
                self.tracking_uri,
                self.config.close_timeout_s,
                self.spool.path,
                self.run_dir,
            )

    def _emit(self, kind: str, **fields: Any) -> None:
        self.writer.send(self.spool.write(kind, **fields))


def active_loggers() -> list[MLflowLogger]:
    with _ACTIVE_LOCK:
        return list(_ACTIVE)


def write_text_atomically(path: Path, text: str) -> None:
    """Write `path` whole or not at all (the workspace's one atomic helper)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with atomic_file(path) as temporary:
        temporary.write_text(text, encoding="utf-8")
