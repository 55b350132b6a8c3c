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


@pytest.fixture
def torchtitan_recipes(monkeypatch):
    """torchtitan's own Qwen3 configs (`torchtitan.models.qwen3.config_registry`) as recipes of
    qwentitan's registry, each re-homed as qwentitan's `Trainer.Config` as the trn2 recipes are:
    the planner checked on recipes qwentitan did not write. Registered for this test only."""
    import dataclasses
    import sys
    import types

    from torchtitan.models.qwen3 import config_registry
    from torchtitan.trainer import Trainer as TorchtitanTrainer

    from qwentitan.launch import recipes
    from qwentitan.launch.runtime.trainer import Trainer

    given = [f.name for f in dataclasses.fields(TorchtitanTrainer.Config) if f.init]
    module = types.ModuleType("qwentitan_test_torchtitan_recipes")

    def rehomed(function):
        def recipe() -> Trainer.Config:
            config = function()
            return Trainer.Config(**{name: getattr(config, name) for name in given})

        return recipe

    names = [n for n in dir(config_registry) if n.startswith("qwen3_")]
    for name in names:
        setattr(module, name, rehomed(getattr(config_registry, name)))
        entry = recipes.Recipe(name, module.__name__, "native")
        monkeypatch.setitem(recipes._RECIPES, name, entry)
    monkeypatch.setitem(sys.modules, module.__name__, module)
    return names
