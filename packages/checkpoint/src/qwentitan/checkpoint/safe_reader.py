"""`SafeFileSystemReader`: DCP's FileSystemReader, reading `.metadata` without running code.

`SafeFsspecReader` does the same for a checkpoint behind an fsspec URL (`s3://bucket/run/step-4`,
through DCP's own `FsspecReader`); `safe_reader_for(path)` picks the one a path needs.

For `dcp.load(..., storage_reader=SafeFileSystemReader(path))` and anything that takes a DCP
storage reader (torchtitan's checkpoint loading): the tensor records themselves DCP already
reads with `torch.load(weights_only=True)`; only the metadata went through `pickle.load`.
"""

from __future__ import annotations

import os
import pickle
from typing import Any

from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.metadata import Metadata, StorageMeta

from qwentitan.checkpoint.dcp_metadata import MetadataUnpickler
from qwentitan.checkpoint.errors import CheckpointError


class _SafeMetadata:
    """`read_metadata` through `MetadataUnpickler`, for any DCP FileSystemReader (its `fs` is
    local or fsspec's)."""

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        path = self._get_metadata_path(kwargs.get("rank"))
        try:
            with self.fs.create_stream(path, "rb") as f:
                metadata = MetadataUnpickler(f).load()
        except (pickle.UnpicklingError, EOFError, AttributeError, TypeError, ValueError) as e:
            raise CheckpointError(
                f"{path} is not DCP metadata this tool reads ({e}); it is corrupt or unsafe: "
                "re-save the checkpoint with torch DCP."
            ) from None
        if not isinstance(metadata, Metadata):
            raise CheckpointError(
                f"{path} does not hold DCP metadata; re-save the checkpoint with torch DCP."
            )
        if getattr(metadata, "storage_meta", None) is None:
            metadata.storage_meta = StorageMeta()
        metadata.storage_meta.load_id = self.load_id
        return metadata


class SafeFileSystemReader(_SafeMetadata, FileSystemReader):
    """A `FileSystemReader` whose `read_metadata` unpickles through `MetadataUnpickler`: a
    `.metadata` naming anything but DCP's metadata classes is a `CheckpointError`, never run."""


def safe_reader_for(path: str | os.PathLike[str]) -> FileSystemReader:
    """The safe reader for `path`: a URL (`s3://...`, needing fsspec and its backend, s3fs) gets
    `SafeFsspecReader`, a local folder `SafeFileSystemReader`."""
    if "://" not in str(path):  # DCP's own test for a URL (FileSystem.validate_checkpoint_id)
        return SafeFileSystemReader(path)
    from torch.distributed.checkpoint._fsspec_filesystem import FsspecReader

    class SafeFsspecReader(_SafeMetadata, FsspecReader):
        """DCP's `FsspecReader` with the allow-list `read_metadata`."""

    return SafeFsspecReader(path)
