"""What `to-dcp` writes is what torchtitan's Trainer starts from with
`--checkpoint.initial_load_path`: a step at learning rate 0 changes no weight, so the checkpoint
the trainer then saves exports back to the Hugging Face weights it started from, bit for bit."""

import pytest
import torch
from transformers import AutoModelForCausalLM

from qwentitan.checkpoint import to_dcp, to_hf
from qwentitan.modeling import flavor_to_hf_config

from .conftest import folder_tensors

pytestmark = pytest.mark.slow


@pytest.mark.parametrize(
    ("recipe", "flavor"), [("tiny_dense", "tiny-dense"), ("tiny_moe", "tiny-moe")]
)
def test_trainer_starts_from_to_dcp_output(recipe, flavor, tmp_path, train_in_process):
    torch.manual_seed(1)  # not the recipe's seed: a model that loaded nothing would differ
    AutoModelForCausalLM.from_config(flavor_to_hf_config(flavor)).save_pretrained(tmp_path / "hf")
    to_dcp(tmp_path / "hf", tmp_path / "dcp")

    run_dir = tmp_path / "run"
    code, log = train_in_process(
        ["--recipe", recipe, "--ranks", "1", "--steps", "1", "--seq-len", "32",
         "--local-batch-size", "2", "--validate-every", "100", "--run-dir", str(run_dir), "--",
         "--checkpoint.initial_load_path", str(tmp_path / "dcp"),
         "--checkpoint.initial_load_model_only", "--optimizer.param-groups.0.optimizer-kwargs.lr", "0"],
        tmp_path / "train.log",
    )  # fmt: skip
    assert code == 0, log[-3000:]
    assert f"Loading the checkpoint from {tmp_path / 'dcp'}" in log  # torchtitan's own line
    saved = run_dir / "checkpoint" / "step-1"
    assert (saved / ".metadata").is_file(), log[-3000:]

    # The MoE model trains without torchtitan's expert_bias_E, so this DCP has none.
    to_hf(saved, tmp_path / "back", config=tmp_path / "hf")
    before, after = folder_tensors(tmp_path / "hf"), folder_tensors(tmp_path / "back")
    assert before.keys() == after.keys()
    for name, value in before.items():
        assert value.dtype == after[name].dtype and torch.equal(value, after[name]), name
