"""The run's own record of everything sent to MLflow: one JSON object per line.

Written before MLflow sees anything, so a slow or absent tracking server loses nothing;
`qwentitan-launch sync-mlflow RUN_DIR` replays it (see `replay.py`). Each line carries a
sequence number `seq`; kinds: `run` (identity, first line), `params`, `tags`, `metrics`
(`step`, `time_ms`, `values`), `artifact` (`file`, `artifact_path`), `end` (`status`).
"""

from __future__ import annotations

import contextlib
import errno
import json
import logging
import os
import socket
import threading
import uuid
from collections import deque
from dataclasses import dataclass
from pathlib import Path, PurePosixPath
from typing import Any, TextIO

from qwentitan.checkpoint.files import bounded_lines, open_regular
from qwentitan.launch.base.errors import LaunchError

log = logging.getLogger(__name__)

# Spools live in RUN_DIR/SPOOL_FOLDER/<time>-<8 hex>.jsonl, one file per training process that
# logged; every start in one run folder (a --resume, a requeue, a spot restart) logs under the
# folder's one run key, kept in SPOOL_FOLDER/RUN_KEY_FILE, so they all continue one MLflow run.
SPOOL_FOLDER = "mlflow_spool"
RUN_KEY_FILE = "run_key"
# The longest spool line read; the longest the logger writes is the params record (at most
# 6,000 characters per value, a few hundred values). A longer line is damaged, never held whole.
MAX_LINE_BYTES = 16 << 20


class SpoolWriter:
    """Appends records, one flushed line each; safe to call from several threads.

    Best-effort, like the MLflow server: a spool that cannot be written (full disk, read-only
    folder) costs one warning and the spool, never a training step. From then on the records
    are kept in memory (the newest `KEPT_IN_MEMORY`) for the live writer's catch-up, which
    reads them through `records()`.
    """

    KEPT_IN_MEMORY = 10_000

    def __init__(self, path: Path) -> None:
        self.path = path
        self.failed: OSError | None = None
        self._lock = threading.Lock()
        self._seq = 0
        self._header: dict[str, Any] | None = None
        self._memory: deque[dict[str, Any]] = deque(maxlen=self.KEPT_IN_MEMORY)
        self._file: TextIO | None = None
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            self._file = path.open("a", encoding="utf-8")
        except OSError as error:
            self._lose(error)

    def write(self, kind: str, **fields: Any) -> dict[str, Any]:
        with self._lock:
            record = {"kind": kind, "seq": self._seq, **fields}
            self._seq += 1
            if self._header is None:
                self._header = record
            if self._file is not None:
                try:
                    # A line is written whole and flushed, so a crash leaves at most one torn
                    # last line.
                    self._file.write(json.dumps(record, separators=(",", ":")) + "\n")
                    self._file.flush()
                    return record
                except OSError as error:
                    self._lose(error)
            self._memory.append(record)
        return record

    def records(self) -> list[dict[str, Any]]:
        """Every record written so far that can still be read: the file's, then memory's."""
        with self._lock:
            memory = list(self._memory)
            header = self._header
        disk: list[dict[str, Any]] = []
        with contextlib.suppress(OSError, LaunchError):
            disk = read_spool(self.path)
        last = disk[-1]["seq"] if disk else -1
        records = disk + [record for record in memory if record["seq"] > last]
        if header is not None and (not records or records[0]["kind"] != "run"):
            records.insert(0, header)
        return records

    def close(self) -> None:
        with self._lock:
            if self._file is not None:
                with contextlib.suppress(OSError):
                    self._file.close()
                self._file = None

    def _lose(self, error: OSError) -> None:
        log.warning(
            "The MLflow spool %s cannot be written (%s); training goes on and MLflow still gets "
            "each record, but sync-mlflow cannot replay what follows.",
            self.path,
            error.strerror or error,
        )
        if self._file is not None:
            with contextlib.suppress(OSError):
                self._file.close()
        self._file = None
        self.failed = error


def folder_run_key(run_dir: Path) -> str:
    """The run key of `run_dir`: made by its first start, read by every later one.

    Created whole and only once (a hard link of a written temporary file fails if another start
    made the file first); a folder logged before the key had its file takes its oldest spool's.
    """
    folder = run_dir / SPOOL_FOLDER
    path = folder / RUN_KEY_FILE
    key = _read_key(path)
    if key is not None:
        return key
    key = _oldest_spool_key(folder) or uuid.uuid4().hex
    temporary = folder / f".{RUN_KEY_FILE}.{os.getpid()}-{uuid.uuid4().hex[:8]}"
    try:
        folder.mkdir(parents=True, exist_ok=True)
        temporary.write_text(key + "\n", encoding="utf-8")
        os.link(temporary, path)
    except FileExistsError as error:
        if error.filename == str(folder):
            return key  # a file where the spool folder goes: the spool warns of it once
        return _read_key(path) or key  # another start made it first: its key is the folder's
    except OSError:
        return key  # best effort, like the spool: this start logs, a later one starts a run
    finally:
        with contextlib.suppress(OSError):
            temporary.unlink()
    return key


def _read_key(path: Path) -> str | None:
    try:
        text = path.read_text(encoding="utf-8").strip()
    except (OSError, UnicodeDecodeError):
        return None
    return text if text and len(text) <= 64 and text.isalnum() else None


def _oldest_spool_key(folder: Path) -> str | None:
    for spool in sorted(folder.glob("*.jsonl"), key=lambda p: p.stat().st_mtime):
        with contextlib.suppress(OSError, LaunchError):
            return str(read_spool(spool)[0]["run_key"])
    return None


def writer_identity() -> dict[str, Any]:
    """Who writes a spool (the run record's `host` and `pid`): `spool_is_live` asks later."""
    return {"host": socket.gethostname(), "pid": os.getpid()}


def spool_is_live(header: dict[str, Any]) -> bool:
    """Whether the process that writes this spool still runs (on this host; a spool from
    another host, or from before the record named its writer, counts as ended)."""
    pid = header.get("pid")
    if header.get("host") != socket.gethostname() or not isinstance(pid, int) or pid <= 0:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except OSError:
        return True  # it exists, owned by someone else
    return True


def abandoned_status(records: list[dict[str, Any]]) -> str:
    """How a run its writer left without an `end` ended: KILLED if it had recorded a stop with
    a checkpoint (the `stop.cause` tag: a later --resume continues it), else FAILED."""
    stopped = any(r["kind"] == "tags" and "stop.cause" in r["tags"] for r in records)
    return "KILLED" if stopped else "FAILED"


def end_abandoned_spool(path: Path) -> str | None:
    """End a spool its writer left without an `end` record (killed with SIGKILL, lost with its
    node): KILLED if it had recorded a stop with a checkpoint (the `stop.cause` tag), else
    FAILED. Returns that status, or None for a spool that ended or whose writer still runs.

    The record is appended (after a newline if the last line was torn) and the file keeps its
    modification time, so the spools' order (oldest first) stays the order they were written.
    """
    try:
        records = read_spool(path)
    except (OSError, LaunchError):
        return None
    if any(record["kind"] == "end" for record in records) or spool_is_live(records[0]):
        return None
    status = abandoned_status(records)
    end = {"kind": "end", "seq": records[-1]["seq"] + 1, "status": status, "abandoned": True}
    try:
        times = path.stat()
        with path.open("rb+") as spool:
            line = json.dumps(end, separators=(",", ":")).encode() + b"\n"
            if spool.seek(0, os.SEEK_END) > 0:
                spool.seek(-1, os.SEEK_END)
                if spool.read(1) != b"\n":
                    line = b"\n" + line  # after a torn last line, not glued to it
            spool.write(line)
        os.utime(path, ns=(times.st_atime_ns, times.st_mtime_ns))
    except OSError as error:
        log.warning("The spool %s cannot be ended (%s).", path, error.strerror or error)
        return None
    return status


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

    A torn last line (no newline: the process died mid-write) is counted as damaged too, so
    sync-mlflow says it was left out. The first line must be the run record, which names the
    run.
    """
    records: list[dict[str, Any]] = []
    damaged: list[int] = []
    try:
        stream = open_regular(path)
    except OSError as error:
        if error.errno != errno.EINVAL:
            raise
        raise LaunchError(
            f"{path} is {error.strerror}; sync-mlflow reads spool files only, move it out of "
            f"{SPOOL_FOLDER}/ and run sync-mlflow again."
        ) from None
    with stream:
        for number, line in enumerate(bounded_lines(stream, MAX_LINE_BYTES), start=1):
            record = _record(line) if line is not None else None
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
    except (ValueError, RecursionError):  # not UTF-8, not JSON, or JSON Python cannot read
        return None
    if not isinstance(record, dict) or not isinstance(record.get("seq"), int):
        return None
    fields = _FIELDS.get(record.get("kind"))
    if fields is None or any(name not in record for name in fields):
        return None
    if any(not isinstance(record[name], dict) for name in _MAPPINGS if name in fields):
        return None
    return record if _sound(record) else None


_STATUSES = ("FINISHED", "FAILED", "KILLED", "RUNNING", "SCHEDULED")
_INT64 = 2**63


def _number(value: Any) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool)


def _scalar(value: Any) -> bool:
    return value is None or isinstance(value, str | int | float)


def _inside(path: Any) -> bool:
    """A relative path that stays inside the folder it is relative to (lexically)."""
    return (
        isinstance(path, str)
        and "\x00" not in path
        and not PurePosixPath(path).is_absolute()
        and ".." not in PurePosixPath(path).parts
    )


def _sound(record: dict[str, Any]) -> bool:
    """Whether the record's values are what MLflow can take and the writer writes: a value that
    is not is the spool's fault, and is reported as such (not as the store refusing it)."""
    kind = record["kind"]
    if kind == "run":
        return isinstance(record["run_key"], str) and isinstance(record["experiment"], str)
    if kind == "metrics":
        step, time_ms = record["step"], record["time_ms"]
        return (
            isinstance(step, int)
            and not isinstance(step, bool)
            and 0 <= step < _INT64
            and isinstance(time_ms, int)
            and 0 <= time_ms < _INT64
            and all(isinstance(k, str) and _number(v) for k, v in record["values"].items())
        )
    if kind in ("params", "tags"):
        return all(_scalar(v) for v in record[kind].values())
    if kind == "artifact":
        # Only files of the run folder are uploaded: never an absolute path or a `..` escape.
        return _inside(record["file"]) and record["file"] != "" and _inside(record["artifact_path"])
    if kind == "end":
        return record["status"] in _STATUSES
    return True


def find_spools(run_dir: Path) -> list[Path]:
    """The spool files of a run folder (or the one file given), oldest first."""
    if run_dir.is_file() or (run_dir.exists() and not run_dir.is_dir()):
        return [run_dir]  # a FIFO or device given by name: `load_spool` says what it is
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
