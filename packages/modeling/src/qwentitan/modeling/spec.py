"""`model_spec(flavor, path)`: one torchtitan ModelSpec per (flavor, implementation path)."""

from __future__ import annotations

import importlib
from pathlib import Path
from typing import Any

from torchtitan.components.optimizer import register_moe_load_balancing_hook
from torchtitan.distributed.pipeline_parallel import pipeline_llm
from torchtitan.models.qwen3 import parallelize_qwen3
from torchtitan.models.qwen3.state_dict_adapter import Qwen3StateDictAdapter
from torchtitan.protocols.model_spec import ModelSpec

from qwentitan.modeling.errors import ModelingError
from qwentitan.modeling.flavors import Flavor, get_flavor
from qwentitan.modeling.hf_config import flavor_from_hf_config
from qwentitan.modeling.native import native_model_config

PATHS = ("native", "hf", "moe-kernels")


def _check_folder_matches(f: Flavor, hf_folder: str | Path) -> None:
    found = flavor_from_hf_config(hf_folder)
    if found.replace(name=f.name, hf_repo=f.hf_repo) != f:
        raise ModelingError(
            f"The model in {hf_folder} is {found.name!r}, not flavor {f.name!r}; pass the "
            f"flavor that folder holds (or flavor_from_hf_config({str(hf_folder)!r}))."
        )


def _native_spec(f: Flavor, attn_backend: str, float32_experts: bool = False) -> ModelSpec:
    return ModelSpec(
        name="qwen3",
        flavor=f.name,
        model=native_model_config(f, attn_backend, float32_experts=float32_experts),
        parallelize_fn=parallelize_qwen3,
        pipelining_fn=pipeline_llm,
        post_optimizer_build_fn=register_moe_load_balancing_hook,
        state_dict_adapter=Qwen3StateDictAdapter,
    )


def _moe_kernels_spec(
    f: Flavor, attn_backend: str, float32_experts: bool, kernels: Any = None
) -> ModelSpec:
    if not f.is_moe:
        raise ModelingError(
            f"The moe-kernels path needs an MoE flavor and {f.name!r} is dense; pick e.g. "
            "qwen3-30b-a3b-4l or tiny-moe, or use path 'native'."
        )
    try:
        importlib.import_module("qwentitan.kernels")
    except ModuleNotFoundError as err:
        if err.name is None or not "qwentitan.kernels".startswith(err.name):
            raise  # qwentitan.kernels is there but itself misses something: show that
        raise ModelingError(
            "The moe-kernels path needs the qwentitan-kernels package, which is not installed; "
            "run: pip install 'qwentitan-modeling[kernels]'."
        ) from None
    # Imported only here: it imports qwentitan.kernels, an optional dependency.
    from qwentitan.modeling.kernel_path import apply_kernel_replacements, default_rules

    spec = _native_spec(f, attn_backend, float32_experts)
    spec.model = apply_kernel_replacements(spec.model, default_rules(choices=kernels))
    return spec


def model_spec(
    flavor: str | Flavor,
    path: str = "native",
    *,
    hf_folder: str | Path | None = None,
    attn_backend: str = "sdpa",
    float32_experts: bool = False,
    kernels: Any = None,
) -> ModelSpec:
    """The torchtitan ModelSpec that trains ``flavor`` through implementation ``path``.

    ``path``: ``"native"`` (torchtitan's Qwen3), ``"hf"`` (transformers' model wrapped for
    torchtitan; loads the safetensors in ``hf_folder`` when given) or ``"moe-kernels"``
    (native MoE with qwentitan.kernels' replacements). ``attn_backend``: ``"sdpa"`` (plain
    causal attention, the only one with a CPU backward), ``"flex"`` or ``"varlen"``.
    ``float32_experts``: torchtitan's MoE experts compute in float32, not bfloat16 (for CPUs;
    the kernel experts and the hf path's already compute in the parameters' dtype).
    ``kernels``: the ``qwentitan.kernels.KernelChoices`` of ``moe-kernels`` (None: from
    ``QWENTITAN_KERNELS``).

    For ``native`` / ``moe-kernels``, ``hf_folder`` is only checked against the flavor: the
    weights load through torchtitan's checkpointer (``initial_load_in_hf``) with the spec's
    ``Qwen3StateDictAdapter``.
    """
    f = get_flavor(flavor)
    if path not in PATHS:
        raise ModelingError(f"Unknown model path {path!r}; choose one of: {', '.join(PATHS)}.")
    if hf_folder is not None:
        _check_folder_matches(f, hf_folder)
    if path == "native":
        return _native_spec(f, attn_backend, float32_experts)
    if path == "moe-kernels":
        return _moe_kernels_spec(f, attn_backend, float32_experts, kernels)
    from qwentitan.modeling.hf_path import hf_model_spec  # transformers' model classes: on demand

    return hf_model_spec(f, hf_folder=hf_folder, attn_backend=attn_backend)
