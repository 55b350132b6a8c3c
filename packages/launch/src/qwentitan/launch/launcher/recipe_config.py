"""A recipe's `Trainer.Config` built exactly as every rank builds it, refusals in our words.

`load_config` runs torchtitan's own `ConfigManager` (`--module qwentitan.launch.recipes
--config NAME` plus the overrides: "CLI args > config_registry defaults"). torchtitan parses the
overrides with tyro, which reports a refusal by printing a box and exiting; tyro's parse-error
hook (`tyro._errors.on_parse_error`, tyro >= 1.0.17) hands the refusal over as data instead, and
it becomes one sentence here. A tyro without that hook still refuses, in a general sentence.
"""

from __future__ import annotations

import contextlib
import dataclasses
import difflib
import io
import shlex
from collections.abc import Iterator
from typing import Any

from qwentitan.launch.base.errors import LaunchError

__all__ = ["RECIPES_MODULE", "load_config", "recipe_names", "setting_names"]

RECIPES_MODULE = "qwentitan.launch.recipes"


class _Refused(Exception):
    """What tyro refused, in our words (raised by the hook, so tyro prints nothing)."""


def recipe_names() -> list[str]:
    from qwentitan.launch import recipes

    return recipes.recipe_names()


def load_config(recipe: str, overrides: list[str]) -> Any:
    """Build the recipe's Trainer.Config through torchtitan's own parser, as the trainer does."""
    from torchtitan.config import ConfigManager

    if recipe not in recipe_names():
        raise LaunchError(
            f"Unknown recipe {recipe!r}; choose one of {', '.join(recipe_names())} with "
            "{recipe}.",
            field="recipe",
        )
    args = ["--module", RECIPES_MODULE, "--config", recipe, *overrides]
    given = shlex.join(overrides) or "no overrides"
    quiet = io.StringIO()  # what a tyro without the hook prints: not read, only kept off the screen
    try:
        with contextlib.redirect_stdout(quiet), contextlib.redirect_stderr(quiet), _hooked(recipe):
            return ConfigManager().parse_args(args)
    except _Refused as refused:
        reason = str(refused)
    except SystemExit:
        reason = "check the override names and values"
    except ValueError as error:
        raise LaunchError(f"Recipe {recipe!r} is invalid with these settings: {error}") from None
    raise LaunchError(f"torchtitan refused recipe {recipe!r} with {given}: {reason}")


@contextlib.contextmanager
def _hooked(recipe: str) -> Iterator[None]:
    try:
        from tyro._errors import on_parse_error
    except ImportError:  # a tyro before the hook: it prints (kept quiet) and exits
        yield
        return

    def refuse(event: Any) -> None:
        raise _Refused(_sentence(event, recipe))

    with on_parse_error(refuse):
        yield


def _sentence(event: Any, recipe: str) -> str:
    """One event of tyro's parse-error hook, said plainly (any new kind: its class name)."""
    kind = type(event).__name__
    argument = getattr(event, "argument", None)
    name = getattr(argument, "display_name", lambda: "a setting")()
    if kind == "UnrecognizedArgs":
        tokens = list(event.tokens)
        said = f"Unrecognized options: {', '.join(tokens)}"
        close = [s for t in tokens if t.startswith("--") for s in _close_settings(t, recipe)]
        return f"{said}; perhaps you meant {close[0]}" if close else said
    if kind == "InstantiationFailure":
        return f"{name} refused its value ({event.message})" if argument else str(event.message)
    if kind == "InvalidChoice":
        return f"{name} takes one of {', '.join(event.choices)}, not {event.value!r}"
    if kind == "BadValue":
        return f"{name} needs a value" if event.offending_value is None else f"{name} takes none"
    return f"check the override names and values ({kind})"


def _close_settings(token: str, recipe: str) -> list[str]:
    """Settings of the recipe's config spelled like `token`: the same last word first."""
    from qwentitan.launch.recipes import get_recipe

    names = setting_names(get_recipe(recipe)())
    wanted = token.replace("_", "-")
    last = wanted.rsplit(".", 1)[-1]
    same_last = [n for n in names if n.rsplit(".", 1)[-1] == last]
    return difflib.get_close_matches(wanted, same_last, n=1, cutoff=0) or (
        difflib.get_close_matches(wanted, names, n=1)
    )


def setting_names(config: Any, prefix: str = "") -> list[str]:
    """The `--section.name` overrides a config holds, as tyro spells them (hyphens; a list of
    configs by index, a dict by key)."""
    if isinstance(config, list | tuple) and any(map(_is_config, config)):
        items = [(str(i), value) for i, value in enumerate(config)]
    elif isinstance(config, dict) and config and all(isinstance(k, str) for k in config):
        items = [(key.replace("_", "-"), value) for key, value in config.items()]
    elif _is_config(config):
        items = [
            (f.name.replace("_", "-"), getattr(config, f.name))
            for f in dataclasses.fields(config)
            if f.init and f.name != "model_spec"
        ]
    else:
        return [prefix] if prefix else []
    return [
        name
        for key, value in items
        for name in setting_names(value, f"{prefix}.{key}" if prefix else f"--{key}")
    ]


def _is_config(value: Any) -> bool:
    return dataclasses.is_dataclass(value) and not isinstance(value, type)
