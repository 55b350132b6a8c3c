"""The hf path (Transformers v5 model) trains in torchtitan's Trainer through `qwentitan-launch`."""

import math
import re

import pytest

pytestmark = pytest.mark.slow

_STEP = re.compile(r"\bstep:\s+(\d+)\s+loss:\s+([0-9.]+)\s+grad_norm:\s+([0-9.]+)")
_ANSI = re.compile(r"\x1b\[[0-9;]*m")
# Small enough for a test: 3 steps, short windows, validation only at step 1.
_TINY = ["--recipe", "tiny_hf", "--ranks", "2", "--steps", "3", "--seq-len", "32",
         "--local-batch-size", "2", "--validate-every", "100"]  # fmt: skip


def test_tiny_hf_trains_on_two_ranks_and_checkpoints(tmp_path, train_in_process):
    run_dir = tmp_path / "tiny_hf"
    code, log = train_in_process([*_TINY, "--run-dir", str(run_dir)], tmp_path / "train.log")
    log = _ANSI.sub("", log)
    assert code == 0, log[-3000:]
    assert "dp_shard=2" in log  # FSDP over both gloo ranks
    losses = {int(s): float(loss) for s, loss, _ in _STEP.findall(log)}
    assert sorted(losses) == [1, 2, 3]
    # a fresh model starts near ln(151936) ~ 11.93; lr 1e-2 on one repeated corpus brings it down
    assert losses[1] == pytest.approx(math.log(151936), abs=0.1)
    assert losses[3] < losses[2] < losses[1]
    assert (run_dir / "checkpoint" / "step-3" / ".metadata").exists()
