"""Recipes: functions returning a torchtitan `Trainer.Config`.

Use them through `qwentitan-launch train --recipe NAME` (tiny, this machine),
`qwentitan-launch run --recipe NAME` (any instance, one node or many), or directly with
torchtitan: `python -m torchtitan.train --module qwentitan.launch.recipes --config tiny_dense`.
"""

from __future__ import annotations

from collections.abc import Callable

from torchtitan.trainer import Trainer

from qwentitan.launch.errors import LaunchError
from qwentitan.launch.recipes.tiny import (
    metrics_config,
    tiny_dense,
    tiny_hf,
    tiny_moe,
    tiny_moe_kernels,
)
from qwentitan.launch.recipes.trn2 import (
    TRN2_RECIPES,
    qwen3_4b_hf,
    qwen3_4b_native,
    qwen3_moe_kernels,
)

__all__ = [
    "TRN2_RECIPES",
    "get_recipe",
    "metrics_config",
    "qwen3_4b_hf",
    "qwen3_4b_native",
    "qwen3_moe_kernels",
    "recipe_names",
    "tiny_dense",
    "tiny_hf",
    "tiny_moe",
    "tiny_moe_kernels",
]

_RECIPES: dict[str, Callable[[], Trainer.Config]] = {
    "tiny_dense": tiny_dense,
    "tiny_hf": tiny_hf,
    "tiny_moe": tiny_moe,
    "tiny_moe_kernels": tiny_moe_kernels,
    "qwen3_4b_hf": qwen3_4b_hf,
    "qwen3_4b_native": qwen3_4b_native,
    "qwen3_moe_kernels": qwen3_moe_kernels,
}


def recipe_names() -> list[str]:
    return sorted(_RECIPES)


def get_recipe(name: str) -> Callable[[], Trainer.Config]:
    """The recipe function called `name`; a one-sentence error naming the choices otherwise."""
    try:
        return _RECIPES[name]
    except KeyError:
        raise LaunchError(
            f"Unknown recipe {name!r}; choose one of {', '.join(recipe_names())}."
        ) from None
