"""One held-out set for every layout: each validation reads the same windows, and
`validation/loss` is their mean, whatever the data-parallel degree."""

from __future__ import annotations

import json
import re

import pytest
from torchtitan.components.loss import IGNORE_INDEX

from qwentitan.launch.runtime.data import TextDataLoader

_VALIDATE = re.compile(r"validate step:\s+(\d+)\s+loss:\s+([0-9.]+)")
_ANSI = re.compile(r"\x1b\[[0-9;]*m")


@pytest.fixture(scope="module")
def documents(tmp_path_factory):
    data = tmp_path_factory.mktemp("data") / "data.jsonl"
    lines = [json.dumps({"text": f"held out {i} " + "word " * (i % 5)}) for i in range(200)]
    data.write_text("\n".join(lines) + "\n")
    return str(data)


def _validated(documents, qwen, ranks, local):
    """Every rank's batches of one validation: (windows that count, batches per rank)."""
    counted, batches = [], []
    for rank in range(ranks):
        loader = TextDataLoader.Config(dataset=documents, split="validation").build(
            dp_world_size=ranks, dp_rank=rank, tokenizer=qwen, seq_len=8, local_batch_size=local
        )
        taken = list(loader)
        batches.append(len(taken))
        for inputs, labels in taken:
            assert labels.shape == (local, 8)
            for row, label in zip(inputs["input"], labels, strict=True):
                if (label != IGNORE_INDEX).any():
                    assert (label != IGNORE_INDEX).all()  # a window counts whole or not at all
                    counted.append(tuple(row.tolist()))
    return sorted(counted), batches


@pytest.mark.parametrize(("ranks", "local"), [(2, 4), (4, 2), (2, 1), (4, 1), (3, 2)])
def test_every_data_parallel_degree_validates_on_the_same_windows(documents, qwen, ranks, local):
    one, _ = _validated(documents, qwen, 1, 4)
    assert len(one) == len(set(one)) == 8  # validation_windows, each once
    many, batches = _validated(documents, qwen, ranks, local)
    assert many == one
    assert len(set(batches)) == 1  # every rank the same number of batches: no collective hangs


def test_each_rank_reads_its_own_windows_with_validation_windows_0(documents, qwen):
    """torchtitan's behaviour, kept as an option: the held-out set grows with the ranks."""
    make = dict(dataset=documents, split="validation", validation_windows=0, infinite=False)
    one = list(TextDataLoader.Config(**make).build(
        dp_world_size=1, dp_rank=0, tokenizer=qwen, seq_len=8, local_batch_size=4))  # fmt: skip
    assert len(one) > 2  # the whole split, not 8 windows


# Two layouts of one global batch (2 windows of 32 tokens a step): one rank accumulating two
# microbatches, and two ranks under FSDP 2. `--validator.steps 8` lets the one rank read all 8
# held-out windows (a cap of 2 steps would stop it at 2 windows).
_COMMON = ["--steps", "4", "--seq-len", "32", "--local-batch-size", "1", "--validate-every", "2",
           "--global-batch-size", "2", "--checkpoint-interval", "100"]  # fmt: skip
_LAYOUTS = {"1 rank": ["--ranks", "1"], "2 ranks FSDP 2": ["--ranks", "2", "--fsdp", "2"]}


@pytest.mark.slow
def test_validation_loss_is_the_same_for_one_rank_and_fsdp_2(
    train_in_process, tmp_path, monkeypatch
):
    monkeypatch.setenv("QWENTITAN_MLFLOW", "off")
    validation = {}
    for name, layout in _LAYOUTS.items():
        folder = tmp_path / name.replace(" ", "-")
        argv = [*layout, *_COMMON, "--run-dir", str(folder), "--", "--validator.steps", "8"]
        code, log = train_in_process(argv, tmp_path / f"{folder.name}.log")
        plain = _ANSI.sub("", log)
        assert code == 0, plain[-3000:]
        validation[name] = {int(s): float(v) for s, v in _VALIDATE.findall(plain)}
    print("validation/loss by layout:", validation)
    one, two = validation.values()
    assert {2, 4} <= one.keys() and {2, 4} <= two.keys()
    for step in (2, 4):
        assert two[step] == pytest.approx(one[step], abs=1e-4), (step, validation)
