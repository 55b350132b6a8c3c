"""The run's own record of everything sent to MLflow: one JSON object per line.

Written before MLflow sees anything, so a slow or absent tracking server loses nothing;
`qwentitan-launch sync-mlflow RUN_DIR` replays it (see `replay.py`). Each line carries a
sequence number `seq`; kinds: `run` (identity, first line), `params`, `tags`, `metrics`
(`step`, `time_ms`, `values`), `artifact` (`file`, `artifact_path`), `end` (`status`).
"""

from __future__ import annotations

import json
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from qwentitan.launch.base.errors import LaunchError

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


# The fields each kind of record needs; a line without them is damaged (see `load_spool`).
_FIELDS = {
    "run": ("run_key", "experiment"),
    "params": ("params",),
    "tags": ("tags",),
    "metrics": ("step", "time_ms", "values"),
    "artifact": ("file", "artifact_path"),
    "end": ("status",),
}
_MAPPINGS = ("params", "tags", "values")


@dataclass(frozen=True, slots=True)
class Spool:
    """A spool's readable records, and the numbers of the lines that were not."""

    records: list[dict[str, Any]]
    damaged_lines: tuple[int, ...] = ()


def load_spool(path: Path) -> Spool:
    """Every whole, well-formed record of a spool; damaged lines are skipped and counted.

    A torn last line (no newline: the process died mid-write) is left out without counting it:
    nothing of it was ever sent. The first line must be the run record, which names the run.
    """
    lines = path.read_bytes().split(b"\n")
    lines.pop()  # after the last newline: empty, or a torn line
    records: list[dict[str, Any]] = []
    damaged: list[int] = []
    for number, line in enumerate(lines, start=1):
        record = _record(line)
        if record is None:
            damaged.append(number)
        else:
            records.append(record)
    if not records or records[0]["kind"] != "run" or 1 in damaged:
        raise LaunchError(
            f"{path} does not start with a run record, so it is not an MLflow spool written by "
            "qwentitan (or its first line is damaged); point sync-mlflow at a run folder or at "
            "one of its spool files."
        )
    return Spool(records, tuple(damaged))


def read_spool(path: Path) -> list[dict[str, Any]]:
    """The records `load_spool` reads."""
    return load_spool(path).records


def _record(line: bytes) -> dict[str, Any] | None:
    try:
        record = json.loads(line.decode("utf-8"))
    except ValueError:  # not UTF-8, or not JSON
        return None
    if not isinstance(record, dict) or not isinstance(record.get("seq"), int):
        return None
    fields = _FIELDS.get(record.get("kind"))
    if fields is None or any(name not in record for name in fields):
        return None
    if any(not isinstance(record[name], dict) for name in _MAPPINGS if name in fields):
        return None
    return record


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
