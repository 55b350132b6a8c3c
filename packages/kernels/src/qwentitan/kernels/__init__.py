"""qwentitan.kernels: see packages/kernels/README.md for the public API."""

from importlib.metadata import version as _version

from qwentitan.kernels.attention import causal_attention
from qwentitan.kernels.choices import KERNEL_CHOICES_ENV, KernelChoices
from qwentitan.kernels.errors import KernelError
from qwentitan.kernels.experts import block_routing, grouped_experts, num_blocks
from qwentitan.kernels.nki_loader import MIN_NKI_LIBRARY, import_torch_neuronx, launch_route
from qwentitan.kernels.numerics import KernelCheck, NumericsReport, check_kernels, numerics_report
from qwentitan.kernels.registry import ReplacementRule, apply_replacements, config_paths
from qwentitan.kernels.rope import rope

__version__ = _version("qwentitan-kernels")

__all__ = [
    "KERNEL_CHOICES_ENV",
    "MIN_NKI_LIBRARY",
    "KernelCheck",
    "KernelChoices",
    "KernelError",
    "NumericsReport",
    "ReplacementRule",
    "__version__",
    "apply_replacements",
    "block_routing",
    "causal_attention",
    "check_kernels",
    "config_paths",
    "grouped_experts",
    "import_torch_neuronx",
    "launch_route",
    "num_blocks",
    "numerics_report",
    "rope",
]
