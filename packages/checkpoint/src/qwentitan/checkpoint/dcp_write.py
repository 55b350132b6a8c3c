"""Writing a DCP folder (TORCH_SAVE format) whose bytes are copied file to file in the kernel.

The folder is what DCP's `FileSystemWriter` writes for the same tensors saved in row chunks
along dim 0 (the layout an FSDP job writes): one `.distcp` file per chunk holding one torch.save
record, and `.metadata`. Python writes each record's head and tail (`dcp_record.framing`) and
the metadata; the tensor bytes go from the source files into the record by `copy_range`
(copy_file_range, else sendfile), so they never enter this process's memory.

Why not DCP's own writer: it pickles and zips each tensor through `torch.save` from a tensor in
memory (on the development VM, 5.4 s of a 6.7 s conversion of 3.4 GB). Why not DCP's
`SerializationFormat.SAFETENSORS`: its records are read only by the Hugging Face reader;
`FileSystemReader`, which torchtitan loads checkpoints with, `torch.load`s every record.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from concurrent.futures import FIRST_EXCEPTION, ThreadPoolExecutor, wait
from dataclasses import dataclass
from pathlib import Path

import torch

from qwentitan.checkpoint.dcp_metadata import METADATA, StoredChunk, dump_metadata
from qwentitan.checkpoint.dcp_record import framing
from qwentitan.checkpoint.disk import Shape, copy_range, nbytes_of

# (start, stop) -> the file regions holding rows [start, stop) of a tensor along dim 0, in
# order: (path, offset, nbytes) parts; None for rows of zeros.
Source = Callable[[int, int], list[tuple[Path, int, int]] | None]


@dataclass(frozen=True, slots=True)
class Piece:
    """Rows [start, stop) of one tensor: one record in its own file."""

    fqn: str
    start: int
    stop: int
    file: str


def row_chunks(shape: Shape, dtype: torch.dtype, chunk_bytes: int) -> list[tuple[int, int]]:
    """[start, stop) row ranges along dim 0 of at most `chunk_bytes` each (at least one row)."""
    rows = shape[0] if shape else 1
    row_bytes = nbytes_of(shape[1:], dtype)
    step = max(1, chunk_bytes // max(row_bytes, 1))
    return [(start, min(start + step, rows)) for start in range(0, rows, step)] or [(0, 0)]


def plan(specs: dict[str, tuple[Shape, torch.dtype]], chunk_bytes: int) -> dict[str, list[Piece]]:
    """Each tensor's pieces, files named as DCP names them (`__0_<n>.distcp`)."""
    pieces: dict[str, list[Piece]] = {}
    n = 0
    for fqn, (shape, dtype) in specs.items():
        pieces[fqn] = []
        for start, stop in row_chunks(shape, dtype, chunk_bytes):
            pieces[fqn].append(Piece(fqn, start, stop, f"__0_{n}.distcp"))
            n += 1
    return pieces


def write(
    folder: Path,
    specs: dict[str, tuple[Shape, torch.dtype]],
    sources: dict[str, Source],
    *,
    chunk_bytes: int,
    threads: int,
    on_written: Callable[[int], None],
    aliases: dict[str, str] | None = None,
) -> None:
    """Write a DCP checkpoint of `specs` (fqn -> shape, dtype) into the empty `folder`.

    `sources[fqn]` says where each piece's rows lie. `aliases` (fqn -> fqn in `specs`) are
    recorded as a second name for the same stored bytes, the way a tied lm_head is the
    embedding: written once, loadable under both names.
    """
    pieces = plan(specs, chunk_bytes)

    def write_piece(piece: Piece) -> int:
        shape, dtype = specs[piece.fqn]
        return _write_piece(folder, piece, shape, dtype, sources[piece.fqn], on_written)

    lengths = _in_threads(write_piece, [p for ps in pieces.values() for p in ps], threads)
    tensors = {}
    for fqn, (shape, dtype) in specs.items():
        chunks = [_stored_chunk(p, shape, lengths[p]) for p in pieces[fqn]]
        tensors[fqn] = (shape, str(dtype).removeprefix("torch."), chunks)
    for alias, target in (aliases or {}).items():
        tensors[alias] = tensors[target]
    with open(folder / METADATA, "wb") as f:
        dump_metadata(tensors, f)


def _write_piece(
    folder: Path,
    piece: Piece,
    shape: Shape,
    dtype: torch.dtype,
    source: Source,
    on_written: Callable[[int], None],
) -> int:
    """Write one piece's record file (head, rows copied from `source`, tail); its length."""
    rows = (piece.stop - piece.start, *shape[1:]) if shape else ()
    head, tail = framing(rows, dtype)
    nbytes = nbytes_of(rows, dtype)
    fd = os.open(folder / piece.file, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
    try:
        _pwrite(fd, head, 0)
        parts = source(piece.start, piece.stop)
        at = len(head)
        if parts is None:
            os.ftruncate(fd, at + nbytes)  # zeros: a hole the file system fills in
        else:
            for path, offset, size in parts:
                copy_range(path, fd, offset, size, at, "re-download it")
                at += size
            assert at == len(head) + nbytes, piece
        _pwrite(fd, tail, len(head) + nbytes)
    finally:
        os.close(fd)
    on_written(nbytes)
    return len(head) + nbytes + len(tail)


def _in_threads(work: Callable[[Piece], int], order: list[Piece], threads: int) -> dict[Piece, int]:
    """`work(piece)` for every piece on `threads` threads; the first failure is raised."""
    pool = ThreadPoolExecutor(threads)
    try:
        futures = {pool.submit(work, p): p for p in order}
        done, _ = wait(futures, return_when=FIRST_EXCEPTION)
        for future in done:
            if future.exception() is not None:
                raise future.exception()
        return {piece: future.result() for future, piece in futures.items()}
    finally:
        # On a failure or a signal, what has not started is dropped and the rest finishes
        # before the caller removes the folder.
        pool.shutdown(wait=True, cancel_futures=True)


def _stored_chunk(piece: Piece, shape: Shape, length: int) -> StoredChunk:
    return StoredChunk(
        offsets=(piece.start, *(0 for _ in shape[1:])) if shape else (),
        sizes=(piece.stop - piece.start, *shape[1:]) if shape else (),
        relative_path=piece.file,
        offset=0,
        length=length,
    )


def _pwrite(fd: int, data: bytes, at: int) -> None:
    view = memoryview(data)
    while view:
        done = os.pwrite(fd, view, at)
        view, at = view[done:], at + done
