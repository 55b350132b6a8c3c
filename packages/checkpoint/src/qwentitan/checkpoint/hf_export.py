"""The data side of `to_hf`: each DCP piece into its place in the Hugging Face shards, copied in
the kernel where its bytes lie as they are, else loaded, cast and written."""

from __future__ import annotations

import threading
import warnings
from collections.abc import Callable
from concurrent.futures import FIRST_EXCEPTION, ThreadPoolExecutor, wait
from pathlib import Path

import torch

from qwentitan.checkpoint import dcp_read
from qwentitan.checkpoint.disk import nbytes_of
from qwentitan.checkpoint.errors import CheckpointError
from qwentitan.checkpoint.layout import TitanTensor
from qwentitan.checkpoint.safetensors_io import ShardedWriter

# Tensors in flight at once (bytes). A single larger piece still goes through, alone.
MEMORY_BUDGET = 512 << 20


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


class Exporter:
    """Writes a DCP's tensors into a `ShardedWriter`, piece by piece, from a thread pool."""

    def __init__(self, ckpt: dcp_read.DCPFolder, dtype: torch.dtype | None, allow_overflow: bool):
        self.ckpt, self.dtype = ckpt, dtype
        self.budget = dcp_read.MemoryBudget(MEMORY_BUDGET)
        self.losses = CastLosses(dtype, allow_overflow, ckpt.path)
        self.dropped_bias: set[str] = set()

    def run(
        self,
        writer: ShardedWriter,
        advance: Callable[[int], None],
        tensors: list[TitanTensor],
        threads: int,
    ) -> None:
        """Every piece of `tensors` into `writer`; the first failure stops the rest."""
        self.writer, self.advance = writer, advance
        pieces = [(t, rows) for t in tensors for rows in self.ckpt.rows(t.name)]
        # Each shard takes its writes in turn (`ShardedWriter`), so the pieces go out in the
        # order of their place in their shard: the shards fill side by side and end together,
        # where in the tensors' own order the first shard would take nearly all of them first.
        pieces.sort(key=lambda piece: self._place(writer, *piece))
        pool = ThreadPoolExecutor(threads)
        try:
            futures = [pool.submit(self.export, t, rows) for t, rows in pieces]
            wait(futures, return_when=FIRST_EXCEPTION)
            for f in futures:
                if f.done() and not f.cancelled():
                    f.result()
        finally:
            # On a failure or a signal, what has not started is dropped, not run to the end.
            pool.shutdown(wait=True, cancel_futures=True)
            writer.close(sync=False)  # staged_folder syncs the folder before the rename

    @staticmethod
    def _place(writer: ShardedWriter, t: TitanTensor, rows: dcp_read.Rows) -> float:
        """Where a piece lands in its shard, as a fraction of it (0 for what is not written)."""
        if not t.hf_names:
            return 0.0
        return writer.place(t.hf_names[rows.start if t.stacked else 0])

    def export(self, t: TitanTensor, rows: dcp_read.Rows) -> None:
        """One piece: a row chunk of the DCP (a training job's dim-0 shard, or what to_dcp
        wrote), else the whole tensor; experts stacked on dim 0 unstack per chunk."""
        shape = self.ckpt.tensors[t.name][0]
        if self.dtype is None and t.hf_names and rows.file is not None:
            self._copy(t, rows, shape)
            return
        piece = (rows.stop - rows.start, *shape[1:])
        cast = 0 if self.dtype is None else nbytes_of(piece, self.dtype)
        with self.budget.hold(rows.cost + cast):
            value = self.ckpt.load_rows(rows)
            if not t.hf_names:
                if value.any():
                    self.dropped_bias.add(t.name)
                return
            if self.dtype is not None:
                value = self.losses.cast(t.name, value)
            if t.stacked:
                names = t.hf_names[rows.start : rows.stop]
                for name, part in zip(names, value.unbind(0), strict=True):
                    self.writer.write(name, part)
                    self.advance(part.nbytes)
            else:
                at = rows.start * nbytes_of(shape[1:], value.dtype)
                self.writer.write(t.hf_names[0], value, offset=at)
                self.advance(value.nbytes)

    def _copy(self, t: TitanTensor, rows: dcp_read.Rows, shape: tuple[int, ...]) -> None:
        """The piece's bytes lie as they are in its DCP file: no load, copied in the kernel."""
        dtype = self.ckpt.tensors[t.name][1]
        if not t.stacked:
            nbytes = nbytes_of((rows.stop - rows.start, *shape[1:]), dtype)
            at = rows.start * nbytes_of(shape[1:], dtype)
            self.writer.copy(t.hf_names[0], rows.file, rows.data, nbytes, at)
            self.advance(nbytes)
            return
        expert = nbytes_of(shape[1:], dtype)
        names = t.hf_names[rows.start : rows.stop]
        # Experts lie one after another in the shard as in the chunk: one copy per unbroken run.
        i = 0
        while i < len(names):
            j = i + 1
            while j < len(names) and self.writer.follows(names[j], names[j - 1]):
                j += 1
            nbytes = (j - i) * expert
            self.writer.copy(names[i], rows.file, rows.data + i * expert, nbytes)
            self.advance(nbytes)
            i = j

    def warn(self) -> None:
        """The notes an export owes: values a cast lost, expert biases it dropped."""
        self.losses.warn()
        if self.dropped_bias:
            warnings.warn(
                f"{len(self.dropped_bias)} MoE layers of {self.ckpt.path} have a non-zero "
                "expert_bias_E (torchtitan's load-balancing bias), which Hugging Face Qwen3-MoE "
                "has no place for; the export routes tokens without it.",
                stacklevel=3,
            )


class CastLosses:
    """What an export dtype does to values out of its range, counted over a whole export:
    finite values that become inf (refused unless allowed) and non-zero ones that become 0."""

    def __init__(self, dtype: torch.dtype | None, allow_overflow: bool, src: Path):
        self.dtype, self.allow_overflow, self.src = dtype, allow_overflow, src
        self.overflowed: dict[str, int] = {}
        self.underflowed: dict[str, int] = {}
        self._lock = threading.Lock()

    def cast(self, name: str, value: torch.Tensor) -> torch.Tensor:
        out = value.to(self.dtype)
        if out.dtype == value.dtype:
            return out
        overflowed = int((torch.isfinite(value) & torch.isinf(out)).sum())
        underflowed = int(((value != 0) & (out == 0)).sum())
        if overflowed and not self.allow_overflow:
            raise CheckpointError(
                f"--dtype {dtype_name(self.dtype)} would turn finite values of {name!r} in "
                f"{self.src} into inf (largest |value| {float(value.abs().max()):.4g}, "
                f"{dtype_name(self.dtype)} holds at most {torch.finfo(self.dtype).max:g}); "
                "export as bfloat16 or float32, or pass --allow-overflow to accept it."
            )
        with self._lock:
            for counts, n in ((self.overflowed, overflowed), (self.underflowed, underflowed)):
                if n:
                    counts[name] = counts.get(name, 0) + n
        return out

    def warn(self) -> None:
        dtype = dtype_name(self.dtype) if self.dtype else ""
        for counts, what in (
            (self.overflowed, "finite values into inf (--allow-overflow)"),
            (self.underflowed, "non-zero values into 0 (below its smallest subnormal)"),
        ):
            if counts:
                first = min(counts)
                warnings.warn(
                    f"--dtype {dtype} turned {sum(counts.values())} {what} in "
                    f"{len(counts)} tensor(s), e.g. {counts[first]} in {first!r}",
                    stacklevel=4,
                )
