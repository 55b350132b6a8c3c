"""One tensor as DCP stores it: a `torch.save` record (DCP's default TORCH_SAVE format).

A record is torch.save's zip archive, stored, not compressed: small entries (the pickle that
rebuilds the tensor, version marks), then the tensor's bytes as one entry at a 64-byte aligned
offset, then a few more small entries and the zip directory. Only the data entry depends on
the values, so a record is written as `framing(shape, dtype)`'s head, the data copied file to
file in the kernel, and its tail; and read back by finding the data entry's byte range
(`data_range`). DCP's `FileSystemReader` reads such a record with `torch.load` like any other.
"""

from __future__ import annotations

import collections
import functools
import io
import os
import pickle
import struct
import threading
import warnings
from dataclasses import dataclass
from pathlib import Path

import torch

from qwentitan.checkpoint.disk import Shape

_lock = threading.Lock()
# torch's storage class names (what the record's pickle names) for the dtypes weights have.
_STORAGE_DTYPES = {
    "BFloat16Storage": torch.bfloat16,
    "FloatStorage": torch.float32,
    "HalfStorage": torch.float16,
    "DoubleStorage": torch.float64,
}


@functools.cache
def framing(shape: Shape, dtype: torch.dtype) -> tuple[bytes, bytes]:
    """(head, tail): the bytes torch.save writes before and after a `shape`/`dtype` tensor's
    data. Made once per shape by torch.save itself into a stream that keeps all but the data
    (never touched: the tensor's pages are allocated, not filled)."""
    tensor = torch.empty(shape, dtype=dtype)
    capture = _Capture(tensor.data_ptr(), tensor.nbytes)
    with _lock:  # the checksum option is global to torch
        crc32 = torch.serialization.get_crc32_options()
        # The zip checksums are not checked on load, and the data's would need its bytes.
        torch.serialization.set_crc32_options(False)
        try:
            torch.save(tensor, capture)
        finally:
            torch.serialization.set_crc32_options(crc32)
    if not capture.nbytes:  # no data: the whole record is its head
        capture.data_at = len(capture.written)
    if capture.data_at is None:
        raise RuntimeError(f"torch.save wrote no single data record for {shape} {dtype}")
    raw = bytes(capture.written)
    return raw[: capture.data_at], raw[capture.data_at :]


class _Capture:
    """A write-only stream keeping what torch.save writes, except the tensor's data."""

    def __init__(self, address: int, nbytes: int):
        self.address, self.nbytes = address, nbytes
        self.written = bytearray()
        self.data_at: int | None = None

    def write(self, data) -> int:
        view = memoryview(data)
        if self.data_at is None and self.nbytes and view.nbytes == self.nbytes:
            with warnings.catch_warnings():  # only its address is taken
                warnings.simplefilter("ignore", UserWarning)
                address = torch.frombuffer(view, dtype=torch.uint8).data_ptr()
            if address == self.address:
                self.data_at = len(self.written)
                return view.nbytes
        self.written += view
        return view.nbytes

    def flush(self) -> None:
        pass


@dataclass(frozen=True, slots=True)
class DataRange:
    """Where a record's tensor lies in its file, and what it is."""

    start: int
    nbytes: int
    shape: Shape
    dtype: torch.dtype


def data_range(file: Path, offset: int, length: int) -> DataRange | None:
    """The byte range of the tensor stored in the torch.save record at [offset, offset+length)
    of `file`, when it is a contiguous tensor of a floating dtype laid out as torch.save lays
    it out; None for anything else (read it through DCP instead)."""
    try:
        with open(file, "rb", buffering=0) as f:
            return _data_range(f.fileno(), offset, length)
    except (OSError, ValueError, struct.error, pickle.UnpicklingError, EOFError, TypeError):
        return None


_EOCD = struct.Struct("<4sHHHHIIH")  # end of central directory record
_CENTRAL = struct.Struct("<4sHHHHHHIIIHHHHHII")  # central directory entry
_LOCAL = struct.Struct("<4sHHHHHIIIHH")  # local file header


def _data_range(fd: int, offset: int, length: int) -> DataRange | None:
    if length < _EOCD.size:
        return None
    sig, _, _, _, entries, cd_size, cd_offset, comment = _EOCD.unpack(
        os.pread(fd, _EOCD.size, offset + length - _EOCD.size)
    )
    if sig != b"PK\x05\x06" or comment or cd_offset == 0xFFFFFFFF or entries == 0xFFFF:
        return None  # a zip64 record (a >4 GiB piece) or not torch.save's: read it through DCP
    directory = os.pread(fd, cd_size, offset + cd_offset)
    found: dict[str, tuple[int, int, int]] = {}  # name -> (method, size, local header offset)
    at = 0
    for _ in range(entries):
        fields = _CENTRAL.unpack_from(directory, at)
        if fields[0] != b"PK\x01\x02":
            return None
        method, size, name_len, extra_len, comment_len, local = (
            fields[4],
            fields[9],
            fields[10],
            fields[11],
            fields[12],
            fields[16],
        )
        start = at + _CENTRAL.size
        name = directory[start : start + name_len].decode()
        found[name.split("/", 1)[-1]] = (method, size, local)
        at = start + name_len + extra_len + comment_len
    if "data.pkl" not in found:
        return None

    def entry(name: str) -> tuple[int, int]:
        method, size, local = found[name]
        header = _LOCAL.unpack(os.pread(fd, _LOCAL.size, offset + local))
        if header[0] != b"PK\x03\x04" or method != 0:
            raise ValueError(name)
        return offset + local + _LOCAL.size + header[9] + header[10], size

    pkl_at, pkl_size = entry("data.pkl")
    rebuilt = _TensorPickle(os.pread(fd, pkl_size, pkl_at)).load()
    if not isinstance(rebuilt, _Rebuilt):
        return None
    data_name = f"data/{rebuilt.key}"
    if data_name not in found or rebuilt.dtype is None:
        return None
    data_at, data_size = entry(data_name)
    itemsize = rebuilt.dtype.itemsize
    numel = 1
    for s in rebuilt.shape:
        numel *= s
    contiguous, step = [], 1
    for s in reversed(rebuilt.shape):
        contiguous.insert(0, step)
        step *= s
    if numel > 1 and tuple(rebuilt.stride) != tuple(contiguous):
        return None
    start, nbytes = rebuilt.storage_offset * itemsize, numel * itemsize
    if start + nbytes > data_size or data_size != rebuilt.storage_numel * itemsize:
        return None
    return DataRange(data_at + start, nbytes, tuple(rebuilt.shape), rebuilt.dtype)


@dataclass(slots=True)
class _Rebuilt:
    key: str
    dtype: torch.dtype | None
    storage_numel: int
    storage_offset: int
    shape: tuple[int, ...]
    stride: tuple[int, ...]


def _rebuild(storage, storage_offset, size, stride, requires_grad=False, hooks=None, *_):
    if not isinstance(storage, tuple):
        raise pickle.UnpicklingError("not a storage reference")
    _, storage_type, key, _, numel = storage
    return _Rebuilt(
        str(key),
        _STORAGE_DTYPES.get(storage_type),
        int(numel),
        int(storage_offset),
        tuple(size),
        tuple(stride),
    )


class _TensorPickle(pickle.Unpickler):
    """Reads a record's `data.pkl` for the tensor's layout only: the one call it may make is
    torch's `_rebuild_tensor_v2`, recorded here instead of run; any other global is refused."""

    def __init__(self, raw: bytes):
        super().__init__(io.BytesIO(raw))

    def find_class(self, module: str, name: str):
        if (module, name) == ("torch._utils", "_rebuild_tensor_v2"):
            return _rebuild
        if (module, name) == ("collections", "OrderedDict"):
            return collections.OrderedDict
        if module == "torch" and name.endswith("Storage"):
            return name
        raise pickle.UnpicklingError(f"{module}.{name} is not a plain tensor's")

    def persistent_load(self, pid):
        if isinstance(pid, tuple) and len(pid) == 5 and pid[0] == "storage":
            return pid
        raise pickle.UnpicklingError("unexpected persistent id")
