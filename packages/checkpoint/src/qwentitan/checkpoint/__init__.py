"""qwentitan.checkpoint: see packages/checkpoint/README.md for the public API."""

from importlib.metadata import version as _version

from qwentitan.checkpoint.convert import to_dcp, to_hf
from qwentitan.checkpoint.errors import CheckpointError
from qwentitan.checkpoint.layout import Qwen3Layout, read_config
from qwentitan.checkpoint.safetensors_io import HFFolder
from qwentitan.checkpoint.verify import ValueDifference, VerifyReport, verify

__version__ = _version("qwentitan-checkpoint")

__all__ = [
    "CheckpointError",
    "HFFolder",
    "Qwen3Layout",
    "ValueDifference",
    "VerifyReport",
    "__version__",
    "read_config",
    "to_dcp",
    "to_hf",
    "verify",
]
