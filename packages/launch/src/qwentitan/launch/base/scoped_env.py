"""The one place qwentitan.launch writes this process's `os.environ`: for one block, restored
after, for a library that reads a setting nowhere else. Everything else reads the environment
(`env_defaults`) or hands a child process an environment of its own (`launcher.environment`).
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator, Mapping

__all__ = ["hub_offline", "lacking_set"]


@contextlib.contextmanager
def lacking_set(values: Mapping[str, str]) -> Iterator[None]:
    """Set those of `values` this process's environment lacks, for the block; restore after.

    For a library that reads a setting nowhere else (MLflow's HTTP limits, in `sync-mlflow`'s
    own process); the ranks get theirs in their process environment.
    """
    added = {k: v for k, v in values.items() if k not in os.environ}
    os.environ.update(added)
    try:
        yield
    finally:
        for key in added:
            os.environ.pop(key, None)


_OFFLINE_ENV = {"HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1"}


@contextlib.contextmanager
def hub_offline() -> Iterator[None]:
    """Hugging Face Hub and datasets offline for the block, restored after, for preflight's
    dataset check (huggingface_hub reads these at each call;
    datasets reads its own once at import, so its constant is set too)."""
    saved = {name: os.environ.get(name) for name in _OFFLINE_ENV}
    os.environ.update(_OFFLINE_ENV)
    try:
        import datasets.config as datasets_config

        was = datasets_config.HF_HUB_OFFLINE
        datasets_config.HF_HUB_OFFLINE = True
    except ImportError:
        datasets_config = None
    try:
        yield
    finally:
        if datasets_config is not None:
            datasets_config.HF_HUB_OFFLINE = was
        for name, value in saved.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value
