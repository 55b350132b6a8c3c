"""qwentitan.launch: see packages/launch/README.md for the public API."""

from importlib.metadata import version as _version

__version__ = _version("qwentitan-launch")

__all__ = ["__version__"]
