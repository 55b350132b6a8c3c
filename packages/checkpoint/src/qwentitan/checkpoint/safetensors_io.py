"""Hugging Face model folders: validated lazy reads and streaming shard writes.

`HFFolder` is the workspace's one reader of a model folder's safetensors: the converter, the
`hf` modeling path (each FSDP rank reads only its rows) and launch's preflight all use it.

Headers are parsed and checked by the safetensors library (`safe_open`). Reads go straight
from the file into the destination tensor with `readinto` at the offset the
safetensors header gives, so nothing is memory-mapped: a memory map keeps every page it
touched resident until it is closed, which would make peak RSS the size of the model. Writes
lay out each shard's header first (all shapes are known up front) and then fill tensors in at
their offsets from any thread; writes into one shard take turns (see `ShardedWriter`).
"""

from __future__ import annotations

import contextlib
import ctypes
import json
import math
import os
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError, safe_open

from qwentitan.checkpoint.disk import copy_range, nbytes_of, start_writeback
from qwentitan.checkpoint.errors import CheckpointError
from qwentitan.checkpoint.files import member

INDEX = "model.safetensors.index.json"
SINGLE = "model.safetensors"
# to-dcp's record of how the source folder was sharded (tensor -> file), kept beside the DCP so
# to-hf can shard its export the same way: files of similar size that fill in parallel.
SHARD_PLAN = "hf_shards.json"
DEFAULT_SHARD_SIZE = "5GB"  # save_pretrained's default
# The safetensors format's dtype names (its spec), for the dtypes torch has.
_SAFETENSORS_DTYPES = {
    "F64": torch.float64,
    "F32": torch.float32,
    "F16": torch.float16,
    "BF16": torch.bfloat16,
    "I64": torch.int64,
    "I32": torch.int32,
    "I16": torch.int16,
    "I8": torch.int8,
    "U8": torch.uint8,
    "BOOL": torch.bool,
    "U16": torch.uint16,
    "U32": torch.uint32,
    "U64": torch.uint64,
    "F8_E4M3": torch.float8_e4m3fn,
    "F8_E5M2": torch.float8_e5m2,
}
_DTYPE_NAMES = {dtype: name for name, dtype in _SAFETENSORS_DTYPES.items()}


@dataclass(frozen=True, slots=True)
class StoredTensor:
    """Where one tensor's bytes lie in a safetensors file."""

    name: str
    file: Path
    dtype: torch.dtype
    shape: tuple[int, ...]
    start: int  # absolute byte offset in the file
    nbytes: int


def read_header(file: Path) -> tuple[dict[str, StoredTensor], dict[str, str]]:
    """Parse and check one safetensors file's header without reading its data.

    The safetensors library parses and validates the header (JSON, dtypes, offsets that tile
    the data exactly); each tensor's byte range, which the library does not expose, follows from
    its order (`offset_keys`) and sizes, since a valid file's tensors lie back to back.
    """
    try:
        with safe_open(file, framework="pt") as f:
            metadata = f.metadata() or {}
            entries = [(n, f.get_slice(n)) for n in f.offset_keys()]
            entries = [(n, s.get_dtype(), tuple(s.get_shape())) for n, s in entries]
        with open(file, "rb") as raw:
            data_start = 8 + int.from_bytes(raw.read(8), "little")
    except (SafetensorError, OSError) as e:
        why = str(e).removeprefix("Error while deserializing header: ")
        raise CheckpointError(
            f"{file} is truncated or corrupt ({why}); re-download or re-export this file."
        ) from None
    tensors: dict[str, StoredTensor] = {}
    at = data_start
    for name, dtype_name, shape in entries:
        dtype = _SAFETENSORS_DTYPES.get(dtype_name)
        if dtype is None:
            raise CheckpointError(
                f"{file} stores {name!r} as {dtype_name}, which torch has no dtype for; "
                "re-export the checkpoint in bf16, fp16 or fp32."
            )
        nbytes = nbytes_of(shape, dtype)
        tensors[name] = StoredTensor(name, file, dtype, shape, at, nbytes)
        at += nbytes
    return tensors, metadata


class HFFolder:
    """A Hugging Face model folder: one model.safetensors or shards with an index."""

    def __init__(self, path: Path | str):
        self.path = Path(path)
        if not self.path.is_dir():
            raise CheckpointError(
                f"{self.path} is not a folder; pass a Hugging Face model folder "
                f"holding {SINGLE} or {INDEX}."
            )
        self.tensors: dict[str, StoredTensor] = {}
        index = self.path / INDEX
        if index.is_file():
            self._read_index(index)
        elif (self.path / SINGLE).is_file():
            self.tensors, _ = read_header(self.path / SINGLE)
        else:
            raise CheckpointError(
                f"{self.path} holds neither {SINGLE} nor {INDEX}; pass the folder that "
                "save_pretrained wrote."
            )

    def _read_index(self, index: Path) -> None:
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
            assert isinstance(weight_map, dict)
        except (
            OSError,
            UnicodeDecodeError,
            json.JSONDecodeError,
            KeyError,
            TypeError,
            AssertionError,
        ):
            raise CheckpointError(
                f"{index} is not a valid index (no weight_map object); restore it from the "
                "model's original files."
            ) from None
        shards = {name: member(self.path, name, index) for name in weight_map.values()}
        for shard_name, shard in sorted(shards.items()):
            if not shard.is_file():
                raise CheckpointError(
                    f"{shard} is named in {index.name} but missing; download that shard into "
                    f"{self.path}."
                )
            found, _ = read_header(shard)
            for name, stored in found.items():
                if name in self.tensors:
                    raise CheckpointError(
                        f"tensor {name!r} is present in two shards, "
                        f"{self.tensors[name].file.name} and {shard.name}; remove the stale "
                        "copy or re-download the checkpoint."
                    )
                if weight_map.get(name) != shard_name:
                    raise CheckpointError(
                        f"tensor {name!r} is in {shard} but {index.name} places it in "
                        f"{weight_map.get(name)!r}; re-download the checkpoint or fix the index."
                    )
                self.tensors[name] = stored
        for name, shard_name in weight_map.items():
            if name not in self.tensors:
                raise CheckpointError(
                    f"{index.name} lists tensor {name!r} in {shard_name}, which does not hold "
                    "it; re-download that shard."
                )

    @property
    def files(self) -> list[Path]:
        """The safetensors files holding the tensors, in name order."""
        return sorted({stored.file for stored in self.tensors.values()})

    @property
    def shapes(self) -> dict[str, tuple[int, ...]]:
        """Every tensor's shape, by name."""
        return {name: stored.shape for name, stored in self.tensors.items()}

    def shape(self, name: str) -> tuple[int, ...]:
        return self.tensors[name].shape

    def read(self, name: str, out: torch.Tensor | None = None) -> torch.Tensor:
        """Read one tensor from disk into `out` (or a new tensor) without a memory map."""
        stored = self.tensors[name]
        if out is None:
            out = torch.empty(stored.shape, dtype=stored.dtype)
        read_into(stored, out)
        return out

    def read_region(self, name: str, region: tuple[slice, ...]) -> torch.Tensor:
        """The `region` (one slice per leading dim) of a tensor: only its rows of dim 0 are read
        from disk (rows are contiguous in the file), the other dims are sliced in memory."""
        stored = self.tensors[name]
        if not region or not stored.shape:
            return self.read(name)[region]
        start, stop, step = region[0].indices(stored.shape[0])
        rows = len(range(start, stop, step))
        if step != 1:
            return self.read(name)[region]
        row_bytes = stored.nbytes // stored.shape[0] if stored.shape[0] else 0
        part = StoredTensor(
            name,
            stored.file,
            stored.dtype,
            (rows, *stored.shape[1:]),
            stored.start + start * row_bytes,
            rows * row_bytes,
        )
        out = torch.empty(part.shape, dtype=part.dtype)
        read_into(part, out)
        return out[(slice(None), *region[1:])]


def read_into(stored: StoredTensor, out: torch.Tensor) -> None:
    """Fill `out` with the stored tensor's bytes."""
    if out.numel() == 0:
        return
    raw = byte_view(out)
    with open(stored.file, "rb", buffering=0) as f:
        f.seek(stored.start)
        view = raw
        done = 0
        while done < stored.nbytes:
            got = f.readinto(view[done:])
            if not got:
                raise CheckpointError(
                    f"{stored.file} ended while reading {stored.name!r}; the file was truncated "
                    "during conversion, re-download it."
                )
            done += got


def byte_view(tensor: torch.Tensor) -> memoryview:
    """A writable view of a contiguous CPU tensor's bytes.

    Not `tensor.numpy()`: exporting to numpy marks the storage non-resizable for good, and the
    DCP writer frees each written tensor's storage by resizing it to zero.
    """
    assert tensor.is_contiguous() and tensor.device.type == "cpu"
    array = (ctypes.c_char * tensor.nbytes).from_address(tensor.data_ptr())
    return memoryview(array).cast("B")


def parse_size(text: str | int) -> int:
    """'5GB' / '500MB' / '2GiB' / 1000 -> bytes (decimal units as transformers uses them)."""
    if isinstance(text, int):
        return text
    units = {
        "": 1,
        "B": 1,
        "KB": 10**3,
        "MB": 10**6,
        "GB": 10**9,
        "TB": 10**12,
        "KIB": 2**10,
        "MIB": 2**20,
        "GIB": 2**30,
        "TIB": 2**40,
    }
    s = text.strip().upper()
    number = s.rstrip("KMGTIB")
    try:
        value = float(number) * units[s[len(number) :]]
    except (ValueError, KeyError):
        raise CheckpointError(
            f"--max-shard-size {text!r} is not a size; write it like 5GB, 500MB or 2GiB."
        ) from None
    if not math.isfinite(value):  # float() reads inf, nan and 1e400 (inf)
        raise CheckpointError(
            f"--max-shard-size {text!r} is not a finite size; write it like 5GB, 500MB or 2GiB."
        )
    if value < 1:
        raise CheckpointError(f"--max-shard-size {text!r} must be positive; use e.g. 5GB.")
    return int(value)


Entry = tuple[str, torch.dtype, tuple[int, ...]]


def shard_groups(
    tensors: list[Entry], max_shard_bytes: int, files: dict[str, str] | None = None
) -> dict[str, list[Entry]]:
    """File name -> its tensors: as `files` (tensor -> file) says when given, else in order,
    a new shard whenever the next tensor would pass `max_shard_bytes` (save_pretrained's names)."""
    if files is not None:
        named: dict[str, list[Entry]] = {}
        for entry in tensors:
            named.setdefault(files[entry[0]], []).append(entry)
        return dict(sorted(named.items()))
    groups: list[list[Entry]] = [[]]
    size = 0
    for entry in tensors:
        nbytes = nbytes_of(entry[2], entry[1])
        if groups[-1] and size + nbytes > max_shard_bytes:
            groups.append([])
            size = 0
        groups[-1].append(entry)
        size += nbytes
    count = len(groups)
    if count == 1:
        return {SINGLE: groups[0]}
    return {f"model-{i + 1:05d}-of-{count:05d}.safetensors": g for i, g in enumerate(groups)}


class ShardedWriter:
    """Safetensors shards laid out up front, filled tensor by tensor from any thread.

    With `serial`, writes into one shard take turns under a lock per shard while different
    shards fill in parallel: a file system writes one file under one inode lock (ext4 and XFS
    take it for every buffered write), and threads contending for it can spin in the kernel
    (with 4 threads on one 3.4 GB shard, `perf` put 15% of to-hf's samples in
    `rwsem_spin_on_owner`). Without it, threads fill distinct offsets of a shard at once.
    """

    def __init__(
        self,
        folder: Path,
        tensors: list[Entry],
        max_shard_bytes: int,
        files: dict[str, str] | None = None,
        *,
        serial: bool = True,
    ):
        groups = shard_groups(tensors, max_shard_bytes, files)
        self.where: dict[str, tuple[int, int, int]] = {}  # name -> (fd, offset, nbytes)
        self._fds: list[int] = []
        self._sizes: dict[int, int] = {}  # fd -> the shard's size in bytes
        self._locks: dict[int, threading.Lock | contextlib.nullcontext] = {}
        self._serial = serial
        weight_map: dict[str, str] = {}
        total = 0
        for name, group in groups.items():
            total += self._lay_out(folder / name, group)
            weight_map |= dict.fromkeys((t for t, _, _ in group), name)
        if list(groups) != [SINGLE]:
            # Like save_pretrained, a single model.safetensors has no index: torchtitan's
            # adapter reads shard numbers out of index file names and fails on one without.
            # save_pretrained's metadata: bytes of the tensors and the parameters they hold
            parameters = sum(math.prod(shape) for _, _, shape in tensors)
            metadata = {"total_parameters": parameters, "total_size": total}
            index = {"metadata": metadata, "weight_map": weight_map}
            (folder / INDEX).write_text(json.dumps(index, indent=2, sort_keys=True) + "\n")

    def _lay_out(self, file: Path, group: list[Entry]) -> int:
        """Create `file` with its header and its full (sparse) size; the data bytes it holds."""
        header: dict[str, Any] = {"__metadata__": {"format": "pt"}}
        offset = 0
        for tname, dtype, shape in group:
            nbytes = nbytes_of(shape, dtype)
            header[tname] = {
                "dtype": _DTYPE_NAMES[dtype],
                "shape": list(shape),
                "data_offsets": [offset, offset + nbytes],
            }
            offset += nbytes
        raw = json.dumps(header, separators=(",", ":")).encode()
        raw += b" " * (-len(raw) % 8)  # safetensors aligns the data start to 8 bytes
        fd = os.open(file, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o644)
        self._fds.append(fd)
        self._locks[fd] = threading.Lock() if self._serial else contextlib.nullcontext()
        os.pwrite(fd, len(raw).to_bytes(8, "little") + raw, 0)
        os.ftruncate(fd, 8 + len(raw) + offset)
        self._sizes[fd] = 8 + len(raw) + offset
        for tname, dtype, shape in group:
            start = header[tname]["data_offsets"][0]
            self.where[tname] = (fd, 8 + len(raw) + start, nbytes_of(shape, dtype))
        return offset

    def write(self, name: str, tensor: torch.Tensor, offset: int = 0) -> None:
        """Write `tensor`'s bytes into `name`'s place, from byte `offset` of it (a row chunk)."""
        fd, start, nbytes = self.where[name]
        if tensor.numel() == 0:
            return
        tensor = tensor.contiguous()
        view = byte_view(tensor)
        assert offset + len(view) <= nbytes, name
        with self._locks[fd]:
            done = 0
            while done < len(view):
                done += os.pwrite(fd, view[done:], start + offset + done)
            start_writeback(fd, start + offset, done)

    def place(self, name: str) -> float:
        """Where `name`'s bytes start in its shard, as a fraction of the shard (0 to 1)."""
        fd, start, _ = self.where[name]
        return start / self._sizes[fd]

    def follows(self, name: str, previous: str) -> bool:
        """Whether `name`'s bytes start where `previous`'s end, in the same shard."""
        fd, start, _ = self.where[name]
        prev_fd, prev_start, prev_size = self.where[previous]
        return fd == prev_fd and start == prev_start + prev_size

    def copy(self, name: str, src: Path, offset: int, nbytes: int, at: int = 0) -> None:
        """Copy `nbytes` from `offset` of file `src` into the shard from byte `at` of `name`'s
        place on (possibly on into the tensors that follow it in the shard), in the kernel."""
        fd, start, _ = self.where[name]
        assert start + at + nbytes <= os.fstat(fd).st_size, name
        with self._locks[fd]:
            copy_range(src, fd, offset, nbytes, start + at, "re-save it")

    def close(self, sync: bool = True) -> None:
        for fd in self._fds:
            if sync:
                os.fsync(fd)
            os.close(fd)
        self._fds = []
