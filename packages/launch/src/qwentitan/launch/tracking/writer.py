"""A background thread that feeds MLflow from the spool's records, so training never waits on it.

The training thread only appends to the spool and drops the record into a bounded queue; it
never blocks on MLflow, even when the server hangs. When MLflow fails, the writer stops
sending, and after `retry_after_s` catches up by replaying the spool (idempotent), so a blip
costs nothing and an outage leaves the spool for `sync-mlflow`.
"""

from __future__ import annotations

import contextlib
import logging
import queue
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from qwentitan.launch.tracking.spool import read_spool
from qwentitan.launch.tracking.store import MlflowTarget, Point, replay, without_credentials

log = logging.getLogger(__name__)

_STOP: dict[str, Any] = {"kind": "stop", "seq": -1}
_BATCH = 256  # records drained into one log_batch call


class BackgroundWriter:
    def __init__(
        self,
        tracking_uri: str,
        spool_path: Path,
        run_dir: Path,
        retry_after_s: float = 60.0,
        max_queued: int = 100_000,
        records: Callable[[], list[dict[str, Any]]] | None = None,
    ) -> None:
        self.tracking_uri = tracking_uri
        self.spool_path = spool_path
        self.run_dir = run_dir
        self.retry_after_s = retry_after_s
        # What a catch-up replays: the spool file, or (from the logger) its SpoolWriter's records,
        # which outlive a spool that could not be written.
        self._records = records or (lambda: read_spool(spool_path))
        self.run_id: str | None = None
        self.experiment_id: str | None = None
        self.error: BaseException | None = None
        self.sent_seq = -1  # every record up to this sequence number is in MLflow
        self._queue: queue.Queue[dict[str, Any]] = queue.Queue(maxsize=max_queued)
        self._online = False
        self._failed_at = float("-inf")
        self._thread = threading.Thread(target=self._run, name="qwentitan-mlflow", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def send(self, record: dict[str, Any]) -> None:
        """Never blocks: a full queue drops the record, which the spool already holds."""
        with contextlib.suppress(queue.Full):
            self._queue.put_nowait(record)

    def finish(self, timeout_s: float) -> bool:
        """Flush and stop, waiting at most `timeout_s`; True if MLflow holds every record."""
        try:
            self._queue.put(_STOP, timeout=timeout_s)
        except queue.Full:
            return False
        self._thread.join(timeout_s)
        return not self._thread.is_alive() and self._online

    def _run(self) -> None:
        target: MlflowTarget | None = None
        while True:
            batch = [self._queue.get()]
            while batch[-1] is not _STOP and len(batch) < _BATCH:
                try:
                    batch.append(self._queue.get_nowait())
                except queue.Empty:
                    break
            stopping = batch[-1] is _STOP
            pending = [r for r in batch if r is not _STOP and r["seq"] > self.sent_seq]
            try:
                if not self._online and (stopping or self._may_retry()):
                    target = target or MlflowTarget(self.tracking_uri)
                    self._catch_up(target)
                    pending = [r for r in pending if r["seq"] > self.sent_seq]
                if self._online and pending:
                    assert target is not None
                    self._send(target, pending)
            except Exception as error:
                self._fail(error)
            if stopping:
                return

    def _may_retry(self) -> bool:
        return time.monotonic() - self._failed_at >= self.retry_after_s

    def _catch_up(self, target: MlflowTarget) -> None:
        """Replay the spool so far: creates the run the first time, fills any gap after a failure."""
        # This start trains now: a run an earlier start in the folder ended is RUNNING again.
        done = replay(target, self._records(), self.run_dir, reopen=True)
        self.run_id = done.run_id
        self.experiment_id = done.experiment_id
        self.sent_seq = done.last_seq
        if self.error is not None:
            log.warning(
                "MLflow at %s is reachable again; the gap was filled.",
                without_credentials(self.tracking_uri),
            )
            self.error = None
        self._online = True

    def _send(self, target: MlflowTarget, records: list[dict[str, Any]]) -> None:
        assert self.run_id is not None
        points: list[Point] = []
        params: dict[str, str] = {}
        tags: dict[str, str] = {}
        for record in records:
            kind = record["kind"]
            if kind == "metrics":
                points += [
                    (k, v, record["time_ms"], record["step"]) for k, v in record["values"].items()
                ]
            elif kind == "params":
                params.update(record["params"])
            elif kind == "tags":
                tags.update(record["tags"])
        target.log(self.run_id, points, params, tags)
        for record in records:
            if record["kind"] == "artifact":
                file = Path(record["file"])
                target.log_artifact(self.run_id, self.run_dir / file, record["artifact_path"])
            elif record["kind"] == "end":
                target.end(self.run_id, record["status"], record.get("end_ms"))
        self.sent_seq = records[-1]["seq"]

    def _fail(self, error: BaseException) -> None:
        if self.error is None:
            log.warning(
                "MLflow at %s failed (%s: %s); training goes on and every metric stays in %s. "
                "Replay it later with `qwentitan-launch sync-mlflow %s`.",
                without_credentials(self.tracking_uri),
                type(error).__name__,
                without_credentials(str(error).splitlines()[0])[:200] if str(error) else "",
                self.spool_path,
                self.run_dir,
            )
        self.error = error
        self._online = False
        self._failed_at = time.monotonic()
