"""Reading a DCP folder: its tensors' names, shapes and dtypes, and where their bytes lie.

The metadata is read with `MetadataUnpickler` (nothing in it can run code). Each stored chunk
that holds whole rows of a tensor as a plain torch.save record (what `to-dcp` writes, and what
torchtitan's FSDP saves for dim-0 shards, one file per rank or not) is located down to its data
bytes, which `to-hf` then copies file to file and `verify` reads straight into a tensor. Any
other layout goes through `dcp.load`, one tensor at a time, with the same safe metadata reader.
"""

from __future__ import annotations

import itertools
import os
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import torch

from qwentitan.checkpoint.dcp_metadata import METADATA, read_dcp_metadata
from qwentitan.checkpoint.dcp_record import data_range
from qwentitan.checkpoint.disk import Shape, nbytes_of
from qwentitan.checkpoint.errors import CheckpointError
from qwentitan.checkpoint.files import member
from qwentitan.checkpoint.safetensors_io import byte_view


class MemoryBudget:
    """Bytes of tensors allowed in flight at once across threads (a counting semaphore).

    A request larger than the whole budget waits until nothing else is in flight, so one
    piece that must be loaded whole always gets through.
    """

    def __init__(self, limit: int):
        self.limit = limit
        self.peak = 0  # the most bytes ever in flight at once
        self._used = 0
        self._cond = threading.Condition()

    @contextmanager
    def hold(self, nbytes: int) -> Iterator[None]:
        nbytes = min(nbytes, self.limit)
        with self._cond:
            self._cond.wait_for(lambda: self._used + nbytes <= self.limit)
            self._used += nbytes
            self.peak = max(self.peak, self._used)
        try:
            yield
        finally:
            with self._cond:
                self._used -= nbytes
                self._cond.notify_all()


@dataclass(frozen=True, slots=True)
class Rows:
    """Rows [start, stop) along dim 0 of one DCP tensor, loadable on their own."""

    fqn: str
    start: int
    stop: int
    cost: int  # bytes held while loaded: the rows, twice when DCP's reader copies them
    file: Path | None  # the file holding these rows as plain bytes; None: through dcp.load
    data: int = 0  # where in `file` the rows' bytes start


class DCPFolder:
    """A DCP checkpoint folder: its tensors' names, shapes and dtypes, read piece by piece."""

    def __init__(self, path: Path | str):
        self.path = Path(path)
        if not self.path.is_dir():
            raise CheckpointError(
                f"{self.path} is not a folder; pass a DCP checkpoint folder (one holding {METADATA})."
            )
        metadata = read_dcp_metadata(self.path, light=True)
        self.tensors: dict[str, tuple[Shape, torch.dtype]] = {}
        for fqn, md in metadata.state_dict_metadata.items():
            if type(md).__name__ == "TensorStorageMetadata":
                dtype = getattr(md.properties, "dtype", None)
                if not isinstance(dtype, torch.dtype):
                    raise CheckpointError(
                        f"{self.path / METADATA} gives {fqn!r} no dtype; the checkpoint is "
                        "corrupt, re-save it."
                    )
                self.tensors[fqn] = (tuple(md.size), dtype)
        # Every data file the metadata names must hold the bytes it points at: a missing or
        # truncated .distcp is named here rather than failing deep inside dcp.load.
        self.storage: dict[str, set[tuple[Path, int, int]]] = {}
        sizes: dict[Path, int] = {}
        slabs: dict[str, list[Rows]] = {}
        for index, info in (metadata.storage_data or {}).items():
            file = member(self.path, info.relative_path, self.path / METADATA)
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
            rows = self._plain_rows(metadata, index, info, file)
            if rows is not None:
                slabs.setdefault(index.fqn, []).append(rows)
        # Tensors whose row chunks all lie as plain bytes, covering every row once.
        self._slabs: dict[str, list[Rows]] = {}
        for fqn, pieces in slabs.items():
            pieces.sort(key=lambda r: r.start)
            rows = self.tensors[fqn][0][0]
            contiguous = all(a.stop == b.start for a, b in itertools.pairwise(pieces))
            if pieces[0].start == 0 and pieces[-1].stop == rows and contiguous:
                self._slabs[fqn] = pieces

    def _plain_rows(self, metadata, index, info, file: Path) -> Rows | None:
        """The rows a storage entry holds, when they are whole rows stored as plain bytes."""
        if index.fqn not in self.tensors or getattr(info, "transform_descriptors", None):
            return None
        shape, dtype = self.tensors[index.fqn]
        chunk = _chunk_at(metadata.state_dict_metadata[index.fqn], index)
        if (
            chunk is None
            or not shape
            or tuple(chunk.offsets[1:]) != (0,) * (len(shape) - 1)
            or tuple(chunk.sizes[1:]) != shape[1:]
        ):
            return None
        found = data_range(file, info.offset, info.length)
        if found is None or found.dtype != dtype or found.shape != tuple(chunk.sizes):
            return None
        start, stop = chunk.offsets[0], chunk.offsets[0] + chunk.sizes[0]
        return Rows(index.fqn, start, stop, found.nbytes, file, found.start)

    def held_shapes(self) -> dict[str, Shape]:
        """Every tensor's shape, its leading dim capped by the bytes stored for it: what the
        folder can really hold, to bound loops over a count a config.json gives (the
        metadata alone may claim any size)."""
        out = {}
        for fqn, (shape, _) in self.tensors.items():
            stored = sum(length for _, _, length in self.storage.get(fqn, ()))
            out[fqn] = (min(shape[0], stored), *shape[1:]) if shape else shape
        return out

    def rows(self, fqn: str) -> list[Rows]:
        """The pieces `load_rows` can load `fqn` in: its row chunks, or the whole tensor."""
        if fqn in self._slabs:
            return self._slabs[fqn]
        shape, dtype = self.tensors[fqn]
        return [Rows(fqn, 0, shape[0] if shape else 1, 2 * nbytes_of(shape, dtype), None)]

    def load_cost(self, fqn: str) -> int:
        """Bytes `load` holds at its peak: the tensor, plus DCP's copy of it when it goes
        through `dcp.load`."""
        pieces = self.rows(fqn)
        return pieces[0].cost if len(pieces) == 1 else nbytes_of(*self.tensors[fqn])

    def load_rows(self, rows: Rows, out: torch.Tensor | None = None) -> torch.Tensor:
        """The rows of one piece: read from their file into `out` (or a new tensor), else via
        `dcp.load` (the whole tensor, for a piece with no file)."""
        shape, dtype = self.tensors[rows.fqn]
        if rows.file is None:
            return self._dcp_load(rows.fqn)
        if out is None:
            out = torch.empty((rows.stop - rows.start, *shape[1:]), dtype=dtype)
        view = byte_view(out) if out.numel() else memoryview(b"")
        done = 0
        with open(rows.file, "rb", buffering=0) as f:
            while done < len(view):
                got = os.preadv(f.fileno(), [view[done:]], rows.data + done)
                if not got:
                    raise CheckpointError(
                        f"{rows.file} ended while reading {rows.fqn!r}; the file was truncated "
                        "during the run, copy it again."
                    )
                done += got
        return out

    def _dcp_load(self, fqn: str) -> torch.Tensor:
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.api import CheckpointException
        from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner

        from qwentitan.checkpoint.safe_reader import SafeFileSystemReader

        shape, dtype = self.tensors[fqn]
        out = {fqn: torch.empty(shape, dtype=dtype)}
        try:
            dcp.load(
                out,
                storage_reader=SafeFileSystemReader(self.path),
                planner=DefaultLoadPlanner(allow_partial_load=True),
                no_dist=True,
            )
        except (Exception, CheckpointException):  # DCP's own derives from BaseException
            files = sorted({file for file, _, _ in self.storage.get(fqn, ())})
            where = ", ".join(str(f) for f in files[:3]) or str(self.path)
            raise CheckpointError(
                f"{where} is corrupt: tensor {fqn!r} cannot be read from it; copy the "
                "file again or re-save the checkpoint."
            ) from None
        return out[fqn]

    def load_range(self, fqn: str, start: int, stop: int) -> torch.Tensor:
        """Rows [start, stop) of one tensor, from the pieces that hold them."""
        pieces = self.rows(fqn)
        if pieces[0].file is None:
            return self._dcp_load(fqn)[start:stop]
        shape, dtype = self.tensors[fqn]
        out = torch.empty((stop - start, *shape[1:]), dtype=dtype)
        for rows in pieces:
            lo, hi = max(rows.start, start), min(rows.stop, stop)
            if lo < hi:
                out[lo - start : hi - start] = self.load_rows(rows)[
                    lo - rows.start : hi - rows.start
                ]
        return out

    def load(self, fqn: str) -> torch.Tensor:
        """One tensor, whole, assembled from its pieces."""
        pieces = self.rows(fqn)
        if pieces[0].file is None:
            return self._dcp_load(fqn)
        shape, dtype = self.tensors[fqn]
        out = torch.empty(shape, dtype=dtype)
        for rows in pieces:
            self.load_rows(rows, out[rows.start : rows.stop])
        return out


def _chunk_at(md, index):
    """The chunk a storage entry holds (DCP's index hint, checked against the offsets)."""
    chunks = getattr(md, "chunks", None) or []
    hint = index.index
    if (
        hint is not None
        and hint < len(chunks)
        and tuple(chunks[hint].offsets) == tuple(index.offset)
    ):
        return chunks[hint]
    for chunk in chunks:
        if tuple(chunk.offsets) == tuple(index.offset or ()):
            return chunk
    return None
