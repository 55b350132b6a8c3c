"""Check every line of local JSON-lines datasets before any rank starts, naming file and line.

A broken line deep in a file would otherwise crash every rank in the middle of training with a
traceback that names neither. The check streams the file line by line and keeps nothing it
parsed: a 1 GiB c4-style file takes about 4 s (measured: `json.loads` per line beat parsing
8 MiB blocks as one JSON array, whose decode, join and list cost more than they saved).
"""

from __future__ import annotations

import gzip
import json
from pathlib import Path
from typing import BinaryIO

from qwentitan.launch.base.errors import LaunchError
from qwentitan.launch.runtime.data.loader import DataSource

__all__ = ["check_dataset", "check_json_lines"]

_FIX = 'write one {"text": ...} object per line (c4 style), UTF-8'


def check_dataset(source: DataSource) -> None:
    """Refuse (LaunchError) the first line of a local source that is not a c4-style document."""
    for file in source.files:
        check_json_lines(Path(file))


def check_json_lines(file: Path) -> int:
    """Check that every line of `file` (.gz read through gzip) is UTF-8 JSON with a string `text`.

    Blank lines are allowed. Returns the number of documents; a file without any is refused.
    """
    documents = 0
    try:
        with _open(file) as stream:
            for number, raw in enumerate(stream, start=1):
                documents += _check_line(file, number, raw)
    except (OSError, EOFError) as error:  # unreadable, or a damaged .gz
        reason = getattr(error, "strerror", None) or str(error) or type(error).__name__
        raise LaunchError(
            f"Dataset file {file} cannot be read ({reason}); check the file or pass another "
            "--dataset."
        ) from None
    if not documents:
        raise LaunchError(f"Dataset file {file} holds no documents; {_FIX}.")
    return documents


def _open(file: Path) -> BinaryIO:
    return gzip.open(file, "rb") if file.name.endswith(".gz") else open(file, "rb")


def _check_line(file: Path, number: int, raw: bytes) -> int:
    """1 for a document, 0 for a blank line; refuses anything else by its line number."""
    try:
        text = raw.decode("utf-8").rstrip("\r\n")
    except UnicodeDecodeError as error:
        raise _bad_line(
            file, number, f"is not UTF-8 (byte {error.start + 1} of the line)"
        ) from None
    try:
        value = json.loads(text)
    except json.JSONDecodeError as error:
        if not text.strip():
            return 0
        reason = f"{error.msg.removesuffix(' at')} at column {error.colno}"
        raise _bad_line(file, number, f"is not JSON ({reason})") from None
    if not isinstance(value, dict) or not isinstance(value.get("text"), str):
        raise _bad_line(file, number, "has no `text` string")
    return 1


def _bad_line(file: Path, number: int, what: str) -> LaunchError:
    return LaunchError(f"Dataset file {file} line {number} {what}; {_FIX}.")
