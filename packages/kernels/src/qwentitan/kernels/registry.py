"""Replacing modules in a model config by dotted path, before the model is built.

A config tree is made of dataclasses, lists, tuples and dicts (torchtitan's `Module.Config`
trees are). A node's path joins field names, list indices and dict keys with dots, for example
`layers.3.attention.rope`. A rule's pattern matches paths segment by segment with shell-style
wildcards (`*`, `?`, `[0-3]`), so `layers.*.attention.rope` selects every layer and
`layers.[0-1].attention.rope` the first two. Nothing here knows torchtitan.
"""

from __future__ import annotations

import dataclasses
import fnmatch
import logging
from collections.abc import Callable, Iterator, Sequence
from typing import Any

from qwentitan.kernels import nki_loader
from qwentitan.kernels.errors import KernelError

logger = logging.getLogger("qwentitan.kernels")


@dataclasses.dataclass(frozen=True, slots=True)
class ReplacementRule:
    """Replace every config node whose path matches `pattern` by `replacement(node)`.

    `name` is what the log shows for each replaced module, e.g. `nki_rope  layers.3.attention.rope`.
    `op` names the `qwentitan::` op the replacement runs (`check_kernels` launches it) and
    `use_nki` whether it runs its NKI kernel on neuron; then the log line also says by which
    route (`nki_loader.launch_route`) that kernel is launched here.
    """

    pattern: str
    replacement: Callable[[Any], Any]
    name: str
    op: str | None = None
    use_nki: bool = False

    def matches(self, path: str) -> bool:
        wanted, actual = self.pattern.split("."), path.split(".")
        return len(wanted) == len(actual) and all(
            fnmatch.fnmatchcase(a, w) for w, a in zip(wanted, actual, strict=True)
        )


def _children(node: Any) -> Iterator[tuple[str, Any]]:
    if dataclasses.is_dataclass(node) and not isinstance(node, type):
        for field in dataclasses.fields(node):
            yield field.name, getattr(node, field.name)
    elif isinstance(node, (list, tuple)):
        yield from ((str(i), child) for i, child in enumerate(node))
    elif isinstance(node, dict):
        yield from ((str(key), child) for key, child in node.items())


def _rebuild(node: Any, changed: dict[str, Any]) -> Any:
    # Copy-on-write: only the nodes above a replacement are new; the input tree is untouched.
    if dataclasses.is_dataclass(node):
        init = {f.name for f in dataclasses.fields(node) if f.init}
        copy = dataclasses.replace(node, **{k: v for k, v in changed.items() if k in init})
        for key, value in changed.items():
            if key not in init:
                object.__setattr__(copy, key, value)
        return copy
    if isinstance(node, (list, tuple)):
        items = [changed.get(str(i), child) for i, child in enumerate(node)]
        return type(node)(items) if isinstance(node, list) else tuple(items)
    return {key: changed.get(str(key), child) for key, child in node.items()}


def _apply_rule(node: Any, path: str, rule: ReplacementRule, hits: list[str]) -> Any:
    if path and rule.matches(path):
        hits.append(path)
        return rule.replacement(node)
    changed = {}
    for key, child in _children(node):
        new_child = _apply_rule(child, f"{path}.{key}" if path else key, rule, hits)
        if new_child is not child:
            changed[key] = new_child
    return _rebuild(node, changed) if changed else node


def apply_replacements(config: Any, rules: Sequence[ReplacementRule]) -> Any:
    """A new config with every rule applied in order; logs one line per replaced module.

    The input config is never modified. A rule that matches no path raises KernelError, so a
    misspelt pattern cannot silently leave the model without its kernels.
    """
    for rule in rules:
        hits: list[str] = []
        config = _apply_rule(config, "", rule, hits)
        if not hits:
            raise KernelError(
                f"replacement rule {rule.name!r} with pattern {rule.pattern!r} matches no module "
                "of this config; fix the pattern (paths look like 'layers.3.attention.rope')."
            )
        route = f"  ({nki_loader.route_description()})" if rule.use_nki else ""
        for path in hits:
            logger.info("%s  %s%s", rule.name, path, route)
    return config


def config_paths(config: Any) -> list[str]:
    """Every path of a config tree, to help write a pattern."""
    out: list[str] = []

    def walk(node: Any, path: str) -> None:
        for key, child in _children(node):
            child_path = f"{path}.{key}" if path else key
            out.append(child_path)
            walk(child, child_path)

    walk(config, "")
    return out
