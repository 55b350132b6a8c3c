"""A checkpoint save that fails on a full disk leaves no `step-N` that `--resume` would take."""

import logging
import re

import pytest
import torch
import torch.distributed.checkpoint as dcp

from qwentitan.launch.launcher.resume import saved_steps
from qwentitan.launch.runtime.checkpointer import SAVE_FAILED_EXIT

from .conftest import guarded_manager


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")  # one process, on purpose
def test_disk_full_during_a_save_removes_its_folder_and_says_why(tmp_path, caplog, small_tmpfs):
    with small_tmpfs(tmp_path / "small", "1m") as small:
        folder = small / "checkpoint"
        dcp.save({"w": torch.ones(16)}, checkpoint_id=folder / "step-1")  # an earlier, whole save
        # 4 MiB of parameters: more than the disk holds
        manager = guarded_manager(small, {"w": torch.ones(1 << 20)})
        with caplog.at_level(logging.ERROR), pytest.raises(SystemExit) as stopped:
            manager.save(2, last_step=True)
        manager.close()
        assert stopped.value.code == SAVE_FAILED_EXIT
        assert sorted(p.name for p in folder.iterdir()) == ["step-1"]
        assert saved_steps(folder) == [1]  # what --resume (and torchtitan) would load
        said = [r.getMessage() for r in caplog.records if r.module == "checkpointer"]
        assert len(said) == 1 and "\n" not in said[0], said
        assert re.fullmatch(
            rf"Saving the checkpoint {folder / 'step-2'} failed \((No space left on device|the "
            r"disk is full, \d+ bytes left)\); its partial folder was removed, so --resume "
            rf"continues from the previous checkpoint: free space in {folder} or choose another "
            r"run folder, then resume\.",
            said[0],
        ), said[0]
