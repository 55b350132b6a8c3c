"""Recipes: functions returning a torchtitan `Trainer.Config`, and their one registry.

Use them through `qwentitan-launch train --recipe NAME` (tiny, this machine),
`qwentitan-launch run --recipe NAME` (any instance, one node or many), or directly with
torchtitan: `python -m torchtitan.train --module qwentitan.launch.recipes --config tiny_dense`.

The registry names each recipe's module instead of importing it, so that listing the names
(the CLI's `--help`, plan validation) never imports torch or torchtitan; the functions load on
first access, which is also how torchtitan's `--config NAME` finds them (`getattr`).
"""

from __future__ import annotations

from collections.abc import Callable
from importlib import import_module
from typing import TYPE_CHECKING, Any

from qwentitan.launch.errors import LaunchError

if TYPE_CHECKING:
    from torchtitan.trainer import Trainer

# recipe name -> module holding the function of that name
_RECIPES = {
    "tiny_dense": "qwentitan.launch.recipes.tiny",
    "tiny_hf": "qwentitan.launch.recipes.tiny",
    "tiny_moe": "qwentitan.launch.recipes.tiny",
    "tiny_moe_kernels": "qwentitan.launch.recipes.tiny",
    "qwen3_4b_hf": "qwentitan.launch.recipes.trn2",
    "qwen3_4b_native": "qwentitan.launch.recipes.trn2",
    "qwen3_moe_kernels": "qwentitan.launch.recipes.trn2",
}
# The recipes written for one trn2.48xlarge (the others train on this host).
TRN2_RECIPES = ("qwen3_4b_hf", "qwen3_4b_native", "qwen3_moe_kernels")
_OTHER_EXPORTS = {"metrics_config": "qwentitan.launch.recipes.tiny"}

__all__ = ["TRN2_RECIPES", "get_recipe", "recipe_names", *sorted(_OTHER_EXPORTS), *_RECIPES]


def recipe_names() -> list[str]:
    return sorted(_RECIPES)


def get_recipe(name: str) -> Callable[[], Trainer.Config]:
    """The recipe function called `name`; a one-sentence error naming the choices otherwise."""
    if name not in _RECIPES:
        raise LaunchError(f"Unknown recipe {name!r}; choose one of {', '.join(recipe_names())}.")
    return getattr(import_module(_RECIPES[name]), name)


def __getattr__(name: str) -> Any:
    if name in _RECIPES:
        return get_recipe(name)
    if name in _OTHER_EXPORTS:
        return getattr(import_module(_OTHER_EXPORTS[name]), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted({*globals(), *__all__})
