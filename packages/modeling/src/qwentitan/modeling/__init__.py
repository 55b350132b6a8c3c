"""qwentitan.modeling: Qwen3 flavors, their parameter and FLOP counts, and the hf / native /
moe-kernels paths as torchtitan model specs. See packages/modeling/README.md."""

from importlib.metadata import version as _version

from qwentitan.modeling.counts import ParamCounts, flops_per_token, param_counts
from qwentitan.modeling.errors import ModelingError
from qwentitan.modeling.flavors import FLAVORS, Flavor, get_flavor
from qwentitan.modeling.hf_config import flavor_from_hf_config, flavor_to_hf_config
from qwentitan.modeling.init_ops import check_neuron_init, param_init_ops
from qwentitan.modeling.initial_checkpoint import write_initial_checkpoint
from qwentitan.modeling.native import native_model_config
from qwentitan.modeling.spec import PATHS, model_spec

__version__ = _version("qwentitan-modeling")

__all__ = [
    "FLAVORS",
    "PATHS",
    "Flavor",
    "ModelingError",
    "ParamCounts",
    "__version__",
    "check_neuron_init",
    "flavor_from_hf_config",
    "flavor_to_hf_config",
    "flops_per_token",
    "get_flavor",
    "model_spec",
    "native_model_config",
    "param_counts",
    "param_init_ops",
    "write_initial_checkpoint",
]
