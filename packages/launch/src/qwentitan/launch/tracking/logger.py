"""`MLflowLogger`: torchtitan's `BaseLogger` interface, backed by a spool and a background writer.

`log(metrics, step)` renames torchtitan's keys (`summary.metric_name`), appends one spool line
and hands the record to the writer thread; it does no network or database work, so a slow or
absent tracking server never slows a training step. `close()` adds the summary, attaches the
reports and waits a bounded time for MLflow to confirm. The run's tags say what it ran on and
with (package versions, git commit, instance type and price), all read locally so building them
cannot slow a training start. Other steps (preflight, the plan, checkpoint verification, the
first step) store reports in RUN_DIR/reports with `attach_report`: a run logging in this process
uploads them at once, a run starting later at its end, and `sync-mlflow` whatever came after.
"""

from __future__ import annotations

import importlib.metadata
import json
import logging
import os
import re
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from torchtitan.components.metrics import BaseLogger
from torchtitan.config import Configurable

from qwentitan.checkpoint.files import atomic_file
from qwentitan.launch.base import env_defaults
from qwentitan.launch.base.errors import LaunchError
from qwentitan.launch.tracking.spool import (
    SPOOL_FOLDER,
    SpoolWriter,
    folder_run_key,
    writer_identity,
)
from qwentitan.launch.tracking.store import (
    REPORTS_FOLDER,
    REQUEST_TIMEOUT_S,
    now_ms,
    resolve_tracking_uri,
    scrubbed,
    without_credentials,
)
from qwentitan.launch.tracking.summary import (
    RunSummary,
    comparable,
    flatten_config,
    hourly_price,
    step_values,
)
from qwentitan.launch.tracking.writer import BackgroundWriter

log = logging.getLogger(__name__)

# Loggers open in this process, so `attach_report` can reach a live run.
_ACTIVE: list[MLflowLogger] = []
_ACTIVE_LOCK = threading.Lock()


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
        # What is shown and stored (spool, reports, log lines): the address without its user
        # and password; only the writer's MLflow client gets it whole.
        connect_uri = resolve_tracking_uri(config.tracking_uri)
        self.tracking_uri = without_credentials(connect_uri)
        # The run folder's key: a --resume, a requeue or a spot restart continues its MLflow run.
        self.run_key = folder_run_key(self.run_dir)
        self.summary = RunSummary()
        self.stopped = False  # a stop with a checkpoint was recorded (`set_tags`, `mark_stopped`)
        self._closed = False
        self._attached: set[Path] = set()
        self._last_step = 0
        all_tags = self._run_tags(tags or {})
        stamp = time.strftime("%Y%m%d-%H%M%S")
        self.spool = SpoolWriter(
            self.run_dir / SPOOL_FOLDER / f"{stamp}-{uuid.uuid4().hex[:8]}.jsonl"
        )
        self.spool.write(
            "run",
            run_key=self.run_key,
            experiment=config.experiment or experiment_name(config.recipe),
            run_name=config.run_name or f"{config.recipe or 'run'}-{stamp}",
            parent_run_id=config.parent_run_id,
            tracking_uri=self.tracking_uri,
            start_ms=now_ms(),
            **writer_identity(),
        )
        self.writer = BackgroundWriter(
            connect_uri,
            self.spool.path,
            self.run_dir,
            retry_after_s=config.retry_after_s,
            records=self.spool.records,
        )
        config_dict = scrubbed(config_dict) if config_dict is not None else None
        self._emit("params", params=flatten_config(config_dict or {}))
        self._emit("tags", tags=scrubbed(all_tags))
        if config_dict is not None:
            self._keep_config(config_dict)
        self.writer.start()
        with _ACTIVE_LOCK:
            _ACTIVE.append(self)

    def _run_tags(self, tags: dict[str, str]) -> dict[str, str]:
        """What the run ran on and with, the caller's `tags` on top, and its price (which also
        sets `usd_per_hour`)."""
        config = self.config
        all_tags = {
            "recipe": config.recipe or "unknown",
            "path": config.path or "unknown",
            "instance_type": instance_type(config.instance_type),
            "world_size": str(self.world_size),
            "git_commit": git_commit(),
            **package_versions(),
            **tags,
        }
        all_tags["mlflow.source.git.commit"] = all_tags["git_commit"]
        price = hourly_price(all_tags["instance_type"], config.price_per_hour)
        self.usd_per_hour = price[0] if price else None
        if price:
            all_tags["cost.usd_per_hour"] = f"{price[0]:g}"
            all_tags["cost.price_source"] = price[1]
        return all_tags

    def _keep_config(self, config_dict: dict[str, Any]) -> None:
        """The resolved config as a file beside the spool, attached to the run."""
        resolved = self.spool.path.with_suffix("") / "resolved_config.json"
        try:
            write_text_atomically(resolved, json.dumps(config_dict, indent=2, default=comparable))
            self.attach(resolved, "config")
        except OSError:
            pass  # a spool folder without room: its warning is said by the spool

    def log(self, metrics: dict[str, Any], step: int) -> None:
        values = step_values(metrics, self.world_size)
        self.summary.observe(step, values)
        self._last_step = max(self._last_step, step)
        self._emit("metrics", step=step, time_ms=now_ms(), values=values)

    def set_tags(self, tags: dict[str, str]) -> None:
        """Add or change tags of the run while it logs (for facts known only after a step).
        The stop tags (`stop.cause`, which `TrackedMetrics.record_stop` sets once the stop's
        checkpoint is saved) also make `close` end the run as KILLED."""
        if not self._closed:
            if "stop.cause" in tags:
                self.stopped = True
            self._emit("tags", tags=scrubbed(dict(tags)))

    def mark_stopped(self) -> None:
        """This start stops early with a checkpoint (signal, deadline, spot, --stop-after):
        `close` ends the run as KILLED, and a later start in the folder continues it."""
        self.stopped = True

    def end_status(self) -> str:
        """How `close` ends the run, in MLflow's words: FAILED while an exception is being
        handled (torchtitan's `train` closes the trainer in its `except` before re-raising),
        KILLED after a recorded stop, else FINISHED."""
        if sys.exc_info()[1] is not None:
            return "FAILED"
        return "KILLED" if self.stopped else "FINISHED"

    def attach(self, file: str | os.PathLike[str], artifact_path: str = REPORTS_FOLDER) -> None:
        """Upload `file` (inside the run folder) as an artifact of this run, once."""
        path = Path(file).resolve()
        if path in self._attached or self._closed:
            return
        self._attached.add(path)
        self._emit(
            "artifact", file=os.path.relpath(path, self.run_dir), artifact_path=artifact_path
        )

    def close(self, status: str | None = None) -> None:
        """Summary, reports, then the `end` record with `status` (FINISHED, KILLED or FAILED;
        None: `end_status()`), and a bounded wait for MLflow."""
        if self._closed:
            return
        status = status or self.end_status()
        if status not in ENDED:
            raise ValueError(f"close(status={status!r}): give one of {', '.join(ENDED)}")
        with _ACTIVE_LOCK:
            if self in _ACTIVE:
                _ACTIVE.remove(self)
        summary = self.summary.metrics(self.usd_per_hour, self.instances)
        if summary:
            self._emit("metrics", step=self._last_step, time_ms=now_ms(), values=summary)
        for report in sorted((self.run_dir / REPORTS_FOLDER).glob("*")):
            if report.is_file():
                self.attach(report)
        self._emit("end", status=status, end_ms=now_ms())
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

    def report(self) -> dict[str, str | None]:
        """What the Summary needs to link the run (`format_summary`'s report["mlflow"]): its id
        and experiment once MLflow confirmed it (None before), and the store without
        credentials."""
        return {
            "run_id": self.writer.run_id,
            "experiment_id": self.writer.experiment_id,
            "tracking_uri": self.tracking_uri,
        }

    def _emit(self, kind: str, **fields: Any) -> None:
        self.writer.send(self.spool.write(kind, **fields))


# How a run ends, in MLflow's words (mlflow.entities.RunStatus).
ENDED = ("FINISHED", "KILLED", "FAILED")


def active_loggers() -> list[MLflowLogger]:
    with _ACTIVE_LOCK:
        return list(_ACTIVE)


def write_text_atomically(path: Path, text: str) -> None:
    """Write `path` whole or not at all (the workspace's one atomic helper)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with atomic_file(path) as temporary:
        temporary.write_text(text, encoding="utf-8")


# Distributions whose versions decide whether two runs are comparable.
VERSIONED = (
    "torch",
    "torch-neuronx",
    "transformers",
    "torchtitan",
    "mlflow",
    "qwentitan-kernels",
    "qwentitan-modeling",
    "qwentitan-checkpoint",
    "qwentitan-launch",
)

# On EC2 Nitro hosts the DMI product name is the instance type (e.g. "trn2.48xlarge").
_DMI_PRODUCT = Path("/sys/devices/virtual/dmi/id/product_name")
_INSTANCE_TYPE = re.compile(r"^[a-z][a-z0-9-]*\.[a-z0-9]+$")


def package_versions() -> dict[str, str]:
    """`{"version.torch": "2.14.1", "version.torch-neuronx": "absent", ...}`."""
    versions = {}
    for name in VERSIONED:
        try:
            versions[f"version.{name}"] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            versions[f"version.{name}"] = "absent"
    return versions


def git_commit(where: str | os.PathLike[str] | None = None) -> str:
    """The commit of the working directory's checkout, else of the one holding this package
    (with `+dirty` when tracked files differ), else "unknown"."""
    if where is None:
        found = git_commit(Path.cwd())
        return found if found != "unknown" else git_commit(Path(__file__).resolve().parent)
    try:
        commit = subprocess.run(
            ["git", "rev-parse", "HEAD"], cwd=where, capture_output=True, text=True, timeout=5
        )
        if commit.returncode != 0:
            return "unknown"
        status = subprocess.run(
            ["git", "status", "--porcelain", "--untracked-files=no"],
            cwd=where,
            capture_output=True,
            text=True,
            timeout=5,
        )
    except (OSError, subprocess.TimeoutExpired):
        return "unknown"
    dirty = "+dirty" if status.returncode == 0 and status.stdout.strip() else ""
    return commit.stdout.strip() + dirty


def instance_type(configured: str | None = None) -> str:
    """The configured type (`MLflowLogger.Config.instance_type`), else the EC2 type from DMI,
    else "local"."""
    if configured:
        return configured
    try:
        product = _DMI_PRODUCT.read_text().strip()
    except OSError:
        return "local"
    return product if _INSTANCE_TYPE.match(product) else "local"


def job_nodes(world_size: int) -> int:
    """Hosts in the job: the world size over the ranks of this node (torchrun's
    LOCAL_WORLD_SIZE; 1 host when run alone)."""
    local = env_defaults.local_world_size() or world_size
    return max(1, world_size // max(1, local))


# The reports qwentitan itself writes, so the MLflow artifact tree reads the same for every run.
FIRST_STEP = "first_step"  # the first step's time (compile included) and the CPU fallbacks
HF_EXPORT = "hf_export"  # the last Hugging Face export of the run (runtime.hf_export)
SUMMARY = "summary"  # the figures that end `train` on the console (processor.SummaryLogger)


def attach_report(
    run_dir: str | os.PathLike[str], name: str, report: Mapping[str, Any] | str | os.PathLike[str]
) -> Path:
    """Store `report` (a dict, saved as JSON, or an existing file, copied) as RUN_DIR/reports/<name>."""
    if not name or "/" in name or name.startswith("."):
        raise LaunchError(
            f"Report name {name!r} must be a plain file name such as 'preflight'; drop the slashes."
        )
    folder = Path(run_dir) / REPORTS_FOLDER
    if isinstance(report, Mapping):
        target = folder / (name if name.endswith(".json") else f"{name}.json")
        text = json.dumps(scrubbed(report), indent=2, default=str)
        write_text_atomically(target, without_credentials(text))  # `default=str`'s text too
    else:
        source = Path(report)
        if not source.is_file():
            raise LaunchError(
                f"Report file {source} does not exist; write it first or pass the report as a dict."
            )
        target = folder / (name + source.suffix if not Path(name).suffix else name)
        write_text_atomically(target, source.read_text(encoding="utf-8"))
    for logger in active_loggers():
        if logger.run_dir == Path(run_dir).resolve():
            logger.attach(target)
    return target
