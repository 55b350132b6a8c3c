"""The one schema of a plan file (`plan_file`): what a node accepts before it reads anything else.

A plan file is data that `slurm` writes and every node reads, so a node checks it as any input:
each field's type, range and presence, before any value reaches torchtitan's parser (which
imports the module an `--module` override names), torchrun or the ranks' environment. Its `env`
may hold only what `plan_env` itself writes (`environment.plan_env_refusal`), so a `PYTHONPATH`,
`LD_PRELOAD` or `PYTHONSTARTUP` in a file never reaches a process. A refusal is one sentence
naming the field and the fix: write the file again with `slurm`.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

from qwentitan.launch.base.errors import LaunchError
from qwentitan.launch.base.target import TARGETS
from qwentitan.launch.launcher.environment import PLAN_ENV_RULE, SOURCES, plan_env_refusal
from qwentitan.launch.launcher.request import RESUME_MODES, override_refusal

__all__ = ["check_record"]


def _shown(value: Any) -> str:
    """A value as the JSON file spells it (`null`, `"two"`), cut short."""
    text = json.dumps(value, default=str)
    return text if len(text) <= 60 else text[:56] + " ..."


def _whole(low: int) -> Callable[[Any], str | None]:
    def check(value: Any) -> str | None:
        if type(value) is not int:
            return "is not a whole number"
        return None if value >= low else f"is below {low}"

    return check


def _one_of(choices: tuple[Any, ...]) -> Callable[[Any], str | None]:
    def check(value: Any) -> str | None:
        ok = value in choices and type(value) in {type(c) for c in choices}
        return None if ok else f"is not one of {', '.join(map(str, choices))}"

    return check


def _overrides(value: Any) -> str | None:
    if not isinstance(value, list):
        return "is not a list of torchtitan overrides (one string per word)"
    for word in value:
        if not isinstance(word, str) or "\0" in word:
            return f"holds {_shown(word)}, which is not an override word"
        why = override_refusal(word)
        if why:
            return f"holds {word.split('=', 1)[0]} ({why})"
    return None


def _env(value: Any) -> str | None:
    if not isinstance(value, dict):
        return f"is not a table of variable names and values ({PLAN_ENV_RULE})"
    for name, setting in value.items():
        why = plan_env_refusal(name, setting)
        if why:
            return f"holds {_shown(name)}, {why}"
    return None


def _env_sources(value: Any) -> str | None:
    ok = isinstance(value, dict) and all(
        isinstance(k, str) and v in SOURCES for k, v in value.items()
    )
    return None if ok else f"is not a table of variable names and {', '.join(SOURCES)}"


def _summary(value: Any) -> str | None:
    if not isinstance(value, dict):
        return "is not the printed plan (a table)"
    batch = value.get("global_batch")
    return None if type(batch) is int and batch >= 1 else "has no whole global_batch of 1 or more"


# Every field a plan file must hold, and its check (None: good; else why not, after the value).
FIELDS: dict[str, Callable[[Any], str | None]] = {
    "recipe": lambda v: None if isinstance(v, str) and v.isidentifier() else "is no recipe name",
    "instance": _one_of(tuple(TARGETS)),
    "lnc": _one_of((1, 2)),
    "ranks_per_node": _whole(1),
    "nodes": _whole(1),
    "overrides": _overrides,
    "env": _env,
    "env_sources": _env_sources,
    "resume": _one_of(RESUME_MODES),
    "max_restarts": _whole(0),
    "plan": _summary,
}


def check_record(record: dict[str, Any], path: Path) -> None:
    """Refuse, in one sentence, a plan-file record any field of which breaks the schema."""
    fix = "write it again with `slurm`"
    for name, check in FIELDS.items():
        if name not in record:
            raise LaunchError(f"The plan file {path} has no {name!r} field; {fix}.")
        why = check(record[name])
        if why:
            value = record[name]
            shown = "" if isinstance(value, dict | list) else f" {_shown(value)}"
            raise LaunchError(f"The plan file {path} is refused: its {name!r}{shown} {why}; {fix}.")
