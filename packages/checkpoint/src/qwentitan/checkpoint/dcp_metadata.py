"""A DCP folder's `.metadata`: read without running code, written without importing DCP.

DCP pickles its `Metadata` and its own `FileSystemReader` reads it back with `pickle.load`, so a
`.metadata` from anywhere could run any code. `MetadataUnpickler` only builds DCP's metadata
classes and the few torch and standard types they hold, in the spirit of
`torch.load(weights_only=True)`; anything else is refused before it is built.

`dump_metadata` writes the same pickle DCP's `FileSystemWriter` writes for a plain tensor state
dict, opcode by opcode, so `to-dcp` need not import `torch.distributed.checkpoint` (about a
second, as long as the whole copy of a small model). A test pins it to DCP's own output.
"""

from __future__ import annotations

import importlib
import pickle
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any

from qwentitan.checkpoint.errors import CheckpointError

METADATA = ".metadata"
_DCP_METADATA = "torch.distributed.checkpoint.metadata"
_DCP_FILESYSTEM = "torch.distributed.checkpoint.filesystem"
# What a DCP `.metadata` may name: DCP's own records, and what their fields hold.
_DCP_CLASSES = {
    (_DCP_METADATA, "Metadata"),
    (_DCP_METADATA, "TensorStorageMetadata"),
    (_DCP_METADATA, "BytesStorageMetadata"),
    (_DCP_METADATA, "ChunkStorageMetadata"),
    (_DCP_METADATA, "TensorProperties"),
    (_DCP_METADATA, "MetadataIndex"),
    (_DCP_METADATA, "StorageMeta"),
    (_DCP_METADATA, "_MEM_FORMAT_ENCODING"),
    (_DCP_FILESYSTEM, "_StorageInfo"),
}
_OTHER_ALLOWED = {
    ("torch", "Size"),
    ("torch.serialization", "_get_layout"),  # a layout by name, from torch's own table
    ("collections", "OrderedDict"),
    ("builtins", "set"),
    ("builtins", "frozenset"),
    ("pathlib", "Path"),
    ("pathlib", "PosixPath"),
    ("pathlib", "PurePosixPath"),
    ("pathlib", "WindowsPath"),
    ("pathlib", "PureWindowsPath"),
}


class MetadataUnpickler(pickle.Unpickler):
    """Unpickles a DCP `.metadata` building only DCP's metadata classes, torch dtypes, layouts,
    memory formats and `torch.Size`, and a few standard containers and paths; any other global
    (the way a pickle runs code) raises `pickle.UnpicklingError` before anything is called.

    `light=True` builds plain stand-ins with the same attributes instead of DCP's classes, so
    reading a folder's layout need not import `torch.distributed.checkpoint`.
    """

    def __init__(self, file: IO[bytes], *, light: bool = False):
        super().__init__(file)
        self._light = light

    def find_class(self, module: str, name: str) -> Any:
        if (module, name) in _DCP_CLASSES:
            if self._light:
                return _LIGHT[name]
            return getattr(importlib.import_module(module), name)
        if (module, name) in _OTHER_ALLOWED:
            return getattr(importlib.import_module(module), name)
        if module == "pathlib._local" and ("pathlib", name) in _OTHER_ALLOWED:
            # Python 3.13 pickles the path classes from here; read them on any Python.
            return getattr(importlib.import_module("pathlib"), name)
        if module == "torch":
            import torch

            value = getattr(torch, name, None)
            if isinstance(value, torch.dtype | torch.layout | torch.memory_format):
                return value
        raise pickle.UnpicklingError(f"{module}.{name} is not allowed in DCP metadata")

    def persistent_load(self, pid: Any) -> Any:
        raise pickle.UnpicklingError("DCP metadata holds no persistent references")


def read_dcp_metadata(path: Path | str, *, light: bool = False) -> Any:
    """A DCP folder's metadata (the folder, or its `.metadata` file) through `MetadataUnpickler`.

    Anything that is not DCP metadata, a pickle that would run code included, is a
    `CheckpointError` naming the file.
    """
    path = Path(path)
    file = path / METADATA if path.is_dir() else path
    try:
        with open(file, "rb") as f:
            metadata = MetadataUnpickler(f, light=light).load()
    except FileNotFoundError:
        raise CheckpointError(
            f"{path} has no {METADATA} file, so it is not a complete DCP checkpoint; pass the "
            "folder written by torchtitan or `qwentitan-ckpt to-dcp` (a step-N folder)."
        ) from None
    except Exception as e:
        why = str(e) if isinstance(e, pickle.UnpicklingError) else type(e).__name__
        raise CheckpointError(
            f"{file} is not DCP metadata this tool reads ({why}); it is corrupt, not a torch "
            "DCP checkpoint, or unsafe: re-save the checkpoint with torch DCP."
        ) from None
    if type(metadata).__name__ != "Metadata" or not isinstance(
        getattr(metadata, "state_dict_metadata", None), dict
    ):
        raise CheckpointError(
            f"{file} does not hold DCP metadata; re-save the checkpoint with torch DCP."
        )
    return metadata


# --- light stand-ins ----------------------------------------------------------------------


class _Record:
    """A DCP dataclass, read back: pickle's BUILD fills `__dict__`; class attributes give the
    defaults of fields DCP leaves out."""

    def __init__(self, *args: Any):  # REDUCE-built (an enum member): keep its value
        self.args = args


class _TensorProperties(_Record):
    def __setstate__(self, state: tuple) -> None:  # DCP pickles it as a tuple, dtype first
        self.dtype = state[0]


class _StorageInfo(_Record):
    transform_descriptors = None


class _MetadataIndex(_Record):
    offset = None
    index = None


class _Metadata(_Record):
    planner_data = None
    storage_data = None
    storage_meta = None
    version = None


_LIGHT = {name: type(name, (_Record,), {}) for _, name in _DCP_CLASSES}
_LIGHT |= {
    "Metadata": _Metadata,
    "TensorProperties": _TensorProperties,
    "_StorageInfo": _StorageInfo,
    "MetadataIndex": _MetadataIndex,
}
for _name, _cls in _LIGHT.items():
    _cls.__name__ = _cls.__qualname__ = _name


# --- writing --------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class StoredChunk:
    """One chunk of a tensor as DCP records it: where it sits in the tensor and in which file."""

    offsets: tuple[int, ...]
    sizes: tuple[int, ...]
    relative_path: str
    offset: int
    length: int


# DCP's metadata version (torch 2.14's `_version`); pinned to dcp.save's own output by a test.
DCP_METADATA_VERSION = "1.0.0"


def dump_metadata(
    tensors: dict[str, tuple[tuple[int, ...], str, list[StoredChunk]]], file: IO[bytes]
) -> None:
    """Pickle DCP `Metadata` for plain tensors: fqn -> (shape, torch dtype name, chunks).

    Protocol 2, as torch.save uses, without memo: `pickle.loads` with DCP imported gives the
    objects `dcp.save` would have written for the same tensors and files.
    """
    state_dict_metadata = []
    planner_data = []
    storage_data = []
    for fqn, (shape, dtype, chunks) in tensors.items():
        state_dict_metadata.append((_str(fqn), _tensor_metadata(shape, dtype, chunks)))
        planner_data.append((_str(fqn), _tuple(_str(fqn))))
        storage_data += _storage_entries(fqn, chunks)
    metadata = _obj(
        _DCP_METADATA,
        "Metadata",
        _fields(
            state_dict_metadata=_dict(state_dict_metadata),
            planner_data=_dict(planner_data),
            storage_data=_dict(storage_data),
            storage_meta=b"N",
            version=_str(DCP_METADATA_VERSION),
        ),
    )
    file.write(b"\x80\x02" + metadata + b".")


def _tensor_metadata(shape: tuple[int, ...], dtype: str, chunks: list[StoredChunk]) -> bytes:
    """A pickled `TensorStorageMetadata`: a dense, strided tensor without grad or pinning."""
    properties = _obj(
        _DCP_METADATA,
        "TensorProperties",
        _tuple(
            _global("torch", dtype),
            _global("torch.serialization", "_get_layout") + _tuple(_str("torch.strided")) + b"R",
            b"\x89",  # requires_grad
            _global(_DCP_METADATA, "_MEM_FORMAT_ENCODING") + _tuple(_int(0)) + b"R",
            b"\x89",  # pin_memory
        ),
    )
    chunk_list = [
        _obj(
            _DCP_METADATA,
            "ChunkStorageMetadata",
            _fields(offsets=_size(c.offsets), sizes=_size(c.sizes)),
        )
        for c in chunks
    ]
    return _obj(
        _DCP_METADATA,
        "TensorStorageMetadata",
        _fields(properties=properties, size=_size(shape), chunks=_list(chunk_list)),
    )


def _storage_entries(fqn: str, chunks: list[StoredChunk]) -> list[tuple[bytes, bytes]]:
    """Pickled (`MetadataIndex`, `_StorageInfo`) pairs: where each chunk of `fqn` is stored."""
    return [
        (
            _obj(
                _DCP_METADATA,
                "MetadataIndex",
                _fields(fqn=_str(fqn), offset=_size(c.offsets), index=_int(i)),
            ),
            _obj(
                _DCP_FILESYSTEM,
                "_StorageInfo",
                _fields(
                    relative_path=_str(c.relative_path),
                    offset=_int(c.offset),
                    length=_int(c.length),
                ),
            ),
        )
        for i, c in enumerate(chunks)
    ]


def _fields(**values: bytes) -> bytes:
    """A pickled dict of attribute names to pickled values, in the order given."""
    return _dict([(_str(name), value) for name, value in values.items()])


def _global(module: str, name: str) -> bytes:
    return b"c" + module.encode() + b"\n" + name.encode() + b"\n"


def _str(text: str) -> bytes:
    raw = text.encode()
    return b"X" + struct.pack("<I", len(raw)) + raw


def _int(n: int) -> bytes:
    if -(2**31) <= n < 2**31:
        return b"J" + struct.pack("<i", n)
    raw = n.to_bytes((n.bit_length() + 8) // 8, "little", signed=True)
    return b"\x8a" + bytes([len(raw)]) + raw


def _tuple(*items: bytes) -> bytes:
    return b"(" + b"".join(items) + b"t"


def _size(dims: tuple[int, ...]) -> bytes:
    return _global("torch", "Size") + _tuple(_tuple(*map(_int, dims))) + b"R"


def _dict(pairs: list[tuple[bytes, bytes]]) -> bytes:
    return b"}" + (b"(" + b"".join(k + v for k, v in pairs) + b"u" if pairs else b"")


def _list(items: list[bytes]) -> bytes:
    return b"]" + (b"(" + b"".join(items) + b"e" if items else b"")


def _obj(module: str, name: str, state: bytes) -> bytes:
    # cls.__new__(cls), then BUILD: how pickle stores a dataclass instance.
    return _global(module, name) + b")\x81" + state + b"b"
