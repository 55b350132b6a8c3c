"""Text datasets for torchtitan: the offline corpus, local c4-style JSON lines, or a Hub name.

`TextDataLoader.Config(dataset=...)` goes where torchtitan's `HuggingFaceTextDataLoader.Config`
does (`Trainer.Config.dataloader`, `Validator.Config.dataloader`). Documents are tokenized and
packed into `seq_len` windows by torchtitan's own `HuggingFaceTextDataset`, which also
checkpoints the read position. This module says where the text comes from, through
torchtitan's dataset table (`DATASETS`, its documented extension point), keeps a held-out slice
of local data for validation, and deals the windows to the data-parallel ranks.

One stream for every layout: each rank packs the whole dataset, in one order, into the same
windows a single rank would (torchtitan would give each rank a contiguous part of the corpus
to pack alone, so the documents of a step changed with the number of ranks). The windows go out
in rounds of `local_batch_size x dp_world_size`, rank r taking the r-th `local_batch_size` of
each round; with a global batch that is a whole number of rounds (torchtitan requires it),
step k trains on the same windows for any data-parallel degree, and only the split between
ranks and gradient-accumulation microbatches differs. Each rank reads a whole round before
taking its part, so at every batch boundary all ranks hold one read position: it is saved once,
under one key (`POSITION`), and a run resumes from it with any data-parallel degree. The price
is that every rank tokenizes every window (about 65k tokens a step for a global batch of 16 x
4096, a small fraction of a step), and streams all of a Hub dataset's text.

One held-out set for every layout: a validation loader (`split="validation"`) reads the first
`validation_windows` windows of the held-out stream, dealt in the same rounds, and then ends.
The last round is filled with windows whose labels are all ignored, so every rank runs the
same number of batches (no rank waits in a collective another never joins), and torchtitan's
validator, which divides the summed loss by the tokens that count, averages over exactly those
windows: the same `validation/loss` for any data-parallel degree. torchtitan's own loader gives
each rank windows of its own, so its held-out set grows with the number of ranks.
"""

from __future__ import annotations

import contextlib
import hashlib
import itertools
import os
import pickle
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import torch
from torchtitan.components.dataloader import ParallelAwareDataloader
from torchtitan.components.loss import IGNORE_INDEX
from torchtitan.components.tokenizer import BaseTokenizer
from torchtitan.hf_datasets import DatasetConfig
from torchtitan.hf_datasets.text_datasets import DATASETS, HuggingFaceTextDataset
from torchtitan.tools.logging import logger

from qwentitan.checkpoint.files import file_kind
from qwentitan.launch.base.errors import LaunchError
from qwentitan.launch.runtime.data.check import read_documents
from qwentitan.launch.runtime.data.corpus import offline_corpus
from qwentitan.launch.runtime.preemption import stop_if_overdue

__all__ = ["OFFLINE", "POSITION", "DataSource", "TextDataLoader", "resolve_dataset"]

OFFLINE = "offline"
# The checkpoint key of the one data position all ranks share (torchtitan keeps one per rank,
# `dp_rank_<r>`, and refuses another data-parallel degree on resume).
POSITION = "position"
_JSON_SUFFIXES = (".jsonl", ".json", ".jsonl.gz", ".json.gz")


@dataclass(frozen=True, slots=True)
class DataSource:
    """Where a dataset's text lives: local JSON-lines files, or a Hugging Face Hub name."""

    name: str
    files: tuple[str, ...] = ()
    hub: str | None = None

    @property
    def is_local(self) -> bool:
        return bool(self.files)


def _looks_like_path(spec: str) -> bool:
    return spec.startswith(("/", "./", "../", "~")) or spec.endswith(_JSON_SUFFIXES)


def resolve_dataset(spec: str) -> DataSource:
    """Turn a dataset name into a source, refusing a local path that is missing or holds no JSON.

    The lines themselves are checked once by the launcher (`check_dataset`), not on every rank.
    """
    if spec == OFFLINE:
        return DataSource(name=OFFLINE, files=(str(offline_corpus()),))
    path = Path(spec).expanduser()
    if path.exists() or _looks_like_path(spec):
        if path.is_dir():
            files = sorted(p for p in path.iterdir() if p.name.endswith(_JSON_SUFFIXES))
            if not files:
                raise LaunchError(
                    f"Dataset folder {path} holds no .jsonl or .json files; add c4-style JSON "
                    'lines ({"text": ...} per line) or pass another {dataset}.',
                    field="dataset",
                )
        elif path.exists():
            files = [path]
        else:
            raise LaunchError(
                f"Dataset path {path} does not exist; pass an existing JSON-lines file or folder, "
                f"a Hugging Face dataset name, or {{dataset}} {OFFLINE}.",
                field="dataset",
            )
        for file in files:
            _check_regular(file)
        return DataSource(name=str(path), files=tuple(str(p.resolve()) for p in files))
    if spec in DATASETS:  # torchtitan's own names: c4, c4_test, c4_validation
        return DataSource(name=spec)
    return DataSource(name=spec, hub=spec)


def _check_regular(file: Path) -> None:
    """Only regular files are data: a FIFO would block every reader, a device never ends."""
    try:
        kind = file_kind(file.stat().st_mode)
    except FileNotFoundError:
        kind = "a link to a missing file"
    except OSError as error:  # a link loop, a folder without permission
        kind = f"unreadable ({error.strerror or error})"
    if kind is not None:
        raise LaunchError(
            f"Dataset file {file} is {kind}, not a regular file; replace it with a JSON-lines "
            "file or pass another {dataset}.",
            field="dataset",
        )


def _text(sample: dict[str, Any]) -> str:
    return sample["text"]


def _rows(files: list[str]) -> Iterator[dict[str, str]]:
    for file in files:
        for text in read_documents(Path(file)):
            yield {"text": text}


def _fingerprint(files: tuple[str, ...]) -> str:
    """Names the cached Arrow table of `files`: their paths, sizes and modification times, and
    the reading rules' module, so an edited file or rule is read again."""
    rules = Path(sys.modules[read_documents.__module__].__file__ or "")
    try:
        stats = [(f, os.stat(f).st_size, os.stat(f).st_mtime_ns) for f in (*files, str(rules))]
    except OSError as error:  # removed since it was resolved
        raise LaunchError(
            f"Dataset file {error.filename} cannot be read ({error.strerror}); check the file "
            "or pass another {dataset}.",
            field="dataset",
        ) from None
    return "qwentitan-" + hashlib.sha256(repr(stats).encode()).hexdigest()[:32]


def _register(source: DataSource, split: str, holdout_every: int) -> str:
    """Enter the source in torchtitan's dataset table; return the key to ask for it by."""
    if not source.is_local and source.hub is None:
        return source.name
    key = (
        f"qwentitan-{split}-{holdout_every}-"
        + hashlib.sha1("\n".join(source.files or (source.hub or "",)).encode()).hexdigest()[:16]
    )
    if key in DATASETS:
        return key
    if source.is_local:

        def load(path: str) -> Any:
            from datasets import Dataset

            # Read by the same `read_documents` as the launcher's check (not `datasets`' JSON
            # loader, which refuses blank lines and infers a schema from every field), so
            # every line the check passed is one document here.
            documents = Dataset.from_generator(
                _rows,
                gen_kwargs={"files": list(source.files)},
                fingerprint=_fingerprint(source.files),
            )
            # Every `holdout_every`-th document is the validation slice; the rest is training.
            keep = [
                i
                for i in range(len(documents))
                if (i % holdout_every == holdout_every - 1) == (split == "validation")
            ]
            return documents.select(keep)

    else:

        def load(path: str) -> Any:
            from datasets import load_dataset

            return load_dataset(path, split=split, streaming=True)

    DATASETS[key] = DatasetConfig(
        path=source.hub or source.name, loader=load, sample_processor=_text
    )
    return key


class _TextDataset(HuggingFaceTextDataset):
    """torchtitan's packing dataset over the whole data on every rank, dealt out in rounds (see
    the module doc), with two stops its endless loop lacks."""

    def __init__(
        self,
        *args: Any,
        dp_rank: int = 0,
        dp_world_size: int = 1,
        local_batch_size: int = 1,
        held_out: int = 0,
        **kwargs: Any,
    ) -> None:
        super().__init__(*args, dp_rank=0, dp_world_size=1, **kwargs)  # the one global stream
        self._round = local_batch_size * dp_world_size
        self._slot = slice(dp_rank * local_batch_size, (dp_rank + 1) * local_batch_size)
        # Validation: this many windows in all, then the end (0: the stream as it runs).
        self._held_out = held_out
        # This rank's windows of the round read last, not yet out: none at a batch boundary
        # (a batch is one slot), where torchtitan saves the position.
        self._pending: list[Any] = []

    def __iter__(self) -> Iterator[Any]:
        windows = super().__iter__()
        if self._held_out:
            windows = itertools.islice(windows, self._held_out)
        while True:
            if not self._pending:
                # Read the whole round, every rank's windows, before handing out this rank's:
                # the read position is then the same on all ranks at a batch boundary.
                round_ = list(itertools.islice(windows, self._round))
                if self._held_out and round_:
                    # The held-out set's last round, filled up: every rank a whole batch.
                    round_ += [_ignored(round_[0])] * (self._round - len(round_))
                self._pending = round_[self._slot]
                if not self._pending:
                    return  # a finite split ran out
            yield self._pending.pop(0)

    def _get_data_iter(self) -> Iterator[Any]:
        for sample in super()._get_data_iter():
            # A preemption signal is honoured at the step boundary; one still pending long
            # after it arrived means this rank is stuck reading data, and ends it here.
            stop_if_overdue("loading data")
            yield sample

    def reloop(self) -> None:
        if self._sample_idx == 0:
            # A slice without documents would re-loop over nothing forever (the launcher's
            # `check_dataset` refuses a local dataset this small before any rank starts).
            logger.error(
                f"Dataset {self.dataset_name} holds no document in this slice; use a larger "
                "dataset."
            )
            raise SystemExit(2)  # one sentence, not a traceback per rank
        super().reloop()


def _ignored(window: tuple[dict[str, torch.Tensor], torch.Tensor]) -> Any:
    """`window` with every label ignored: a filler that adds no loss and no token to count."""
    inputs, labels = window
    return inputs, torch.full_like(labels, IGNORE_INDEX)


@contextlib.contextmanager
def _said_in_one_sentence() -> Iterator[None]:
    """A local dataset changed since the launcher checked it (rewritten, cut short, removed)
    ends this rank with the check's own sentence, naming file and line (exit 2), not with the
    traceback `datasets` wraps around it, on every rank."""
    try:
        yield
    except Exception as error:
        cause: BaseException | None = error
        while cause is not None and not isinstance(cause, LaunchError):
            cause = cause.__cause__ or cause.__context__
        if cause is None:
            raise
        logger.error(f"{cause} (read by this rank after the launcher's check)")
        raise SystemExit(2) from None


class TextDataLoader(ParallelAwareDataloader):
    """torchtitan's text dataloader, fed from `dataset` (see `resolve_dataset`)."""

    @dataclass(kw_only=True, slots=True)
    class Config(ParallelAwareDataloader.Config):
        dataset: str = OFFLINE
        """`offline` (the built-in corpus), a local JSON-lines file or folder with a `text`
        field per line, or a Hugging Face Hub dataset name (streamed; needs network)."""

        split: Literal["train", "validation"] = "train"
        """For local data, `validation` is the held-out slice (every `holdout_every`-th
        document) and `train` the rest; for a Hub dataset, the split of that name."""

        holdout_every: int = 20

        infinite: bool = True
        """Loop over the data again when it runs out."""

        validation_windows: int = 8
        """With `split="validation"`: the held-out windows each validation reads, the same
        ones for any data-parallel degree (looping over the split if it is shorter); then the
        loader ends, so torchtitan's `Validator.Config.steps` only caps it (-1: all of them).
        0: each rank reads windows of its own until `steps` (torchtitan's behaviour)."""

    def __init__(
        self,
        config: Config,
        *,
        dp_world_size: int,
        dp_rank: int,
        tokenizer: BaseTokenizer,
        seq_len: int,
        local_batch_size: int,
        snapshot_every_n_steps: int | None = 1,
        **kwargs: Any,
    ) -> None:
        held_out = config.validation_windows if config.split == "validation" else 0
        if held_out < 0:
            raise LaunchError(
                f"validation_windows is {held_out}; give a positive number of held-out windows, "
                "or 0 for each rank's own."
            )
        with _said_in_one_sentence():
            key = _register(resolve_dataset(config.dataset), config.split, config.holdout_every)
            dataset = _TextDataset(
                dataset_name=key,
                dataset_path=None,
                tokenizer=tokenizer,
                seq_len=seq_len,
                dp_rank=dp_rank,
                dp_world_size=dp_world_size,
                local_batch_size=local_batch_size,
                held_out=held_out,
                infinite=config.infinite or held_out > 0,
            )
        super().__init__(
            dataset,
            dp_rank=dp_rank,
            dp_world_size=dp_world_size,
            num_workers=config.num_workers,
            persistent_workers=config.persistent_workers,
            pin_memory=config.pin_memory,
            prefetch_factor=config.prefetch_factor,
            snapshot_every_n_steps=snapshot_every_n_steps,
            batch_size=local_batch_size,
        )

    def state_dict(self) -> dict[str, Any]:
        # The same on every rank at a step boundary (see the module doc), so DCP writes it once;
        # torchtitan's ParallelAwareDataloader would key it by rank, so its base's is taken.
        return {POSITION: pickle.dumps(super(ParallelAwareDataloader, self).state_dict())}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        if state_dict:
            position = pickle.loads(state_dict[POSITION])
            super(ParallelAwareDataloader, self).load_state_dict(position)
