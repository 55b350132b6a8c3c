"""The run's own record of everything sent to MLflow: one JSON object per line.

Written before MLflow sees anything, so a slow or absent tracking server loses nothing;
`qwentitan-launch sync-mlflow RUN_DIR` replays it (see `replay.py`). Each line carries a
sequence number `seq`; kinds: `run` (identity, first line), `params`, `tags`, `metrics`
(`step`, `time_ms`, `values`), `artifact` (`file`, `artifact_path`), `end` (`status`).
"""

from __future__ import annotations

import json
import threading
from pathlib import Path
from typing import Any

from qwentitan.launch.errors import LaunchError

# Spools live in RUN_DIR/SPOOL_FOLDER/<run key>.jsonl, one file per training process that logged.
SPOOL_FOLDER = "mlflow_spool"


class SpoolWriter:
    """Appends records, one flushed line each; safe to call from several threads."""

    def __init__(self, path: Path) -> None:
        self.path = path
        path.parent.mkdir(parents=True, exist_ok=True)
        self._file = path.open("a", encoding="utf-8")
        self._lock = threading.Lock()
        self._seq = 0

    def write(self, kind: str, **fields: Any) -> dict[str, Any]:
        with self._lock:
            record = {"kind": kind, "seq": self._seq, **fields}
            self._seq += 1
            # A line is written whole and flushed, so a crash leaves at most one torn last line.
            self._file.write(json.dumps(record, separators=(",", ":")) + "\n")
            self._file.flush()
        return record

    def close(self) -> None:
        with self._lock:
            self._file.close()


def read_spool(path: Path) -> list[dict[str, Any]]:
    """Every complete record of a spool; a torn last line (crash mid-write) is left out."""
    records = []
    lines = path.read_text(encoding="utf-8").splitlines()
    for number, line in enumerate(lines, start=1):
        try:
            records.append(json.loads(line))
        except json.JSONDecodeError:
            if number == len(lines):
                break
            raise LaunchError(
                f"Line {number} of the MLflow spool {path} is not JSON; the file was edited or "
                "damaged, so restore it or remove that line and run sync-mlflow again."
            ) from None
    if not records or records[0].get("kind") != "run":
        raise LaunchError(
            f"{path} does not start with a run record, so it is not an MLflow spool written by "
            "qwentitan; point sync-mlflow at a run folder or at one of its spool files."
        )
    return records


def find_spools(run_dir: Path) -> list[Path]:
    """The spool files of a run folder (or the one file given), oldest first."""
    if run_dir.is_file():
        return [run_dir]
    if not run_dir.is_dir():
        raise LaunchError(
            f"{run_dir} does not exist; give sync-mlflow the training run's folder "
            "(its dump_folder) or a spool file in it."
        )
    spools = sorted((run_dir / SPOOL_FOLDER).glob("*.jsonl"), key=lambda p: p.stat().st_mtime)
    if not spools:
        raise LaunchError(
            f"{run_dir} holds no {SPOOL_FOLDER}/*.jsonl, so nothing was logged there; check that "
            "the path is the run's dump_folder and that MLflow tracking was enabled."
        )
    return spools
