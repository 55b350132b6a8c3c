"""qwentitan.checkpoint: see packages/checkpoint/README.md for the public API."""

from importlib.metadata import version as _version

from qwentitan.checkpoint.convert import to_dcp, to_hf
from qwentitan.checkpoint.errors import CheckpointError
from qwentitan.checkpoint.verify import ValueDifference, VerifyReport, verify

__version__ = _version("qwentitan-checkpoint")

__all__ = [
    "CheckpointError",
    "ValueDifference",
    "VerifyReport",
    "__version__",
    "to_dcp",
    "to_hf",
    "verify",
]
