"""qwentitan.checkpoint: see packages/checkpoint/README.md for the public API."""

from importlib import import_module
from importlib.metadata import version as _version

__version__ = _version("qwentitan-checkpoint")

# Everything is imported on first use, so that `import qwentitan.checkpoint.files` (the launcher
# reaches it before torch) and the CLI's parser never pay for torch.
_LAZY = {
    "CheckpointError": "qwentitan.checkpoint.errors",
    "HFFolder": "qwentitan.checkpoint.safetensors_io",
    "MetadataUnpickler": "qwentitan.checkpoint.dcp_metadata",
    "Qwen3Layout": "qwentitan.checkpoint.layout",
    "SafeFileSystemReader": "qwentitan.checkpoint.safe_reader",
    "ValueDifference": "qwentitan.checkpoint.verification",
    "VerifyReport": "qwentitan.checkpoint.verification",
    "read_config": "qwentitan.checkpoint.layout",
    "read_dcp_metadata": "qwentitan.checkpoint.dcp_metadata",
    "safe_reader_for": "qwentitan.checkpoint.safe_reader",
    "to_dcp": "qwentitan.checkpoint.convert",
    "to_hf": "qwentitan.checkpoint.convert",
    "verify": "qwentitan.checkpoint.verification",
}

__all__ = ["__version__", *sorted(_LAZY)]


def __getattr__(name: str):
    if name in _LAZY:
        return getattr(import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'qwentitan.checkpoint' has no attribute {name!r}")
