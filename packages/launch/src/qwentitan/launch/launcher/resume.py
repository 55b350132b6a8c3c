"""The checkpoint a resumed run continues, checked before any rank starts.

torchtitan resumes from the highest `step-N` folder holding a DCP `.metadata` (or an HF index)
and, when that folder is damaged, every rank dies deep in `dcp.load` with a bare `EOFError`.
`check_resumable` reads the same folder first and refuses it in one sentence naming the file
and what is wrong: a `.metadata` that does not unpickle, a `.distcp` data file that is missing
or shorter than the byte ranges the metadata points into, or tensors of another model.

A `.metadata` is a pickle, and torch's `FileSystemReader.read_metadata` unpickles it with
`pickle.load`, which runs whatever code the file names. The check reads it first with an
allow-list unpickler (`read_metadata`, through qwentitan.checkpoint's `MetadataUnpickler`:
only the classes torch DCP writes, as `torch.load(weights_only=True)` does for tensors) and refuses any other file before a rank
starts, so `train --resume` and `run` never hand torchtitan a `.metadata` that was not checked.
"""

from __future__ import annotations

import pickle
import re
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from torch.distributed.checkpoint.metadata import Metadata, TensorStorageMetadata

from qwentitan.checkpoint.dcp_metadata import MetadataUnpickler
from qwentitan.launch.base.errors import LaunchError
from qwentitan.launch.launcher.memory import meta_model

__all__ = ["UnsafeMetadata", "check_resumable", "read_metadata", "saved_steps", "state_shapes"]

_STEP_FOLDER = re.compile(r"step-(\d+)")
METADATA = ".metadata"
HF_INDEX = "model.safetensors.index.json"  # torchtitan also resumes from an HF model-only save

Shapes = Mapping[str, tuple[int, ...]]


class UnsafeMetadata(pickle.UnpicklingError):
    """A `.metadata` naming something other than torch DCP's metadata classes."""


class _Unpickler(MetadataUnpickler):
    """qwentitan.checkpoint's allow-list unpickler, its refusal told apart from damage."""

    def find_class(self, module: str, name: str) -> Any:
        try:
            return super().find_class(module, name)
        except pickle.UnpicklingError as error:
            raise UnsafeMetadata(str(error)) from None


def read_metadata(step: Path) -> Metadata:
    """The DCP metadata of `step`, unpickled with only DCP's own classes allowed; raises
    `UnsafeMetadata` for anything else, and what pickle raises for a damaged file."""
    with (step / METADATA).open("rb") as file:  # a Path, or a RemotePath (s3://)
        metadata = _Unpickler(file).load()
    if not isinstance(metadata, Metadata):
        raise UnsafeMetadata(f"it holds a {type(metadata).__name__}, not DCP metadata")
    return metadata


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
    fresh: str | None = None,
) -> int:
    """The step torchtitan will resume in `folder`; LaunchError if its checkpoint is unusable.

    `model` is `state_shapes(config)`. `fresh`: how to start from scratch instead, naming
    request fields as `{field}` (default: leave `resume` out).
    """
    fresh = fresh or "start fresh without {resume}"
    steps = saved_steps(folder)
    if not steps:
        raise LaunchError(
            f"There is no checkpoint to resume in {folder}; run once without {{resume}} first, "
            "or pass the {run_dir} of an earlier run.",
            field="resume",
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
        raise LaunchError(f"The checkpoint to resume is damaged: {damage}; {fix}.", field="resume")
    if saved_ranks := _data_ranks(latest):
        # qwentitan's loader saves one data position for all ranks (runtime/data/loader.py),
        # which resumes under any data-parallel degree; torchtitan's saved one per rank.
        raise LaunchError(
            f"{latest} holds one data position per data-parallel rank ({saved_ranks}), as "
            "qwentitan saved them before it kept one for all ranks, and this loader cannot "
            "read them; pass another {run_dir} to start fresh.",
            field="run_dir",
        )
    mismatch = _mismatch(latest, model)
    if mismatch is not None:
        raise LaunchError(
            f"{latest} {mismatch}, so it is another model's checkpoint; pass the {{run_dir}} of "
            f"a {recipe} run, or another {{run_dir}} to start fresh.",
            field="run_dir",
        )
    return steps[-1]


def _damage(step: Path) -> str | None:
    """What makes the DCP checkpoint in `step` unreadable, or None."""
    if not (step / METADATA).is_file():
        return None  # an HF model-only save: torchtitan reads it with its own checks
    try:
        metadata = read_metadata(step)
    except UnsafeMetadata as error:
        return f"{step / METADATA} is not a checkpoint's metadata ({error}, so it was not run)"
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


def _data_ranks(step: Path) -> int:
    """How many per-rank data positions (torchtitan's `dp_rank_<r>`) `step` holds, 0 if none."""
    if not (step / METADATA).is_file():
        return 0
    keys = read_metadata(step).state_dict_metadata
    return sum(1 for key in keys if key.startswith("dataloader.dp_rank_"))


def _mismatch(step: Path, model: Shapes) -> str | None:
    """How the (readable) checkpoint in `step` differs from `model`, or None."""
    if not (step / METADATA).is_file():
        return None
    metadata = read_metadata(step)
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
