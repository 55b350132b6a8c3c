"""The MLflow side of tracking: find-or-create a run by its key, log to it, replay a spool.

Used by the background writer during training and by `sync-mlflow` afterwards
(`sync_run_dir`). A run is found by its `qwentitan.run_key` tag, never by name, so replaying a
spool twice (or after a live session that got half-way) adds each metric point, parameter and
artifact at most once.
"""

from __future__ import annotations

import contextlib
import dataclasses
import fcntl
import hashlib
import os
import re
import tempfile
import time
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from qwentitan.launch.base import env_defaults, scoped_env
from qwentitan.launch.base.errors import LaunchError
from qwentitan.launch.tracking.spool import (
    SPOOL_FOLDER,
    abandoned_status,
    end_abandoned_spool,
    find_spools,
    load_spool,
    spool_is_live,
)

# The folder of a run's reports (RUN_DIR/reports), attached to its MLflow run.
REPORTS_FOLDER = "reports"
# Why a run stopped before its last step (a deadline, a spot notice, a signal): `reports/stop.json`.
STOP = "stop"

RUN_KEY_TAG = "qwentitan.run_key"
PARENT_TAG = "mlflow.parentRunId"
# What MLflow 3.x calls a training experiment, as against a GenAI one. MLflow 3.17's UI still
# opens any experiment on its GenAI traces overview unless the URL asks for its model-training
# view (`workflowType=machine_learning`, as the pilot's URLs do). An experiment that already
# says what it is keeps its kind.
EXPERIMENT_KIND_TAG = "mlflow.experimentKind"
MODEL_TRAINING = "custom_model_development"

# MLflow's log_batch limits (mlflow.utils.validation.MAX_METRICS_PER_BATCH and friends).
_METRICS_PER_BATCH = 1000
_PARAMS_PER_BATCH = 100
_TAGS_PER_BATCH = 100

Point = tuple[str, float, int, int]  # key, value, time in ms, step

# MLflow's own HTTP defaults (120 s per request, 7 retries, backoff factor 2) keep an unreachable
# server busy for about four minutes per call; training and sync-mlflow both give up sooner.
REQUEST_TIMEOUT_S = 10


def resolve_tracking_uri(configured: str | None = None) -> str:
    """The given URI, else the default: `$MLFLOW_TRACKING_URI`, else `<cwd>/mlflow.db`."""
    return configured or env_defaults.tracking_uri()


# `scheme://` then the address's user and password up to its last `@` before the host ends
# (a password may hold a raw `@`; urllib splits there too).
_USERINFO = re.compile(r"([A-Za-z][A-Za-z0-9+.\-]*://)[^/?#\s'\"<>@]*(?:@[^/?#\s'\"<>@]*)*@")


def without_credentials(text: str) -> str:
    """`text` with the user and password taken out of every address in it:
    `http://user:pw@host/` -> `http://host/`. The one filter for whatever shows or stores a
    tracking URI (console, spool, resolved config, reports, MLflow params and tags); only the
    MLflow client itself gets the address as given."""
    return _USERINFO.sub(r"\1", text)


def scrubbed(value: Any) -> Any:
    """A copy of a JSON-like `value` (dicts, lists, tuples, strings) with `without_credentials`
    applied to every string in it, keys included."""
    if isinstance(value, str):
        return without_credentials(value)
    if isinstance(value, Mapping):
        return {scrubbed(k): scrubbed(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [scrubbed(v) for v in value]
    return value


def bounded_http(timeout_s: int = REQUEST_TIMEOUT_S) -> dict[str, str]:
    """The MLflow environment that bounds one request to `timeout_s` and two quick retries."""
    return {
        "MLFLOW_HTTP_REQUEST_TIMEOUT": str(timeout_s),
        "MLFLOW_HTTP_REQUEST_MAX_RETRIES": "2",
        "MLFLOW_HTTP_REQUEST_BACKOFF_FACTOR": "1",
    }


def bounded_http_waits(timeout_s: int = REQUEST_TIMEOUT_S) -> contextlib.AbstractContextManager:
    """Apply `bounded_http` where the user has not set these variables; restore them after."""
    return scoped_env.lacking_set(bounded_http(timeout_s))


class MlflowTarget:
    """One tracking store, reached through `MlflowClient` (imported here, off the training path)."""

    def __init__(self, tracking_uri: str) -> None:
        from mlflow import MlflowClient

        self.tracking_uri = tracking_uri
        self.client = MlflowClient(tracking_uri=tracking_uri)

    def open_run(self, header: dict[str, Any], *, reopen: bool = False) -> str:
        """The run with this spool's key, created (in its experiment, under its parent) if absent.

        Every start in one run folder has the folder's key, so a --resume finds the run an
        earlier start made; with `reopen` (a start that trains now) an ended run is RUNNING
        again. MLflow 3.x takes metrics, params and tags into a FINISHED or KILLED run (only a
        deleted one is refused: that one is not found here, and a new run takes the key).
        """
        experiment_id = self._experiment_id(header["experiment"])
        found = self.client.search_runs(
            [experiment_id],
            filter_string=f"tags.`{RUN_KEY_TAG}` = '{header['run_key']}'",
            max_results=1,
        )
        if found:
            run = found[0].info
            if reopen and run.status != "RUNNING":
                self.client.update_run(run.run_id, status="RUNNING")
            return run.run_id
        tags = {RUN_KEY_TAG: header["run_key"]}
        if header.get("parent_run_id"):
            tags[PARENT_TAG] = header["parent_run_id"]
        run = self.client.create_run(
            experiment_id,
            start_time=header.get("start_ms"),
            tags=tags,
            run_name=header.get("run_name"),
        )
        return run.info.run_id

    def _experiment_id(self, name: str) -> str:
        experiment = self.client.get_experiment_by_name(name)
        if experiment is not None:
            if EXPERIMENT_KIND_TAG not in experiment.tags:
                self.client.set_experiment_tag(
                    experiment.experiment_id, EXPERIMENT_KIND_TAG, MODEL_TRAINING
                )
            return experiment.experiment_id
        try:
            return self.client.create_experiment(name, tags={EXPERIMENT_KIND_TAG: MODEL_TRAINING})
        except Exception:
            # Another process created it between our lookup and create_experiment.
            experiment = self.client.get_experiment_by_name(name)
            if experiment is None:
                raise
            return experiment.experiment_id

    def log(
        self,
        run_id: str,
        points: Sequence[Point] = (),
        params: dict[str, str] | None = None,
        tags: dict[str, str] | None = None,
    ) -> None:
        from mlflow.entities import Metric, Param, RunTag

        metrics = [Metric(k, float(v), int(t), int(s)) for k, v, t, s in points]
        for start in range(0, len(metrics), _METRICS_PER_BATCH):
            self.client.log_batch(run_id, metrics=metrics[start : start + _METRICS_PER_BATCH])
        param_list = [Param(k, v) for k, v in (params or {}).items()]
        for start in range(0, len(param_list), _PARAMS_PER_BATCH):
            self.client.log_batch(run_id, params=param_list[start : start + _PARAMS_PER_BATCH])
        tag_list = [RunTag(k, str(v)) for k, v in (tags or {}).items()]
        for start in range(0, len(tag_list), _TAGS_PER_BATCH):
            self.client.log_batch(run_id, tags=tag_list[start : start + _TAGS_PER_BATCH])

    def log_artifact(self, run_id: str, file: Path, artifact_path: str) -> None:
        self.client.log_artifact(run_id, str(file), artifact_path)

    def end(self, run_id: str, status: str, end_ms: int | None) -> None:
        self.client.set_terminated(run_id, status=status, end_time=end_ms)


@dataclass(frozen=True, slots=True)
class Replayed:
    run_id: str
    points_added: int
    points_present: int
    params_added: int
    artifacts_added: int
    last_seq: int
    status: str | None = None  # the status the run was ended with; None: left as it was
    damaged_lines: tuple[int, ...] = ()  # spool lines that could not be read (see load_spool)
    experiment_id: str | None = None  # the run's experiment (the UI's links need it)


def replay(
    target: MlflowTarget,
    records: Sequence[dict[str, Any]],
    base: Path,
    *,
    unfinished: str | None = None,
    reopen: bool = False,
) -> Replayed:
    """Send a spool's records to `target`, skipping whatever the run already holds.

    A spool without an `end` record ends its run with status `unfinished` when one is given
    (sync-mlflow: the training is over, so the run must not stay RUNNING); the live writer
    passes none while training still runs, and `reopen`: its run is RUNNING again.
    """
    header = records[0]
    run_id = target.open_run(header, reopen=reopen)
    run = target.client.get_run(run_id)

    points: dict[tuple[str, int], Point] = {}
    params: dict[str, str] = {}
    tags: dict[str, str] = {}
    artifacts: list[tuple[Path | None, str]] = []
    end: dict[str, Any] | None = None
    for record in records[1:]:
        kind = record["kind"]
        if kind == "metrics":
            for key, value in record["values"].items():
                points[(key, record["step"])] = (key, value, record["time_ms"], record["step"])
        elif kind == "params":
            params.update(record["params"])
        elif kind == "tags":
            tags.update(record["tags"])
        elif kind == "artifact":
            artifacts.append((_resolve(base, record["file"]), record["artifact_path"]))
        elif kind == "end":
            end = record

    present = _present_points(target, run_id, {key for key, _ in points})
    missing = [point for where, point in points.items() if where not in present]
    new_params = {k: v for k, v in params.items() if k not in run.data.params}
    target.log(run_id, missing, new_params, tags)
    added = 0
    for file, artifact_path in artifacts:
        if file is None:
            continue  # a link leading out of the run folder: never uploaded
        if file.is_file() and not _has_artifact(target, run_id, artifact_path, file.name):
            target.log_artifact(run_id, file, artifact_path)
            added += 1
    status = end["status"] if end is not None else unfinished
    if status is not None:
        target.end(run_id, status, end.get("end_ms") if end is not None else None)
    return Replayed(
        run_id=run_id,
        points_added=len(missing),
        points_present=len(points) - len(missing),
        params_added=len(new_params),
        artifacts_added=added,
        last_seq=records[-1]["seq"],
        status=status,
        experiment_id=run.info.experiment_id,
    )


def _present_points(target: MlflowTarget, run_id: str, keys: Iterable[str]) -> set[tuple[str, int]]:
    present = set()
    for key in keys:
        for metric in target.client.get_metric_history(run_id, key):
            present.add((key, metric.step))
    return present


def _has_artifact(target: MlflowTarget, run_id: str, artifact_path: str, name: str) -> bool:
    listed = target.client.list_artifacts(run_id, artifact_path or None)
    wanted = f"{artifact_path}/{name}" if artifact_path else name
    return any(info.path == wanted for info in listed)


def _resolve(base: Path, file: str) -> Path | None:
    """`file` (relative to the run folder `base`), or None unless it is inside `base` with its
    links followed (the spool's own check refuses absolute paths and `..`)."""
    path = base / file
    try:
        inside = path.resolve().is_relative_to(base.resolve())
    except (OSError, RuntimeError):  # a link loop
        return None
    return path if inside else None


def now_ms() -> int:
    return int(time.time() * 1000)


def sync_run_dir(
    run_dir: str | os.PathLike[str], tracking_uri: str | None = None
) -> list[Replayed]:
    """Replay every spool under `run_dir` (or the one spool file given); idempotent.

    The store is `tracking_uri`, else `$MLFLOW_TRACKING_URI`, else the one the run was logging
    to. Reports that appeared in RUN_DIR/reports after a run ended go to the newest run. Damaged
    spool lines are skipped and listed in each result's `damaged_lines`. A spool without an
    `end` record whose writer is gone ends its run KILLED (it had recorded a stop) or FAILED,
    never left RUNNING; one whose writer still runs on this host is left to it. MLflow gets the bounded
    HTTP waits training uses; a store that does not answer is a LaunchError.
    """
    from mlflow.exceptions import MlflowException
    from requests import RequestException

    spools = find_spools(Path(run_dir))
    results = []
    targets: dict[str, MlflowTarget] = {}
    for number, spool in enumerate(spools):
        loaded = load_spool(spool)
        records = loaded.records
        # A spool whose writer still trains is left RUNNING (its writer ends it); one whose
        # writer died ends KILLED or FAILED (`abandoned_status`), the spool left as it is.
        unfinished = None if spool_is_live(records[0]) else abandoned_status(records)
        base = spool.parent.parent if spool.parent.name == SPOOL_FOLDER else spool.parent
        uri = resolve_tracking_uri(
            tracking_uri or env_defaults.configured_tracking_uri() or records[0].get("tracking_uri")
        )
        if number == len(spools) - 1:
            records = records + _late_reports(records, base)
        try:
            with bounded_http_waits(), _one_writer(uri):
                if uri not in targets:
                    targets[uri] = MlflowTarget(uri)
                done = replay(targets[uri], records, base, unfinished=unfinished)
        except (MlflowException, RequestException) as error:
            raise LaunchError(
                f"MLflow at {without_credentials(uri)} cannot be used ({_reason(error)}; each "
                f"request waits at most "
                f"{REQUEST_TIMEOUT_S} s, retried twice); start the tracking server or pass "
                "--tracking-uri, then run sync-mlflow again (the spool is kept)."
            ) from None
        results.append(dataclasses.replace(done, damaged_lines=loaded.damaged_lines))
    return results


def end_abandoned_runs(
    run_dir: str | os.PathLike[str], tracking_uri: str | None = None
) -> list[str]:
    """End the MLflow run of every spool in `run_dir` whose writer died without ending it
    (SIGKILL, a lost node): its spool gets an `end` record (KILLED if it had recorded a stop
    with a checkpoint, else FAILED), what MLflow lacks is sent, and, when it is the folder's
    newest spool, the run takes that status. Returns one line per such spool for the Summary of
    the command that called it (`train`, `--resume`, `sync-mlflow`); none when nothing was
    left. Never raises for MLflow: a store that does not answer is said in the line, and the
    spool keeps everything for `sync-mlflow`.
    """
    base = Path(run_dir)
    if not any((base / SPOOL_FOLDER).glob("*.jsonl")):
        return []
    spools = find_spools(base)
    lines = []
    for spool in spools:
        status = end_abandoned_spool(spool)
        if status is None:
            continue
        # Imported only now: a launcher whose folder holds nothing to end never loads MLflow.
        from mlflow.exceptions import MlflowException
        from requests import RequestException

        records = load_spool(spool).records
        if spool != spools[-1]:
            # A later start already logged to the run: its status is the run's, not this one's.
            records = [record for record in records if record["kind"] != "end"]
        header = records[0]
        uri = resolve_tracking_uri(
            tracking_uri or env_defaults.configured_tracking_uri() or header.get("tracking_uri")
        )
        said = f"an earlier start ({header.get('run_name') or spool.name}) ended without closing its MLflow run"
        try:
            with bounded_http_waits(), _one_writer(uri):
                done = replay(MlflowTarget(uri), records, base)
        except (MlflowException, RequestException, OSError) as error:
            lines.append(
                f"{said}; its spool {spool.name} now says {status}, but MLflow at "
                f"{without_credentials(uri)} could not be reached ({_reason(error)}): run "
                f"`qwentitan-launch sync-mlflow {base}`"
            )
            continue
        ended = f"ended as {status}" if done.status else "left to the later start's status"
        lines.append(f"{said}: MLflow run {done.run_id} {ended} ({done.points_added} points sent)")
    return lines


@contextlib.contextmanager
def _one_writer(uri: str) -> Iterator[None]:
    """Hold a lock per local store (sqlite or a folder) while replaying into it: two sync-mlflow
    at once into a new sqlite store would both create its tables and one would fail. The lock
    file is in the temporary folder, so nothing is added beside the user's store."""
    if "://" in uri and not uri.startswith(("sqlite:", "file:")):
        yield  # a tracking server orders its own writes
        return
    name = hashlib.sha256(uri.encode()).hexdigest()[:16]
    with open(Path(tempfile.gettempdir()) / f"qwentitan-mlflow-{name}.lock", "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)


def _reason(error: Exception) -> str:
    """A few words for what went wrong (MLflow's own text runs to several lines)."""
    text = without_credentials(str(error))
    if code := re.search(r"error code (\d+)", text):
        return f"it answered HTTP {code.group(1)}"
    for words, reason in (
        ("Connection refused", "connection refused"),
        ("timed out", "timed out"),
        ("Name or service not known", "unknown host"),
        ("Max retries exceeded", "no connection"),
    ):
        if words in text:
            return reason
    return text.splitlines()[0][:120] if text else type(error).__name__


def _late_reports(records: list[dict], base: Path) -> list[dict]:
    known = {record["file"] for record in records if record["kind"] == "artifact"}
    late = []
    seq = records[-1]["seq"]
    for report in sorted((base / REPORTS_FOLDER).glob("*")):
        relative = os.path.relpath(report, base)
        if report.is_file() and relative not in known:
            late.append(
                {"kind": "artifact", "seq": seq, "file": relative, "artifact_path": REPORTS_FOLDER}
            )
    return late
