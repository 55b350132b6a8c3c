"""qwentitan.checkpoint: see packages/checkpoint/README.md for the public API."""

from importlib.metadata import version as _version

__version__ = _version("qwentitan-checkpoint")

__all__ = ["__version__"]
