"""Where built data assets live, and how they are written without ever leaving half a folder."""

from __future__ import annotations

import contextlib
import os
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path

CACHE_ENV = "QWENTITAN_CACHE"


def cache_root() -> Path:
    """$QWENTITAN_CACHE, else $XDG_CACHE_HOME/qwentitan, else ~/.cache/qwentitan."""
    if os.environ.get(CACHE_ENV):
        return Path(os.environ[CACHE_ENV])
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base) / "qwentitan"


@contextlib.contextmanager
def atomic_folder(target: Path) -> Iterator[Path]:
    """Yield a temporary sibling of `target`; rename it into place when the block succeeds.

    Several ranks may build the same cached asset at once: each writes its own temporary folder,
    the first rename wins, and later ones find the (identical) folder already there.
    """
    target = Path(target)
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}.", dir=target.parent))
    try:
        yield tmp
        try:
            os.rename(tmp, target)
        except OSError:
            if not target.is_dir():
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
