"""Recipes: functions returning a torchtitan `Trainer.Config`, and their one registry.

Use them through `qwentitan-launch train --recipe NAME` (tiny, this machine),
`qwentitan-launch run --recipe NAME` (any instance, one node or many), or directly with
torchtitan: `python -m torchtitan.train --module qwentitan.launch.recipes --config tiny_dense`.

This is the one recipe registry: `train`, `plan` (and the commands built on it), the pilot and
the recipes themselves read each recipe's entry (module, implementation path, the instance it is
sized for) here. It names each recipe's module instead of importing
it, so that listing the names (the CLI's `--help`, plan validation) never imports torch or
torchtitan; the functions load on first access, which is also how torchtitan's `--config NAME`
finds them (`getattr`).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from importlib import import_module
from typing import TYPE_CHECKING, Any

from qwentitan.launch.base.errors import LaunchError
from qwentitan.launch.base.target import NEURON_TARGET

if TYPE_CHECKING:
    from torchtitan.trainer import Trainer

_TINY = "qwentitan.launch.recipes.tiny"
_TRN2 = "qwentitan.launch.recipes.trn2"
_QWEN3_4B = "Qwen/Qwen3-4B-Instruct-2507"
_QWEN3_30B = "Qwen/Qwen3-30B-A3B"
_QWEN3_8B = "Qwen/Qwen3-8B"
_SMALL_FILES = ("*.json", "*.txt")  # config, tokenizer, generation config, merges


@dataclass(frozen=True, slots=True)
class Recipe:
    """What the launcher, the planner and the pilot need to know of a recipe without building it."""

    name: str
    module: str
    """The module holding the recipe function of this name."""
    path: str
    """Implementation path: hf, native or moe-kernels (tagged on its MLflow runs)."""
    instance: str | None = None
    """The instance type it is sized for; None: whatever host runs it."""
    hub_model: str | None = None
    """The Hugging Face Hub model whose folder the recipe reads (`qwentitan-launch fetch`)."""
    hub_files: tuple[str, ...] = ()
    """Which files of it the recipe needs (glob patterns); empty: all of them."""


_RECIPES = {
    recipe.name: recipe
    for recipe in (
        Recipe("tiny_dense", _TINY, "native"),
        Recipe("tiny_dense_untied", _TINY, "native"),
        Recipe("tiny_hf", _TINY, "hf"),
        Recipe("tiny_moe", _TINY, "native"),
        Recipe("tiny_moe_kernels", _TINY, "moe-kernels"),
        Recipe("tiny_tp2_fsdp2_sac", _TINY, "native"),
        Recipe("qwen3_4b_hf", _TRN2, "hf", NEURON_TARGET, _QWEN3_4B),
        Recipe("qwen3_4b_native", _TRN2, "native", NEURON_TARGET, _QWEN3_4B),
        Recipe("qwen3_8b_tp4_fsdp16_sac", _TRN2, "native", NEURON_TARGET, _QWEN3_8B),
        # Its weights start from a random initialisation: the config and tokenizer suffice.
        Recipe("qwen3_moe_kernels", _TRN2, "moe-kernels", NEURON_TARGET, _QWEN3_30B, _SMALL_FILES),
        Recipe(
            "qwen3_30b_a3b_tp4_fsdp16", _TRN2, "native", NEURON_TARGET, _QWEN3_30B, _SMALL_FILES
        ),
    )
}
# The recipes written for one trn2.48xlarge (the others train on this host).
TRN2_RECIPES = tuple(name for name, r in _RECIPES.items() if r.instance == NEURON_TARGET)
_OTHER_EXPORTS = {"metrics_config": _TINY}

__all__ = [
    "TRN2_RECIPES",
    "Recipe",
    "get_recipe",
    "recipe_info",
    "recipe_names",
    *sorted(_OTHER_EXPORTS),
    *_RECIPES,
]


def recipe_names() -> list[str]:
    return sorted(_RECIPES)


def recipe_info(name: str) -> Recipe:
    """The registry entry of `name`; a one-sentence error naming the choices otherwise."""
    if name not in _RECIPES:
        raise LaunchError(f"Unknown recipe {name!r}; choose one of {', '.join(recipe_names())}.")
    return _RECIPES[name]


def get_recipe(name: str) -> Callable[[], Trainer.Config]:
    """The recipe function called `name` (its module imported now)."""
    return getattr(import_module(recipe_info(name).module), name)


def __getattr__(name: str) -> Any:
    if name in _RECIPES:
        return get_recipe(name)
    if name in _OTHER_EXPORTS:
        return getattr(import_module(_OTHER_EXPORTS[name]), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted({*globals(), *__all__})
