"""The pilot: the implementation paths trained from the same weights and compared in MLflow
(`qwentitan-launch pilot`, `uv run nox -s pilot`).

Names load on first use, so that the CLI's `--help` (which lists the pairs) imports no torch.
"""

from importlib import import_module
from typing import Any

# The pairs are plain data (no torch): imported now, and `compare` names the function, not the
# submodule of the same name.
from qwentitan.launch.launcher.pilot.compare import PAIRS, Pair, PairResult, compare

_RUN = "qwentitan.launch.launcher.pilot.run"
_LINKS = "qwentitan.launch.tracking.links"  # the one builder of MLflow UI pages
_LAZY = {
    "PILOT_EXPERIMENT": _RUN,
    "Pilot": _RUN,
    "child_overrides": _RUN,
    "compare_url": _LINKS,
    "loss_url": _LINKS,
    "pilot_request": _RUN,
    "run_pilot": _RUN,
    "runs_url": _LINKS,
    "start_overrides": _RUN,
}

__all__ = ["PAIRS", "Pair", "PairResult", "compare", *sorted(_LAZY)]


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        return getattr(import_module(_LAZY[name]), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted({*globals(), *__all__})
