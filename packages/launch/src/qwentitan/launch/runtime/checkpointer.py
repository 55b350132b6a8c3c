"""`GuardedCheckpointManager`: torchtitan's DCP `CheckpointManager`, with saves that fail in one
sentence and loads only of a checked `.metadata`.

A recipe sets `checkpoint=GuardedCheckpointManager.Config(...)` (same fields as torchtitan's);
the manager then, through torchtitan's own hooks (`_save`, `dcp_load`):

- times each save that wrote a checkpoint (`save_seconds`, which the Trainer's `--stop-by`
  budget reads; with an async checkpoint mode that is the staging time only);
- ends the rank (exit code SAVE_FAILED_EXIT) with one sentence when a save fails, after
  removing its partial `step-N` folder, instead of a traceback per rank;
- loads a DCP folder only after qwentitan.checkpoint's `SafeFileSystemReader` (an allow-list
  unpickler) read its `.metadata`: torch's own reader unpickles it with `pickle.load`, which runs
  any code the file names. The launcher checks the same file before the ranks start; this covers
  loads it does not see (`--checkpoint.initial_load_path`, a file changed since). A refused file
  ends the rank in one sentence (exit 2).
"""

from __future__ import annotations

import contextlib
import shutil
import time
from collections.abc import Callable
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any

import torch
from torch.distributed.checkpoint.api import CheckpointException
from torchtitan.components.checkpoint import CheckpointManager
from torchtitan.tools import filesystem
from torchtitan.tools.logging import logger

from qwentitan.launch.base import s3
from qwentitan.launch.runtime.hf_export import HFExports, export_files, write_export_files

__all__ = ["SAVE_FAILED_EXIT", "GuardedCheckpointManager", "guarded"]

# Exit code of a rank whose checkpoint could not be written: a fault of the environment.
SAVE_FAILED_EXIT = 2
# Less free space than this after a failed save: the disk filled up (whatever the error says).
FULL_DISK_BYTES = 2**20


class GuardedCheckpointManager(CheckpointManager):
    """torchtitan's DCP checkpoint manager: timed, guarded saves; checked loads."""

    @dataclass(kw_only=True, slots=True)
    class Config(CheckpointManager.Config):
        """torchtitan's fields (its own class, so that `build()` makes this manager), and:"""

        hf_every: int = 0
        """Export each checkpoint at a multiple of this step, and the last, to RUN/hf/step-N as a
        verified Hugging Face folder, in a process of its own beside the ranks (0: none)."""
        hf_keep: int = 0
        """Keep the newest this many exports in RUN/hf (0: all); checkpoints are never deleted."""
        hf_wait: float = 300.0
        """Seconds the end of a run (a stop included) waits for exports before abandoning them."""

    def __init__(self, config: Config, **kwargs: Any) -> None:
        s3.apply_deadlines()  # a checkpoint folder on S3: no request waits unbounded
        self.save_seconds: list[float] = []
        """Seconds of each save that wrote a checkpoint, oldest first (the reader empties it)."""
        self.export_files: dict[str, bytes] | None = None
        """What each step folder carries for export (rank 0, set by `describe_export`)."""
        self.exports: HFExports | None = None
        self._abandon_exports = False
        self._export_config = config
        self._run_dir = str(kwargs.get("base_folder", ""))
        super().__init__(config, **kwargs)

    def describe_export(
        self, flavor: str, hf_assets_path: str, on_result: Callable[[dict], None] | None = None
    ) -> None:
        """Rank 0: give each checkpoint what export needs and, with `hf_every`, export them
        (on resume, the checkpoints an earlier run left unexported first)."""
        if not self.enable:
            return
        self.export_files = export_files(flavor, hf_assets_path)
        every = self._export_config.hf_every
        if every > 0 and self.async_mode != "disabled":
            logger.warning(
                "--hf-every exports synchronous checkpoints only, so this run (checkpoint."
                "async_mode) is not exported; export a step afterwards with `qwentitan-ckpt to-hf`."
            )
        elif every > 0:
            # On S3 the run's other files are local (launcher.remote); its exports go beside
            # its checkpoints, in the bucket.
            remote = filesystem.is_remote(self.folder)
            self.exports = HFExports(
                str(self.folder),
                str(self.folder).rstrip("/").rsplit("/", 1)[0] if remote else self._run_dir,
                every=every,
                keep=self._export_config.hf_keep,
                on_result=on_result,
            )
            self.exports.submit_missing()

    def _save(self, curr_step: int, last_step: bool = False) -> bool:
        if self.exports is not None:
            self.exports.poll()
        start = time.perf_counter()
        try:
            wrote = super()._save(curr_step, last_step)
        except (Exception, CheckpointException) as error:
            step_folder = filesystem.join(str(self.folder), f"step-{curr_step}")  # a path, or a URL
            # DCP raises on every rank after all of them stopped writing; one removes the folder.
            if not torch.distributed.is_initialized() or torch.distributed.get_rank() == 0:
                message = _save_failure(step_folder, error)
                if not any(map(s3.is_network_error, _causes(error))):  # else it would not now
                    with contextlib.suppress(Exception):  # a removal that fails leaves no .metadata
                        filesystem.rmtree(step_folder)
                logger.error(message)
            raise SystemExit(SAVE_FAILED_EXIT) from None
        if wrote:
            self.save_seconds.append(time.perf_counter() - start)
            if self.export_files is not None:
                write_export_files(self._create_checkpoint_id(curr_step), self.export_files)
            if self.exports is not None and self.exports.wanted(curr_step, last_step):
                self.exports.submit(curr_step)
        return wrote

    def abandon_exports_at_close(self) -> None:
        """A stop that cannot wait (signal, spot notice, deadline): the export in flight is
        killed at close, with its partial folder."""
        self._abandon_exports = True

    def _close(self) -> None:
        super()._close()
        exports, self.exports = self.exports, None
        if exports is not None:
            exports.close(0.0 if self._abandon_exports else self._export_config.hf_wait)

    def save_full(self, step: int) -> bool:
        """Save now, whatever the interval, the full state (model, optimizer, lr schedule, data
        position, step) even where the last save keeps the model only: a stop before the last
        step, which a later run resumes from."""
        model_only = self.last_save_model_only
        self.last_save_model_only = False
        try:
            return self.save(step, last_step=True)
        finally:
            self.last_save_model_only = model_only

    def dcp_load(
        self, state_dict: dict[str, Any], checkpoint_id: str, from_hf: bool, from_quantized: bool
    ) -> None:
        if not from_hf:  # an HF folder is safetensors, which hold no code
            from qwentitan.checkpoint import CheckpointError, safe_reader_for

            try:
                safe_reader_for(checkpoint_id).read_metadata()  # local, or remote (s3://) by fsspec
            except CheckpointError as error:
                logger.error(f"Not loading the checkpoint {checkpoint_id}: {error}")
                raise SystemExit(2) from None  # a fault of the input, said in one sentence
        super().dcp_load(state_dict, checkpoint_id, from_hf, from_quantized)


def guarded(config: CheckpointManager.Config) -> GuardedCheckpointManager.Config:
    """`config` (torchtitan's own recipe's, say) as a `GuardedCheckpointManager.Config`."""
    return GuardedCheckpointManager.Config(
        **{f.name: getattr(config, f.name) for f in fields(config) if f.init}
    )


def _save_failure(step_folder: Path | str, error: BaseException) -> str:
    """One sentence for a failed save of `step_folder` (call before removing the folder; a URL
    on S3 has no disk to be full)."""
    causes = _causes(error)
    cause = next((c for c in causes if isinstance(c, OSError)), causes[0])
    remote = filesystem.is_remote(step_folder)
    network = next((c for c in causes if s3.is_network_error(c)), None)
    if remote and network is not None:
        return (
            f"Saving the checkpoint {step_folder} failed: {s3.no_answer(network)}; its partial "
            "folder has no .metadata, so --resume continues from the previous checkpoint once "
            "the endpoint answers again."
        )
    free = None if remote else shutil.disk_usage(_existing(Path(step_folder))).free
    parent = str(step_folder).rsplit("/", 1)[0] if remote else Path(step_folder).parent
    if isinstance(cause, OSError) and cause.strerror:
        reason = cause.strerror
    elif free is not None and free < FULL_DISK_BYTES:
        # torch.save's zip writer turns a short write (ENOSPC) into "unexpected pos" errors.
        reason = f"the disk is full, {free} bytes left"
    else:
        reason = f"{type(cause).__name__}: {str(cause).splitlines()[0] if str(cause) else ''}"
    return (
        f"Saving the checkpoint {step_folder} failed ({reason}); its partial folder was removed, "
        f"so --resume continues from the previous checkpoint: free space in {parent} "
        "or choose another run folder, then resume."
    )


def _causes(error: BaseException) -> list[BaseException]:
    """What failed: each rank's error of a DCP `CheckpointException`, else `error` itself."""
    if isinstance(error, CheckpointException):
        return [failure for failure, _trace in error.failures.values()] or [error]
    return [error]


def _existing(path: Path) -> Path:
    while not path.exists():
        path = path.parent
    return path
