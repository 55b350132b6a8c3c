"""qwentitan.modeling: see packages/modeling/README.md for the public API."""

from importlib.metadata import version as _version

__version__ = _version("qwentitan-modeling")

__all__ = ["__version__"]
