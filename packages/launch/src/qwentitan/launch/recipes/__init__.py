"""Recipes: torchtitan config-registry functions (`--module qwentitan.launch.recipes`)."""

from qwentitan.launch.recipes.trn2 import (
    TRN2_RECIPES,
    qwen3_4b_hf,
    qwen3_4b_native,
    qwen3_moe_kernels,
)

__all__ = ["TRN2_RECIPES", "qwen3_4b_hf", "qwen3_4b_native", "qwen3_moe_kernels"]
