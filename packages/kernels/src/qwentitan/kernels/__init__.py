"""qwentitan.kernels: see packages/kernels/README.md for the public API."""

from importlib.metadata import version as _version

__version__ = _version("qwentitan-kernels")

__all__ = ["__version__"]
