"""The one reading of a local JSON-lines dataset: the launcher's check and the ranks' loader both
go through `read_documents`, so a line the check passes is a line every rank can take.

A broken line deep in a file would otherwise crash every rank in the middle of training with a
traceback that names neither. The check streams the file line by line and keeps nothing it
parsed: a 1 GiB c4-style file takes about 4 s (measured: `json.loads` per line beat parsing
8 MiB blocks as one JSON array, whose decode, join and list cost more than they saved).

The rules, in this one place: blank lines and documents whose `text` is empty are skipped (they
hold no token to train on: Qwen3 adds no BOS, and the EOS is only ever a target); a line that
is not UTF-8 JSON holding a `text` string, or whose text pyarrow cannot store (a lone UTF-16
surrogate, which Python's `json` accepts), is refused by file and line, and so is a line longer
than `MAX_LINE_BYTES` (read through, never held whole) or one Python's JSON reader cannot
take (nested too deep, an integer of more than 4,300 digits). Only regular files are read: a
FIFO would block the check for ever and a link to /dev/zero is one endless line. A dataset too small for
the run is refused too (`check_dataset`): a slice (training, or the held-out validation one)
that holds no document would otherwise re-loop over nothing forever.
"""

from __future__ import annotations

import contextlib
import gzip
import json
from collections.abc import Iterator
from pathlib import Path
from typing import BinaryIO, Protocol

from qwentitan.checkpoint.files import bounded_lines, open_regular
from qwentitan.launch.base.errors import LaunchError


class _Source(Protocol):
    """What the check reads of a `loader.DataSource` (which imports this module)."""

    name: str
    files: tuple[str, ...]


__all__ = ["check_dataset", "check_json_lines", "minimum_documents", "read_documents"]

_FIX = 'write one {"text": ...} object per line (c4 style), UTF-8'

# The longest line read: 64 times the longest Wikipedia article's wikitext (about 1 MiB); a
# longer line is refused, not held in memory.
MAX_LINE_BYTES = 64 << 20


def minimum_documents(holdout_every: int, *, validating: bool) -> int:
    """Documents a local dataset needs so that its training slice, and (when `validating`) its
    validation slice, hold at least one.

    The loader holds out every `holdout_every`-th document for validation (whether or not
    validation runs); every data-parallel rank reads the whole of each slice (see `loader`), so
    the number of ranks does not matter.
    """
    if holdout_every < 2:
        raise LaunchError(
            f"holdout_every {holdout_every} leaves no training document; pass 2 or more."
        )
    return holdout_every if validating else 1


def check_dataset(source: _Source, *, holdout_every: int = 20, validating: bool = False) -> int:
    """Refuse (LaunchError) the first line of a local source that is not a c4-style document,
    or a source with fewer documents than `minimum_documents(...)` (a slice would be empty);
    returns the number of documents.
    """
    documents = sum(check_json_lines(Path(file)) for file in source.files)
    needed = minimum_documents(holdout_every, validating=validating)
    if documents < needed:
        raise LaunchError(
            f"Dataset {source.name} holds {documents} document(s) but this run needs at least "
            f"{needed} (every {holdout_every}th document is held out for validation); add "
            "documents, or run without validation (`-- --validator.no-enable`)."
        )
    return documents


def check_json_lines(file: Path) -> int:
    """Check every line of `file` (.gz read through gzip); return its number of documents.

    A file without any document is refused.
    """
    documents = sum(1 for _ in read_documents(file))
    if not documents:
        raise LaunchError(f"Dataset file {file} holds no documents; {_FIX}.")
    return documents


def read_documents(file: Path) -> Iterator[str]:
    """The text of each document of `file`, in order, by the rules of the module doc;
    LaunchError naming the file and line for the first line that breaks them."""
    try:
        with _open(file) as stream:
            for number, raw in enumerate(bounded_lines(stream, MAX_LINE_BYTES), start=1):
                if raw is None:
                    raise _bad_line(file, number, f"is longer than {MAX_LINE_BYTES >> 20} MiB")
                text = _document(file, number, raw)
                if text:
                    yield text
    except (OSError, EOFError) as error:  # unreadable, or a damaged .gz
        reason = getattr(error, "strerror", None) or str(error) or type(error).__name__
        raise LaunchError(
            f"Dataset file {file} cannot be read ({reason}); check the file or pass another "
            "{dataset}.",
            field="dataset",
        ) from None


@contextlib.contextmanager
def _open(file: Path) -> Iterator[BinaryIO]:
    with open_regular(file) as raw:
        if file.name.endswith(".gz"):
            with gzip.GzipFile(fileobj=raw, mode="rb") as unzipped:
                yield unzipped  # type: ignore[misc]
        else:
            yield raw


def _document(file: Path, number: int, raw: bytes) -> str:
    """The line's text ("" for a blank line); refuses anything else by its line number."""
    try:
        line = raw.decode("utf-8").rstrip("\r\n")
    except UnicodeDecodeError as error:
        raise _bad_line(
            file, number, f"is not UTF-8 (byte {error.start + 1} of the line)"
        ) from None
    if not line.strip():
        return ""
    try:
        value = json.loads(line)
    except json.JSONDecodeError as error:
        reason = f"{error.msg.removesuffix(' at')} at column {error.colno}"
        raise _bad_line(file, number, f"is not JSON ({reason})") from None
    except RecursionError:
        raise _bad_line(file, number, "nests deeper than Python's JSON reader goes") from None
    except ValueError as error:  # an integer of more than sys.get_int_max_str_digits() digits
        raise _bad_line(file, number, f"is not JSON Python can read ({_first(error)})") from None
    if not isinstance(value, dict) or not isinstance(text := value.get("text"), str):
        raise _bad_line(file, number, "has no `text` string")
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as error:
        raise _bad_line(
            file,
            number,
            f"holds a lone UTF-16 surrogate escape (character {error.start + 1} of its text), "
            "which is not Unicode text",
        ) from None
    return text


def _first(error: Exception) -> str:
    return str(error).split(";")[0].splitlines()[0][:120] if str(error) else type(error).__name__


def _bad_line(file: Path, number: int, what: str) -> LaunchError:
    return LaunchError(f"Dataset file {file} line {number} {what}; {_FIX}.")
