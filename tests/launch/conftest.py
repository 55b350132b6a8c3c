"""Fixtures of the launch tests."""

from __future__ import annotations

import contextlib
import subprocess
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest


@contextlib.contextmanager
def _mounted_tmpfs(folder: Path, size: str) -> Iterator[Path]:
    folder.mkdir()
    mounted = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(folder)], capture_output=True
    )
    if mounted.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {mounted.stderr.decode().strip()}")
    try:
        yield folder
    finally:
        subprocess.run(["umount", str(folder)], check=True)


@pytest.fixture
def small_tmpfs() -> Callable[[Path, str], contextlib.AbstractContextManager[Path]]:
    """`with small_tmpfs(folder, "8m") as disk:` a tmpfs of that size mounted on `folder` (a
    small full disk; you are root in CI), unmounted after; skips where mounting is not permitted."""
    return _mounted_tmpfs
