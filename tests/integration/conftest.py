"""One short training run shared by the integration tests that only need its results, and
`folder_tensors`, the safetensors library's own reading of a Hugging Face folder.

`trained_tiny` trains `tiny_dense` once per session on two CPU ranks through
`qwentitan-launch train` (called in-process: the launcher's own process tree is what
test_torchrun_jobs.py tests), with MLflow on but pointed at a port where nothing listens, so the run
also leaves the spool that `sync-mlflow` replays. Tests read its folder; none may change it.
"""

from __future__ import annotations

import socket
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

# Enough for preflight's initialisation check (loaded loss <= 0.8 x a random head's ~11.9): 12
# steps of 2 windows of 64 tokens per rank on two ranks leave a loaded loss of 6.58 against a
# random head's 11.94 (ratio 0.55), at 48 CPU-s instead of the recipe's 128 x 4 tokens' 67.
TRAINED_STEPS = 12
TRAINED_SHAPE = ["--seq-len", "64", "--local-batch-size", "2"]
TRAINED_EXPERIMENT = "trained-tiny"


def folder_tensors(folder: Path) -> dict[str, torch.Tensor]:
    """Every tensor of a Hugging Face folder's shards, as the safetensors library loads them."""
    out: dict[str, torch.Tensor] = {}
    for file in folder.glob("*.safetensors"):
        out |= load_file(file)
    return out


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


@pytest.fixture(scope="session")
def free_port() -> Callable[[], int]:
    """A function returning a loopback port that nothing listens on (right now)."""
    return _free_port


@dataclass(frozen=True)
class TrainedRun:
    run_dir: Path
    steps: int
    experiment: str  # the MLflow experiment its spool names
    log: str

    @property
    def last_checkpoint(self) -> Path:
        return self.run_dir / "checkpoint" / f"step-{self.steps}"


@pytest.fixture(scope="session")
def trained_tiny(tmp_path_factory, train_in_process) -> TrainedRun:
    root = tmp_path_factory.mktemp("trained-tiny")
    run_dir = root / "run"
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("QWENTITAN_MLFLOW", "on")
        patch.setenv("MLFLOW_TRACKING_URI", f"http://127.0.0.1:{_free_port()}")  # unreachable
        patch.setenv("QWENTITAN_MLFLOW_EXPERIMENT", TRAINED_EXPERIMENT)
        code, log = train_in_process(
            ["--recipe", "tiny_dense", "--ranks", "2", "--steps", str(TRAINED_STEPS),
             *TRAINED_SHAPE, "--run-dir", str(run_dir)],
            root / "train.log",
        )  # fmt: skip
    assert code == 0, log[-4000:]
    return TrainedRun(run_dir, TRAINED_STEPS, TRAINED_EXPERIMENT, log)
