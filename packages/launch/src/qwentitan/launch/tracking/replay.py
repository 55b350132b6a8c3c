"""`sync_run_dir`: replay a run folder's spools into MLflow, adding only what is missing."""

from __future__ import annotations

import contextlib
import dataclasses
import fcntl
import hashlib
import os
import re
import tempfile
from collections.abc import Iterator
from pathlib import Path

from qwentitan.launch.base import env_defaults
from qwentitan.launch.base.errors import LaunchError
from qwentitan.launch.tracking.logger import REPORTS_FOLDER, resolve_tracking_uri
from qwentitan.launch.tracking.spool import SPOOL_FOLDER, find_spools, load_spool
from qwentitan.launch.tracking.store import (
    REQUEST_TIMEOUT_S,
    MlflowTarget,
    Replayed,
    bounded_http_waits,
    replay,
)

# A run whose spool has no `end` record stopped without saying how (killed, crashed, or still
# training); sync-mlflow ends it as FAILED rather than leave it RUNNING for ever.
UNFINISHED_STATUS = "FAILED"


def sync_run_dir(
    run_dir: str | os.PathLike[str], tracking_uri: str | None = None
) -> list[Replayed]:
    """Replay every spool under `run_dir` (or the one spool file given); idempotent.

    The store is `tracking_uri`, else `$MLFLOW_TRACKING_URI`, else the one the run was logging
    to. Reports that appeared in RUN_DIR/reports after a run ended go to the newest run. Damaged
    spool lines are skipped and listed in each result's `damaged_lines`. MLflow gets the bounded
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
                done = replay(targets[uri], records, base, unfinished=UNFINISHED_STATUS)
        except (MlflowException, RequestException) as error:
            raise LaunchError(
                f"MLflow at {uri} cannot be used ({_reason(error)}; each request waits at most "
                f"{REQUEST_TIMEOUT_S} s, retried twice); start the tracking server or pass "
                "--tracking-uri, then run sync-mlflow again (the spool is kept)."
            ) from None
        results.append(dataclasses.replace(done, damaged_lines=loaded.damaged_lines))
    return results


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
    text = str(error)
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
