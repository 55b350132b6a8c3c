"""Preflight on CPU, pointed at weights exported from the session's short tiny training run: it
passes, the initialisation check included; a deliberately broken weights folder fails the named
check. Preflight runs in-process (`cli.main`): what is tested is its report, not a process tree."""

import json
import shutil
from pathlib import Path

import pytest
from safetensors.torch import load_file, save_file

from qwentitan.checkpoint import to_hf
from qwentitan.launch.launcher import cli
from qwentitan.modeling import flavor_to_hf_config

# One worker for the files that share the `trained_tiny` training (tests/conftest.py: SAME_WORKER).
pytestmark = pytest.mark.slow

TINY = ["--recipe", "tiny_dense", "--instance", "cpu", "--ranks-per-node", "1"]


@pytest.fixture(scope="module")
def trained_weights(trained_tiny, tmp_path_factory) -> Path:
    """The shared tiny run's last checkpoint, exported to an HF folder with qwentitan-ckpt."""
    root = tmp_path_factory.mktemp("tiny-trained")
    flavor_to_hf_config("tiny-dense").to_json_file(root / "config.json")
    return to_hf(trained_tiny.last_checkpoint, root / "hf", config=root / "config.json")


def preflight(weights: Path, capsys) -> tuple[int, dict]:
    code = cli.main(["preflight", *TINY, "--weights", str(weights), "--json"])
    out, err = capsys.readouterr()
    assert "Traceback" not in err, err[-3000:]
    start = out.index("{") if out.startswith("{") else out.index("\n{") + 1
    return code, json.loads(out[start:])


def test_preflight_passes_on_trained_tiny_weights(trained_weights, capsys):
    code, report = preflight(trained_weights, capsys)
    checks = {c["name"]: c for c in report["checks"]}
    assert code == 0 and report["passed"], json.dumps(report, indent=1)
    for name in ("versions", "devices", "weights", "round_trip", "initialisation", "disk"):
        assert checks[name]["status"] == "pass", checks[name]
    # Checks that need Trainium are named as skipped, not silently dropped.
    assert {"lnc", "seq_len"} <= set(report["skipped"])
    init = checks["initialisation"]["figures"]
    assert init["loaded_loss"] <= 0.8 * init["random_loss"]
    assert init["random_loss"] > 10  # about ln(151936) = 11.9 for a random Qwen3 head
    assert checks["round_trip"]["figures"]["differing"] == []


def test_preflight_fails_a_broken_weights_folder_by_name(trained_weights, tmp_path, capsys):
    broken = tmp_path / "broken"
    shutil.copytree(trained_weights, broken)
    tensors = load_file(broken / "model.safetensors")
    name = next(k for k in tensors if k.endswith("mlp.down_proj.weight"))
    tensors[name] = tensors[name][:, :-1].contiguous()  # one column short
    save_file(tensors, broken / "model.safetensors", metadata={"format": "pt"})
    code, report = preflight(broken, capsys)
    assert code == 1 and not report["passed"]
    assert report["failed"] == ["weights"]
    weights = next(c for c in report["checks"] if c["name"] == "weights")
    assert name in weights["detail"] and "wrong shapes" in weights["detail"]
    # What depends on the weights is skipped and says why.
    for dependent in ("round_trip", "initialisation"):
        check = next(c for c in report["checks"] if c["name"] == dependent)
        assert check["status"] == "skip" and "weights" in check["detail"]


def test_preflight_with_untrained_weights_fails_the_initialisation_check(tmp_path, capsys):
    """Randomly initialised weights have the right keys and shapes but the loss of random init."""
    import torch
    from transformers import AutoModelForCausalLM

    torch.manual_seed(1)
    AutoModelForCausalLM.from_config(flavor_to_hf_config("tiny-dense")).save_pretrained(
        tmp_path / "hf"
    )
    code, report = preflight(tmp_path / "hf", capsys)
    assert code == 1 and report["failed"] == ["initialisation"], json.dumps(report, indent=1)
