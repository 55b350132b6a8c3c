"""The checkpoint a resumed run continues, checked before any rank starts.

torchtitan resumes from the highest `step-N` folder holding a DCP `.metadata` (or an HF index)
and, when that folder is damaged, every rank dies deep in `dcp.load` with a bare `EOFError`.
`check_resumable` reads the same folder first and refuses it in one sentence naming the file
and what is wrong: a `.metadata` that does not unpickle, a `.distcp` data file that is missing
or shorter than the byte ranges the metadata points into, or tensors of another model.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.metadata import TensorStorageMetadata

from qwentitan.launch.base.errors import LaunchError
from qwentitan.launch.launcher.memory import meta_model

__all__ = ["check_resumable", "saved_steps", "state_shapes"]

_STEP_FOLDER = re.compile(r"step-(\d+)")
METADATA = ".metadata"
HF_INDEX = "model.safetensors.index.json"  # torchtitan also resumes from an HF model-only save

Shapes = Mapping[str, tuple[int, ...]]


def saved_steps(folder: Path) -> list[int]:
    """The steps torchtitan would consider resuming from, oldest first (its `_find_load_step`)."""
    if not folder.is_dir():
        return []
    return sorted(
        int(m.group(1))
        for p in folder.iterdir()
        if (m := _STEP_FOLDER.fullmatch(p.name))
        and ((p / METADATA).is_file() or (p / HF_INDEX).is_file())
    )


def state_shapes(config: Any) -> dict[str, tuple[int, ...]]:
    """Names and shapes of the recipe's model state dict, which torchtitan saves at the top
    level of a checkpoint (built on the meta device: no memory)."""
    return {name: tuple(t.shape) for name, t in meta_model(config).state_dict().items()}


def check_resumable(
    folder: Path,
    model: Shapes,
    recipe: str,
    *,
    folder_flag: str = "--run-dir",
    fresh: str = "start fresh without --resume",
) -> int:
    """The step torchtitan will resume in `folder`; LaunchError if its checkpoint is unusable.

    `model` is `state_shapes(config)`. The refusals name `folder_flag` (the command's flag for
    the run folder) and `fresh` (how that command starts a run from scratch).
    """
    steps = saved_steps(folder)
    if not steps:
        raise LaunchError(
            f"There is no checkpoint to resume in {folder}; run once without --resume first, "
            f"or pass the {folder_flag} of an earlier run."
        )
    latest = folder / f"step-{steps[-1]}"
    damage = _damage(latest)
    if damage is not None:
        earlier = next(
            (s for s in reversed(steps[:-1]) if _damage(folder / f"step-{s}") is None), None
        )
        fix = (
            f"move {latest.name} out of {folder} to resume from step-{earlier}"
            if earlier is not None
            else fresh
        )
        raise LaunchError(f"The checkpoint to resume is damaged: {damage}; {fix}.")
    mismatch = _mismatch(latest, model)
    if mismatch is not None:
        raise LaunchError(
            f"{latest} {mismatch}, so it is another model's checkpoint; pass the {folder_flag} of "
            f"a {recipe} run, or another {folder_flag} to start fresh."
        )
    return steps[-1]


def _damage(step: Path) -> str | None:
    """What makes the DCP checkpoint in `step` unreadable, or None."""
    if not (step / METADATA).is_file():
        return None  # an HF model-only save: torchtitan reads it with its own checks
    try:
        metadata = FileSystemReader(str(step)).read_metadata()
    except Exception as error:  # a truncated pickle raises EOFError, garbage UnpicklingError, ...
        return f"{step / METADATA} is truncated or damaged ({type(error).__name__})"
    needed: dict[str, int] = {}
    for info in (metadata.storage_data or {}).values():
        end = info.offset + info.length
        needed[info.relative_path] = max(needed.get(info.relative_path, 0), end)
    for name, end in sorted(needed.items()):
        file = step / name
        if not file.is_file():
            return f"{file} is missing"
        if (size := file.stat().st_size) < end:
            return f"{file} is truncated ({size} of at least {end} bytes)"
    return None


def _mismatch(step: Path, model: Shapes) -> str | None:
    """How the (readable) checkpoint in `step` differs from `model`, or None."""
    if not (step / METADATA).is_file():
        return None
    metadata = FileSystemReader(str(step)).read_metadata()
    saved = {
        fqn: tuple(md.size)
        for fqn, md in metadata.state_dict_metadata.items()
        if isinstance(md, TensorStorageMetadata)
    }
    for fqn, shape in model.items():
        if fqn not in saved:
            return f"holds no tensor {fqn}"
        if saved[fqn] != tuple(shape):
            return f"holds {fqn} as {list(saved[fqn])}, not {list(shape)}"
    return None
