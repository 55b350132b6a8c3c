"""torch Distributed Checkpoint folders, written and read through DCP's own public API.

Writing: `dcp.save` plans from meta tensors (shapes and dtypes only) and a planner whose
`resolve_data` reads each piece from the source only when a writer thread asks for it, so
the model is never held whole. Large tensors are saved as row chunks along dim 0, the layout an
FSDP training job writes, so the writer threads overlap reading and writing in pieces of a
bounded size instead of waiting for one another on a whole stacked-experts tensor.
Reading: row chunks stored alone in their files are memory-mapped piece by piece; anything
else (other shardings, one file per rank) goes through `dcp.load` with partial loading.
"""

from __future__ import annotations

import dataclasses
import itertools
import mmap
import os
import pickle
import re
import threading
import warnings
import weakref
import zipfile
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemReader, FileSystemWriter
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner, DefaultSavePlanner
from torch.distributed.checkpoint.filesystem import FileSystem
from torch.distributed.checkpoint.metadata import (
    ChunkStorageMetadata,
    Metadata,
    MetadataIndex,
    TensorProperties,
    TensorStorageMetadata,
)
from torch.distributed.checkpoint.planner import (
    TensorWriteData,
    WriteItem,
    WriteItemType,
)

from qwentitan.checkpoint.disk import Shape, copy_range, nbytes_of
from qwentitan.checkpoint.errors import CheckpointError

METADATA = ".metadata"


@dataclass(frozen=True, slots=True)
class FileBytes:
    """A piece's bytes as they already lie in files: (path, offset, nbytes) parts, in order."""

    parts: tuple[tuple[Path, int, int], ...]

    @property
    def nbytes(self) -> int:
        return sum(n for _, _, n in self.parts)


# (start, stop, out) -> rows [start, stop) of a tensor along dim 0, given one of three ways:
# filled into `out` (returns None); as one file region, nothing read (returns its FileBytes);
# or both, filled into `out` from several regions (returns their FileBytes). DCP's writer
# copies FileBytes file to file, falling back to writing the tensor's bytes.
Producer = Callable[[int, int, torch.Tensor], FileBytes | None]
# Below this, a piece is written the ordinary way (a file-to-file copy saves nothing).
_SPLICE_MIN = 1 << 20
_STORAGE_RECORD = re.compile(r"(?:.*/)?data/\d+")  # a storage's record in a torch.save zip


def row_chunks(shape: Shape, dtype: torch.dtype, chunk_bytes: int) -> list[tuple[int, int]]:
    """[start, stop) row ranges along dim 0 of at most `chunk_bytes` each (at least one row)."""
    rows = shape[0] if shape else 1
    row_bytes = nbytes_of(shape[1:], dtype)
    step = max(1, chunk_bytes // max(row_bytes, 1))
    return [(start, min(start + step, rows)) for start in range(0, rows, step)] or [(0, 0)]


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
    """DCP's local file system, telling the planner when a written file is closed, and
    copying pieces that lie in a source file file-to-file (see `_SplicingWriter`)."""

    def __init__(
        self, on_close: Callable[[], None], source_of: Callable[[int, int], FileBytes | None]
    ):
        super().__init__()
        self._on_close = on_close
        self._source_of = source_of

    @contextmanager
    def create_stream(self, path, mode):  # type: ignore[override]
        with super().create_stream(path, mode) as stream:
            yield _SplicingWriter(stream, self._source_of)
        self._on_close()


class _SplicingWriter:
    """A file stream for `torch.save` that copies a piece's source regions with copy_file_range.

    torch.save writes a tensor's storage in one `write` of its bytes. When that storage is a
    piece the planner knows the source regions of (`FileBytes`: a read-only map of one region,
    or a thread buffer filled from several), the kernel copies the regions file to file
    instead: no page of a map is ever touched, and on the development VM copying through user
    memory cost several times the system time of `cp` (3.4 GB: 2.4 s from a file map, 11 s from
    anonymous memory, 1.4 s file to file).
    """

    def __init__(self, stream, source_of: Callable[[int, int], FileBytes | None]):
        self._stream = stream
        self._source_of = source_of

    def write(self, data) -> int:
        view = memoryview(data)
        source = None
        if view.nbytes >= _SPLICE_MIN:
            with warnings.catch_warnings():  # read-only bytes, only their address is taken
                warnings.simplefilter("ignore", UserWarning)
                address = torch.frombuffer(view, dtype=torch.uint8).data_ptr()
            source = self._source_of(address, view.nbytes)
        if source is None or not self._splice(source):
            return self._stream.write(data)
        return view.nbytes

    def _splice(self, source: FileBytes) -> bool:
        self._stream.flush()
        start = at = self._stream.tell()
        for path, offset, nbytes in source.parts:
            if not copy_range(path, self._stream.fileno(), offset, nbytes, at, "re-download it"):
                if at > start:
                    raise RuntimeError(f"copy_file_range stopped working midway at {path}")
                return False  # no file-to-file copy between these file systems
            at += nbytes
        self._stream.seek(at)
        return True

    def __getattr__(self, name: str):  # tell, flush, fileno, close, ... of the file itself
        return getattr(self._stream, name)


class _InFlight:
    """The tensor a writer thread is writing, until that thread asks for its next one."""

    __slots__ = ("__weakref__", "finalizer", "tensor")

    def __init__(self, tensor: torch.Tensor):
        self.tensor = tensor
        self.finalizer: weakref.finalize | None = None


class _LazySavePlanner(DefaultSavePlanner):
    """Hands DCP each piece only when a writer thread is about to write it.

    A piece lying whole in one source region is handed over as a read-only map of it (nothing
    read); any other is filled into one buffer of the writer thread's own, over and over: a
    fresh allocation per piece would cost the kernel a page fault and a zeroed page for every
    4 KiB (several times the time of the write itself). FileSystemWriter keeps a reference to
    the piece it last wrote until it resolves the next one; that piece is already on disk and
    never read again, so the buffer is reused and the piece's bytes returned to the budget
    before the next is produced.
    """

    def __init__(
        self,
        specs: dict[str, tuple[Shape, torch.dtype]],
        producers: dict[str, Producer],
        budget: MemoryBudget,
        on_written: Callable[[int], None],
        chunk_bytes: int,
    ):
        super().__init__(dedup_save_to_lowest_rank=False)
        self._specs = specs
        self._chunk_bytes = chunk_bytes
        self._producers = producers
        self._budget = budget
        self._on_written = on_written
        self._last = threading.local()  # .item: the piece in flight; .buffer: the thread's bytes
        self._mapped: dict[tuple[int, int], FileBytes] = {}  # (address, nbytes) of live maps
        self.resolved: set[tuple[str, int]] = set()  # (fqn, first row) of each piece produced
        self.pieces = 0
        # FileSystemWriter's extra threads swallow exceptions (the thread just ends and its
        # files are missing from .metadata), so the first failure is kept and re-raised.
        self.error: BaseException | None = None
        self.threads: set[threading.Thread] = set()

    def create_local_plan(self):  # type: ignore[override]
        # DCP's own plan writes each plain tensor whole; here large ones become row chunks,
        # as DCP writes the dim-0 shards of an FSDP model (same metadata, same loading path).
        plan = super().create_local_plan()
        items = []
        for fqn, (shape, dtype) in self._specs.items():
            chunks = row_chunks(shape, dtype, self._chunk_bytes)
            for start, stop in chunks:
                offsets = torch.Size([start, *(0 for _ in shape[1:])] if shape else [])
                sizes = torch.Size([stop - start, *shape[1:]] if shape else [])
                items.append(
                    WriteItem(
                        index=MetadataIndex(fqn, offsets),
                        type=WriteItemType.SHARD if len(chunks) > 1 else WriteItemType.TENSOR,
                        tensor_data=TensorWriteData(
                            chunk=ChunkStorageMetadata(offsets=offsets, sizes=sizes),
                            properties=TensorProperties(dtype=dtype),
                            size=torch.Size(shape),
                        ),
                    )
                )
        self.pieces = len(items)
        self.plan = dataclasses.replace(plan, items=items)
        return self.plan

    def _retire_previous(self) -> None:
        previous = getattr(self._last, "item", None)
        if previous is None:
            return
        self._last.item = None
        previous.finalizer()  # counts the bytes as written and returns them to the budget, once

    def _written(self, taken: int, nbytes: int, address: int) -> None:
        self._mapped.pop((address, nbytes), None)
        self._budget.release(taken)
        self._on_written(nbytes)

    def resolve_data(self, write_item):  # type: ignore[override]
        self._retire_previous()
        self.threads.add(threading.current_thread())
        if self.error is not None:  # another thread failed: stop writing
            raise RuntimeError("DCP save aborted after an earlier error")
        fqn = write_item.index.fqn
        chunk = write_item.tensor_data.chunk
        start = chunk.offsets[0] if len(chunk.offsets) else 0
        stop = start + chunk.sizes[0] if len(chunk.sizes) else 1
        dtype = write_item.tensor_data.properties.dtype
        nbytes = nbytes_of(tuple(chunk.sizes), dtype)
        taken = self._budget.acquire(nbytes)
        try:
            out = self._thread_buffer(nbytes, dtype).view(tuple(chunk.sizes))
            source = self._producers[fqn](start, stop, out)
            tensor = self._map(source, out) if source and len(source.parts) == 1 else out
            if source is not None:  # forgotten when retired
                self._mapped[(tensor.data_ptr(), source.nbytes)] = source
        except BaseException as e:
            self._budget.release(taken)
            self.error = self.error or e
            raise
        self.resolved.add((fqn, start))
        # The thread-local record holds the tensor itself: DCP keeps only a detached alias of
        # it, so watching the returned object would release the budget at once. The record
        # also dies with its writer thread, which then returns the bytes.
        record = _InFlight(tensor)
        record.finalizer = weakref.finalize(
            record, self._written, taken, tensor.nbytes, tensor.data_ptr()
        )
        self._last.item = record
        return tensor

    def _map(self, source: FileBytes, like: torch.Tensor) -> torch.Tensor:
        """The source bytes as a tensor like `like` over a read-only map of just that region.

        torch.save needs a tensor; its one write of these bytes is turned into a file-to-file
        copy by `_SplicingWriter`, so the map only lends them an address.
        """
        ((path, offset, nbytes),) = source.parts
        assert nbytes == like.nbytes, source
        aligned = offset - offset % mmap.ALLOCATIONGRANULARITY
        with open(path, "rb", buffering=0) as f:
            mapped = mmap.mmap(
                f.fileno(), offset + nbytes - aligned, offset=aligned, access=mmap.ACCESS_READ
            )
        view = memoryview(mapped)[offset - aligned :]
        with warnings.catch_warnings():  # read-only: DCP and torch.save only read it
            warnings.simplefilter("ignore", UserWarning)
            tensor = torch.frombuffer(view, dtype=torch.uint8)
        return tensor.view(like.dtype).view(like.shape)

    def source_of(self, address: int, nbytes: int) -> FileBytes | None:
        return self._mapped.get((address, nbytes))

    def _thread_buffer(self, nbytes: int, dtype: torch.dtype) -> torch.Tensor:
        """`nbytes` of this thread's buffer as a 1-D `dtype` tensor whose storage is exactly
        those bytes (DCP would copy a view of a larger storage before writing it)."""
        buffer = getattr(self._last, "buffer", None)
        if buffer is None or buffer.numel() < nbytes:
            buffer = self._last.buffer = torch.empty(nbytes, dtype=torch.uint8)
        if nbytes == 0:
            return torch.empty(0, dtype=dtype)
        # Through numpy, so the returned tensor keeps the buffer alive even after it is replaced.
        return torch.frombuffer(buffer.numpy()[:nbytes], dtype=dtype)

    def finish_thread(self) -> None:
        self._retire_previous()


def save(
    folder: Path,
    specs: dict[str, tuple[Shape, torch.dtype]],
    producers: dict[str, Producer],
    *,
    threads: int,
    budget: MemoryBudget,
    on_written: Callable[[int], None],
    chunk_bytes: int,
    aliases: dict[str, str] | None = None,
) -> None:
    """Write a DCP checkpoint of `specs` (fqn -> shape, dtype), one file per row chunk.

    Tensors larger than `chunk_bytes` are saved in row chunks along dim 0; `producers[fqn]`
    gives the rows of one chunk when a writer thread is about to write it.

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
    planner = _LazySavePlanner(specs, producers, budget, on_written, chunk_bytes)
    # One file per chunk: with one file per thread, FileSystemWriter keeps every tensor of a
    # file referenced until the file is closed, i.e. the whole model.
    # No fsync per file: the caller syncs the whole folder once before renaming it into place.
    # No copy-ahead: each thread's one buffer holds the piece it is writing, nothing else.
    writer = FileSystemWriter(
        folder,
        single_file_per_rank=False,
        thread_count=threads,
        sync_files=False,
        per_thread_copy_ahead=0,
    )
    # Each file holds one chunk: when its stream closes, that chunk is on disk, so retire it
    # there and then (a thread that waits in join() must not keep holding the budget).
    writer.fs = _RetiringFileSystem(planner.finish_thread, planner.source_of)
    # FileSystemWriter's extra threads end on an exception (a full disk, say), which Python
    # would print as a traceback: keep it as the error to raise instead.
    previous_hook = threading.excepthook

    def keep_writer_error(args: threading.ExceptHookArgs) -> None:
        if args.thread in planner.threads and args.exc_value is not None:
            planner.error = planner.error or args.exc_value
        else:
            previous_hook(args)

    threading.excepthook = keep_writer_error
    try:
        with _quiet_single_process():
            dcp.save(meta, storage_writer=writer, planner=planner, no_dist=True)
        if aliases:
            _add_aliases(folder, aliases)
    except BaseException as e:  # DCP's CheckpointException derives from BaseException
        # When the calling thread fails (or is interrupted by a signal), DCP returns without
        # joining its other writer threads: stop them at their next piece and wait for them,
        # so nothing writes into the folder after it is removed.
        planner.error = planner.error or e
        for thread in planner.threads - {threading.current_thread()}:
            thread.join()
        if planner.error is not e:
            raise planner.error from None
        raise
    finally:
        threading.excepthook = previous_hook
        planner.finish_thread()
        torch.serialization.set_crc32_options(crc32)
    if planner.error is not None:
        raise planner.error
    if len(planner.resolved) != planner.pieces:
        missing = sorted(set(specs) - {fqn for fqn, _ in planner.resolved})
        raise RuntimeError(
            f"DCP save wrote {len(planner.resolved)} of {planner.pieces} pieces"
            + (f", none of {missing[0]!r}" if missing else "")
        )


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


@dataclass(frozen=True, slots=True)
class Rows:
    """Rows [start, stop) along dim 0 of one DCP tensor, loadable on their own."""

    fqn: str
    start: int
    stop: int
    cost: int  # bytes held while loaded: the rows, twice when DCP's reader copies them
    file: Path | None  # the file holding exactly these rows; None: through dcp.load


class DCPFolder:
    """A DCP checkpoint folder: its tensors' names, shapes and dtypes, read piece by piece."""

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
        self.tensors: dict[str, tuple[Shape, torch.dtype]] = {
            fqn: (tuple(md.size), md.properties.dtype)
            for fqn, md in metadata.state_dict_metadata.items()
            if isinstance(md, TensorStorageMetadata)
        }
        # Every data file the metadata names must hold the bytes it points at: a missing or
        # truncated .distcp is named here rather than failing deep inside dcp.load.
        # fqn -> (data file, offset, length) of each stored piece
        self.storage: dict[str, set[tuple[Path, int, int]]] = {}
        sizes: dict[Path, int] = {}
        for index, info in (metadata.storage_data or {}).items():
            file = self.path / info.relative_path
            if file not in sizes:
                try:
                    sizes[file] = file.stat().st_size
                except FileNotFoundError:
                    raise CheckpointError(
                        f"{file} is missing (named in {METADATA} for {index.fqn!r}); the "
                        "checkpoint is incomplete, copy that file again or re-save it."
                    ) from None
            if sizes[file] < info.offset + info.length:
                raise CheckpointError(
                    f"{file} is truncated: it holds {sizes[file]} bytes but {METADATA} places "
                    f"{index.fqn!r} up to byte {info.offset + info.length}; copy that file "
                    "again or re-save the checkpoint."
                )
            self.storage.setdefault(index.fqn, set()).add((file, info.offset, info.length))
        # Tensors stored as full-width row chunks, each alone in its file (what `save` and an
        # FSDP job's one-file-per-tensor save write): loadable by mapping each chunk's file
        # instead of reading it into a buffer and copying that into the target.
        slabs: dict[str, list[Rows]] = {}
        for index, info in (metadata.storage_data or {}).items():
            md = self.tensors.get(index.fqn)
            if md is None:
                continue
            shape, dtype = md
            chunk = _chunk_at(metadata.state_dict_metadata[index.fqn], index)
            file = self.path / info.relative_path
            if (
                chunk is not None
                and shape
                and tuple(chunk.offsets[1:]) == (0,) * (len(shape) - 1)
                and tuple(chunk.sizes[1:]) == shape[1:]
                and info.offset == 0
                and not getattr(info, "transform_descriptors", None)
                and file.is_file()
                and file.stat().st_size == info.length
            ):
                start, stop = chunk.offsets[0], chunk.offsets[0] + chunk.sizes[0]
                cost = nbytes_of((stop - start, *shape[1:]), dtype)
                slabs.setdefault(index.fqn, []).append(Rows(index.fqn, start, stop, cost, file))
        self._slabs: dict[str, list[Rows]] = {}
        for fqn, pieces in slabs.items():
            pieces.sort(key=lambda r: r.start)
            rows = self.tensors[fqn][0][0]
            contiguous = all(a.stop == b.start for a, b in itertools.pairwise(pieces))
            if pieces[0].start == 0 and pieces[-1].stop == rows and contiguous:
                self._slabs[fqn] = pieces

    def rows(self, fqn: str) -> list[Rows]:
        """The pieces `load_rows` can load `fqn` in: its row chunks, or the whole tensor."""
        if fqn in self._slabs:
            return self._slabs[fqn]
        shape, dtype = self.tensors[fqn]
        return [Rows(fqn, 0, shape[0] if shape else 1, 2 * nbytes_of(shape, dtype), None)]

    def load_cost(self, fqn: str) -> int:
        """Bytes `load` holds at its peak: the tensor, plus one mapped chunk or DCP's copy."""
        pieces = self.rows(fqn)
        nbytes = nbytes_of(*self.tensors[fqn])
        if len(pieces) == 1:
            return pieces[0].cost
        return nbytes + max(r.cost for r in pieces)

    def load_rows(self, rows: Rows) -> torch.Tensor:
        """The rows of one piece: memory-mapped from its own file, else via `dcp.load`."""
        shape, dtype = self.tensors[rows.fqn]
        if rows.file is not None:
            try:
                tensor = torch.load(rows.file, map_location="cpu", mmap=True, weights_only=True)
            except Exception:
                tensor = None
            want = (rows.stop - rows.start, *shape[1:])
            if (
                isinstance(tensor, torch.Tensor)
                and tuple(tensor.shape) == want
                and tensor.dtype == dtype
            ):
                return tensor
        out = {rows.fqn: torch.empty(shape, dtype=dtype)}
        try:
            with _quiet_single_process():
                dcp.load(
                    out,
                    storage_reader=FileSystemReader(self.path),
                    planner=DefaultLoadPlanner(allow_partial_load=True),
                    no_dist=True,
                )
        except (Exception, CheckpointException):  # DCP's own derives from BaseException
            files = sorted({file for file, _, _ in self.storage.get(rows.fqn, ())})
            where = ", ".join(str(f) for f in files[:3]) or str(self.path)
            raise CheckpointError(
                f"{where} is corrupt: tensor {rows.fqn!r} cannot be read from it; copy the "
                "file again or re-save the checkpoint."
            ) from None
        value = out[rows.fqn]
        return value if rows.file is None else value[rows.start : rows.stop]

    def load_range(self, fqn: str, start: int, stop: int) -> torch.Tensor:
        """Rows [start, stop) of one tensor, from the pieces that hold them."""
        shape, dtype = self.tensors[fqn]
        out = torch.empty((stop - start, *shape[1:]), dtype=dtype)
        for rows in self.rows(fqn):
            lo, hi = max(rows.start, start), min(rows.stop, stop)
            if lo < hi:
                out[lo - start : hi - start] = self.load_rows(rows)[
                    lo - rows.start : hi - rows.start
                ]
        return out

    def data_offset(self, rows: Rows) -> int | None:
        """Where the raw bytes of a piece alone in its file start, for file-to-file copies.

        The file is torch.save's zip (stored, not compressed) holding the piece's storage as
        one record; None when it is not laid out that way.
        """
        if rows.file is None:
            return None
        shape, dtype = self.tensors[rows.fqn]
        nbytes = nbytes_of((rows.stop - rows.start, *shape[1:]), dtype)
        try:
            with zipfile.ZipFile(rows.file) as archive:
                records = [i for i in archive.infolist() if _STORAGE_RECORD.fullmatch(i.filename)]
            if (
                len(records) != 1
                or records[0].compress_type != zipfile.ZIP_STORED
                or records[0].file_size != nbytes
            ):
                return None
            with open(rows.file, "rb") as f:
                f.seek(records[0].header_offset)
                header = f.read(30)  # the zip local file header, then its name and extra field
            if header[:4] != b"PK\x03\x04":
                return None
            name_len = int.from_bytes(header[26:28], "little")
            extra_len = int.from_bytes(header[28:30], "little")
            return records[0].header_offset + 30 + name_len + extra_len
        except (OSError, zipfile.BadZipFile):
            return None

    def load(self, fqn: str) -> torch.Tensor:
        """One tensor, whole, assembled from its pieces."""
        pieces = self.rows(fqn)
        if len(pieces) == 1:
            return self.load_rows(pieces[0])
        shape, dtype = self.tensors[fqn]
        out = torch.empty(shape, dtype=dtype)
        for rows in pieces:
            out[rows.start : rows.stop] = self.load_rows(rows)
        return out


def _chunk_at(md, index: MetadataIndex) -> ChunkStorageMetadata | None:
    """The chunk a storage entry holds (DCP's index hint, checked against the offsets)."""
    if not isinstance(md, TensorStorageMetadata):
        return None
    chunks = md.chunks
    hint = index.index
    if hint is not None and hint < len(chunks) and chunks[hint].offsets == index.offset:
        return chunks[hint]
    for chunk in chunks:
        if tuple(chunk.offsets) == tuple(index.offset):
            return chunk
    return None
