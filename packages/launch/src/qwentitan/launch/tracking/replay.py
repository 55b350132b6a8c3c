"""`sync_run_dir`: replay a run folder's spools into MLflow, adding only what is missing."""

from __future__ import annotations

import os
from pathlib import Path

from qwentitan.launch.tracking.logger import REPORTS_FOLDER, resolve_tracking_uri
from qwentitan.launch.tracking.spool import SPOOL_FOLDER, find_spools, read_spool
from qwentitan.launch.tracking.store import MlflowTarget, Replayed, replay


def sync_run_dir(
    run_dir: str | os.PathLike[str], tracking_uri: str | None = None
) -> list[Replayed]:
    """Replay every spool under `run_dir` (or the one spool file given); idempotent.

    The store is `tracking_uri`, else `$MLFLOW_TRACKING_URI`, else the one the run was logging
    to. Reports that appeared in RUN_DIR/reports after a run ended go to the newest run.
    """
    spools = find_spools(Path(run_dir))
    results = []
    targets: dict[str, MlflowTarget] = {}
    for number, spool in enumerate(spools):
        records = read_spool(spool)
        base = spool.parent.parent if spool.parent.name == SPOOL_FOLDER else spool.parent
        uri = tracking_uri or os.environ.get("MLFLOW_TRACKING_URI") or records[0]["tracking_uri"]
        uri = resolve_tracking_uri(uri)
        if uri not in targets:
            targets[uri] = MlflowTarget(uri)
        target = targets[uri]
        if number == len(spools) - 1:
            records = records + _late_reports(records, base)
        results.append(replay(target, records, base))
    return results


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
