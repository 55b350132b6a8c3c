"""qwentitan.launch: see packages/launch/README.md for the public API."""

from importlib.metadata import version as _version

from qwentitan.launch.platforms import Platform, current_platform, get_platform

__version__ = _version("qwentitan-launch")

__all__ = ["Platform", "__version__", "current_platform", "get_platform"]
