"""torch Distributed Checkpoint folders, written and read through DCP's own public API.

Writing: `dcp.save` plans from meta tensors (shapes and dtypes only) and a planner whose
`resolve_data` reads each tensor from the source only when a writer thread asks for it, so
the model is never held whole. Reading: `dcp.load` of one tensor at a time with partial
loading, which also reassembles tensors saved in shards by a multi-rank training job.
"""

from __future__ import annotations

import os
import pickle
import threading
import warnings
import weakref
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemReader, FileSystemWriter
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner, DefaultSavePlanner
from torch.distributed.checkpoint.filesystem import FileSystem
from torch.distributed.checkpoint.metadata import Metadata, MetadataIndex, TensorStorageMetadata

from qwentitan.checkpoint.errors import CheckpointError

METADATA = ".metadata"


class MemoryBudget:
    """Bytes of tensors allowed in flight at once across threads (a counting semaphore).

    A request larger than the whole budget waits until nothing else is in flight, so one
    group that must be assembled whole (a layer's stacked experts) always gets through.
    """

    def __init__(self, limit: int):
        self.limit = limit
        self.peak = 0  # the most bytes ever in flight at once
        self._used = 0
        self._cond = threading.Condition()

    def acquire(self, nbytes: int) -> int:
        nbytes = min(nbytes, self.limit)
        with self._cond:
            self._cond.wait_for(lambda: self._used + nbytes <= self.limit)
            self._used += nbytes
            self.peak = max(self.peak, self._used)
        return nbytes

    def release(self, nbytes: int) -> None:
        with self._cond:
            self._used -= nbytes
            self._cond.notify_all()

    @contextmanager
    def hold(self, nbytes: int) -> Iterator[None]:
        taken = self.acquire(nbytes)
        try:
            yield
        finally:
            self.release(taken)


@contextmanager
def _quiet_single_process() -> Iterator[None]:
    with warnings.catch_warnings():
        # DCP warns that it runs without a process group: exactly what an offline converter wants.
        warnings.filterwarnings("ignore", message=".*torch.distributed is disabled.*")
        yield


class _RetiringFileSystem(FileSystem):
    """DCP's local file system, telling the planner when a written file is closed."""

    def __init__(self, on_close: Callable[[], None]):
        super().__init__()
        self._on_close = on_close

    @contextmanager
    def create_stream(self, path, mode):  # type: ignore[override]
        with super().create_stream(path, mode) as stream:
            yield stream
        self._on_close()


class _InFlight:
    """The tensor a writer thread is writing, until that thread asks for its next one."""

    __slots__ = ("__weakref__", "finalizer", "tensor")

    def __init__(self, tensor: torch.Tensor):
        self.tensor = tensor
        self.finalizer: weakref.finalize | None = None


class _LazySavePlanner(DefaultSavePlanner):
    """Hands DCP each tensor only when a writer thread is about to write it.

    FileSystemWriter keeps a reference to the tensor it last wrote until it resolves the next
    one; to keep memory at one tensor per thread, the previous tensor's storage is freed (it is
    already on disk) and its bytes returned to the budget before the next is produced.
    """

    def __init__(
        self,
        producers: dict[str, Callable[[], torch.Tensor]],
        budget: MemoryBudget,
        on_written: Callable[[int], None],
    ):
        super().__init__(dedup_save_to_lowest_rank=False)
        self._producers = producers
        self._budget = budget
        self._on_written = on_written
        self._last = threading.local()
        self.resolved: set[str] = set()
        # FileSystemWriter's extra threads swallow exceptions (the thread just ends and its
        # files are missing from .metadata), so the first failure is kept and re-raised.
        self.error: BaseException | None = None
        self.threads: set[threading.Thread] = set()

    def _retire_previous(self) -> None:
        previous = getattr(self._last, "item", None)
        if previous is None:
            return
        self._last.item = None
        storage = previous.tensor.untyped_storage()
        if storage.resizable():  # it is on disk; DCP's alias of it is never read again
            storage.resize_(0)
        previous.finalizer()  # counts the bytes as written and returns them to the budget, once

    def _written(self, taken: int, nbytes: int) -> None:
        self._budget.release(taken)
        self._on_written(nbytes)

    def resolve_data(self, write_item):  # type: ignore[override]
        self._retire_previous()
        self.threads.add(threading.current_thread())
        if self.error is not None:  # another thread failed: stop writing
            raise RuntimeError("DCP save aborted after an earlier error")
        fqn = write_item.index.fqn
        shape_nbytes = write_item.tensor_data.properties.dtype.itemsize
        for s in write_item.tensor_data.size:
            shape_nbytes *= s
        taken = self._budget.acquire(shape_nbytes)
        try:
            tensor = self._producers[fqn]()
        except BaseException as e:
            self._budget.release(taken)
            self.error = self.error or e
            raise
        self.resolved.add(fqn)
        # The thread-local record holds the tensor itself: DCP keeps only a detached alias of
        # it, so watching the returned object would release the budget at once. The record
        # also dies with its writer thread, which then returns the bytes.
        record = _InFlight(tensor)
        record.finalizer = weakref.finalize(record, self._written, taken, tensor.nbytes)
        self._last.item = record
        return tensor

    def finish_thread(self) -> None:
        self._retire_previous()


def save(
    folder: Path,
    specs: dict[str, tuple[tuple[int, ...], torch.dtype]],
    producers: dict[str, Callable[[], torch.Tensor]],
    *,
    threads: int,
    budget: MemoryBudget,
    on_written: Callable[[int], None],
    aliases: dict[str, str] | None = None,
) -> None:
    """Write a DCP checkpoint of `specs` (fqn -> shape, dtype), one file per tensor.

    `aliases` (fqn -> fqn in `specs`) are recorded in the metadata as a second name for the
    same stored bytes, the way a tied lm_head is the embedding: written once, loadable by both
    names.
    """
    meta = {
        fqn: torch.empty(shape, dtype=dtype, device="meta") for fqn, (shape, dtype) in specs.items()
    }
    crc32 = torch.serialization.get_crc32_options()
    # The zip checksums torch.save computes cost CPU time at disk speed and are not checked
    # on load; DCP's own integrity is the metadata and the rename of .metadata at the end.
    torch.serialization.set_crc32_options(False)
    planner = _LazySavePlanner(producers, budget, on_written)
    # One file per tensor: with one file per thread, FileSystemWriter keeps every tensor of a
    # file referenced until the file is closed, i.e. the whole model.
    # No fsync per file: the caller syncs the whole folder once before renaming it into place.
    writer = FileSystemWriter(
        folder, single_file_per_rank=False, thread_count=threads, sync_files=False
    )
    # Each file holds one tensor: when its stream closes, that tensor is on disk, so retire it
    # there and then (a thread that waits in join() must not keep holding the budget).
    writer.fs = _RetiringFileSystem(planner.finish_thread)
    try:
        with _quiet_single_process():
            dcp.save(meta, storage_writer=writer, planner=planner, no_dist=True)
        if aliases:
            _add_aliases(folder, aliases)
    except BaseException:  # DCP's CheckpointException derives from BaseException
        # When the calling thread fails, DCP returns without joining its other writer
        # threads; wait for them so nothing writes into the folder after it is removed.
        for thread in planner.threads - {threading.current_thread()}:
            thread.join()
        if planner.error is not None:
            raise planner.error from None
        raise
    finally:
        planner.finish_thread()
        torch.serialization.set_crc32_options(crc32)
    if planner.error is not None:
        raise planner.error
    if planner.resolved != set(specs):
        missing = sorted(set(specs) - planner.resolved)
        raise RuntimeError(f"DCP save skipped {len(missing)} tensors, first {missing[0]!r}")


def _add_aliases(folder: Path, aliases: dict[str, str]) -> None:
    path = folder / METADATA
    with open(path, "rb") as f:
        metadata: Metadata = pickle.load(f)
    for alias, target in aliases.items():
        metadata.state_dict_metadata[alias] = metadata.state_dict_metadata[target]
        for index, info in list(metadata.storage_data.items()):
            if index.fqn == target:
                metadata.storage_data[MetadataIndex(alias, index.offset, index.index)] = info
    tmp = folder / f"{METADATA}.tmp"
    with open(tmp, "wb") as f:
        pickle.dump(metadata, f)
    os.replace(tmp, path)


class DCPFolder:
    """A DCP checkpoint folder: its tensors' names, shapes and dtypes, read one at a time."""

    def __init__(self, path: Path | str):
        self.path = Path(path)
        if not self.path.is_dir():
            raise CheckpointError(
                f"{self.path} is not a folder; pass a DCP checkpoint folder (one holding {METADATA})."
            )
        if not (self.path / METADATA).is_file():
            raise CheckpointError(
                f"{self.path} has no {METADATA} file, so it is not a complete DCP checkpoint; "
                "pass the folder written by torchtitan or `qwentitan-ckpt to-dcp` (a step-N folder)."
            )
        try:
            metadata: Metadata = FileSystemReader(self.path).read_metadata()
        except Exception as e:
            raise CheckpointError(
                f"{self.path / METADATA} cannot be read ({type(e).__name__}); the checkpoint is "
                "corrupt or was written by an incompatible torch, re-save it."
            ) from None
        self.tensors: dict[str, tuple[tuple[int, ...], torch.dtype]] = {
            fqn: (tuple(md.size), md.properties.dtype)
            for fqn, md in metadata.state_dict_metadata.items()
            if isinstance(md, TensorStorageMetadata)
        }
        # Tensors stored whole, alone in their file (what `save` writes): loadable by mapping
        # the file instead of reading it into a buffer and copying it into the target.
        self._whole_files: dict[str, Path] = {}
        for index, info in (metadata.storage_data or {}).items():
            md = metadata.state_dict_metadata.get(index.fqn)
            if (
                isinstance(md, TensorStorageMetadata)
                and len(md.chunks) == 1
                and not any(index.offset)
                and info.offset == 0
                and not getattr(info, "transform_descriptors", None)
            ):
                file = self.path / info.relative_path
                if file.is_file() and file.stat().st_size == info.length:
                    self._whole_files[index.fqn] = file

    def load_cost(self, fqn: str) -> int:
        """Bytes `load` holds at its peak: the tensor, twice when DCP's reader copies it."""
        shape, dtype = self.tensors[fqn]
        nbytes = torch.empty(shape, dtype=dtype, device="meta").nbytes
        return nbytes if fqn in self._whole_files else 2 * nbytes

    def load(self, fqn: str) -> torch.Tensor:
        """One tensor, whole: memory-mapped when it fills its own file, else via `dcp.load`."""
        shape, dtype = self.tensors[fqn]
        file = self._whole_files.get(fqn)
        if file is not None:
            try:
                tensor = torch.load(file, map_location="cpu", mmap=True, weights_only=True)
            except Exception:
                tensor = None
            if (
                isinstance(tensor, torch.Tensor)
                and tuple(tensor.shape) == shape
                and tensor.dtype == dtype
            ):
                return tensor
        out = {fqn: torch.empty(shape, dtype=dtype)}
        try:
            with _quiet_single_process():
                dcp.load(
                    out,
                    storage_reader=FileSystemReader(self.path),
                    planner=DefaultLoadPlanner(allow_partial_load=True),
                    no_dist=True,
                )
        except Exception as e:
            raise CheckpointError(
                f"{self.path} could not give tensor {fqn!r} ({type(e).__name__}: {e}); a data "
                "file of the checkpoint is missing or corrupt, re-save it."
            ) from None
        return out[fqn]
