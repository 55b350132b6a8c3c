"""Bytes on disk, shared by the safetensors and DCP sides: sizes and file-to-file copies."""

from __future__ import annotations

import os
from pathlib import Path

import torch

from qwentitan.checkpoint.errors import CheckpointError

Shape = tuple[int, ...]


def nbytes_of(shape: Shape, dtype: torch.dtype) -> int:
    n = dtype.itemsize
    for s in shape:
        n *= s
    return n


def differing_elements(a: torch.Tensor, b: torch.Tensor) -> int:
    """How many elements of two same-shape tensors differ in their bytes (any bit)."""
    if a.dtype != b.dtype:
        return a.numel()
    x = a.contiguous().reshape(-1).view(torch.uint8).reshape(a.numel(), -1)
    y = b.contiguous().reshape(-1).view(torch.uint8).reshape(b.numel(), -1)
    return 0 if torch.equal(x, y) else int((x != y).any(dim=1).sum())


def copy_range(src: Path, dst_fd: int, offset: int, nbytes: int, at: int, fix: str) -> bool:
    """Copy `nbytes` from byte `offset` of file `src` to byte `at` of `dst_fd`, in the kernel
    (copy_file_range); False, having written nothing, where the two file systems cannot.

    A source that ends early was truncated during the run: a CheckpointError ending in `fix`.
    """
    done = 0
    with open(src, "rb", buffering=0) as f:
        while done < nbytes:
            try:
                got = os.copy_file_range(
                    f.fileno(), dst_fd, nbytes - done, offset + done, at + done
                )
            except OSError:
                if done:
                    raise
                return False
            if not got:
                raise CheckpointError(
                    f"{src} ended while copying from it; the file was truncated during "
                    f"conversion, {fix}."
                )
            done += got
    return True
