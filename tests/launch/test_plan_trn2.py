"""The trn2 recipes through the CLI: `plan --json`, refusals (exit 2), `run` off Trainium."""

import json

import pytest

from qwentitan.launch.launcher.cli import main

TRN2 = ("qwen3_4b_hf", "qwen3_4b_native", "qwen3_moe_kernels")


@pytest.mark.parametrize("recipe", TRN2)
def test_plan_json_shows_64_ranks_lnc2_fsdp64_and_the_seq_len_rule(recipe, capsys):
    assert main(["plan", "--recipe", recipe, "--json"]) == 0
    plan = json.loads(capsys.readouterr().out)
    assert plan["topology"]["instance"] == "trn2.48xlarge"
    assert (plan["world_size"], plan["ranks_per_node"], plan["lnc"]) == (64, 64, 2)
    assert plan["parallelism"]["fsdp"] == 64 and plan["parallelism"]["tp"] == 1
    assert plan["seq_len_rule"]["multiple_of"] == 512 and plan["seq_len_rule"]["ok"]
    assert plan["seq_len"] % 512 == 0
    assert plan["env"]["NEURON_LOGICAL_NC_CONFIG"] == "2" and "NEURON_CC_FLAGS" not in plan["env"]
    words = plan["torchrun"]
    assert words[words.index("--target") + 1] == "trn2.48xlarge"  # the device is config
    assert words[words.index("--lnc") + 1] == "2"
    assert plan["memory_per_rank"]["fits"] and plan["memory_per_rank"]["available_gib"] == 24.0
    assert plan["torchrun"][plan["torchrun"].index("--config") + 1] == recipe


def test_recipe_specifics(capsys):
    plans = {}
    for recipe in TRN2:
        assert main(["plan", "--recipe", recipe, "--json"]) == 0
        plans[recipe] = json.loads(capsys.readouterr().out)
    hf = plans["qwen3_4b_hf"]
    assert (hf["steps"], hf["local_batch"], hf["global_batch"]) == (10, 1, 64)
    assert hf["config"]["initial_load_in_hf"] and hf["config"]["last_save_in_hf"]
    assert hf["model"]["flavor"] == "qwen3-4b" and hf["model"]["name"] == "qwen3-hf"
    native = plans["qwen3_4b_native"]
    assert native["global_batch"] == 64 and native["model"]["flavor"] == "qwen3-4b"
    assert native["model"]["params"] == hf["model"]["params"]
    moe = plans["qwen3_moe_kernels"]
    assert moe["model"]["flavor"] == "qwen3-30b-a3b-4l" and not moe["config"]["compile"]


def test_the_2_34_moe_recipe_plans_tp4_fsdp16_with_128_experts_top8_in_24_gib(capsys):
    # AWS's MoE run of Neuron SDK 2.34 (torch-neuronx 2.34.0 release notes): Qwen3-30B-A3B at
    # TP 4 x FSDP 16 on one trn2.48xlarge, torchtitan's grouped experts (the native path).
    assert main(["plan", "--recipe", "qwen3_30b_a3b_tp4_fsdp16", "--json"]) == 0
    plan = json.loads(capsys.readouterr().out)
    print(json.dumps({k: plan[k] for k in ("world_size", "parallelism", "model")}))
    print(json.dumps(plan["memory_per_rank"]))
    assert (plan["world_size"], plan["lnc"]) == (64, 2)
    assert plan["parallelism"] == {
        "fsdp": 16,
        "dp_replicate": 1,
        "tp": 4,
        "cp": 1,
        "pp": 1,
        "ep": 1,
    }
    model = plan["model"]
    assert (model["flavor"], model["experts"], model["top_k"]) == ("qwen3-30b-a3b", 128, 8)
    assert model["params"] > 30e9
    memory = plan["memory_per_rank"]
    assert memory["available_gib"] == 24.0 and memory["fits"], memory
    assert not plan["config"]["compile"] and plan["seq_len"] == 4096


def test_the_2_34_moe_recipe_runs_torchtitans_grouped_experts_not_the_custom_op():
    from torchtitan.models.common.moe import GroupedExperts

    from qwentitan.launch.launcher.plan import load_config
    from qwentitan.launch.recipes import recipe_info

    assert recipe_info("qwen3_30b_a3b_tp4_fsdp16").path == "native"
    config = load_config("qwen3_30b_a3b_tp4_fsdp16", [])
    inner = config.model_spec.model.layers[0].moe.routed_experts.inner_experts
    assert type(inner) is GroupedExperts.Config, type(inner)  # torch._grouped_mm, no custom op


@pytest.mark.parametrize(
    ("flags", "words"),
    [
        (["--fsdp", "8", "--tp", "4"], "is not the world size of 64 ranks"),
        (["--lnc", "3"], "LNC 3 is not valid on trn2.48xlarge"),
        (["--seq-len", "1000"], "--seq-len 1000 is not a multiple of 512"),
        (["--instance", "trn9.huge"], "Unknown instance 'trn9.huge'"),
        (["--ac", "none"], "GiB per rank but a trn2.48xlarge rank at LNC 2 has 24.0 GiB"),
        (["--local-batch-size", "4"], "Global batch 64 is not a multiple of local batch 4"),
    ],
)
def test_wrong_combinations_exit_2_with_one_sentence(flags, words, capsys):
    recipe = "qwen3_4b_hf" if "--ac" in flags else "qwen3_4b_native"
    assert main(["plan", "--recipe", recipe, *flags]) == 2
    err = capsys.readouterr().err.strip()
    assert words in err and len(err.splitlines()) == 1 and "Traceback" not in err


def test_run_off_trainium_prints_the_plan_then_fails_in_one_sentence(capsys):
    assert main(["run", "--recipe", "qwen3_4b_hf"]) == 2
    captured = capsys.readouterr()
    assert "64 = 1 x 64 per node" in captured.out and "torchrun" in captured.out
    err = captured.err.strip()
    assert len(err.splitlines()) == 1 and "no Neuron devices" in err and "--dry-run" in err
    assert main(["run", "--recipe", "qwen3_4b_hf", "--dry-run"]) == 0
    assert "LNC 2" in capsys.readouterr().out


def test_an_exported_compile_cache_is_honoured_and_its_source_shown(capsys, monkeypatch):
    monkeypatch.setenv("TORCH_NEURONX_NEFF_CACHE_DIR", "/scratch/neff-cache")
    run = ["run", "--recipe", "qwen3_4b_native", "--instance", "trn2.48xlarge", "--dry-run"]
    assert main(run) == 0
    out = capsys.readouterr().out
    assert "TORCH_NEURONX_NEFF_CACHE_DIR=/scratch/neff-cache  (environment)" in out
    assert main([*run, "--compile-cache", "/fast/neff"]) == 0  # a flag overrides the export
    assert "TORCH_NEURONX_NEFF_CACHE_DIR=/fast/neff  (flag)" in capsys.readouterr().out
    monkeypatch.delenv("TORCH_NEURONX_NEFF_CACHE_DIR")
    assert main(run) == 0
    assert "neuron-compile-cache  (default)" in capsys.readouterr().out


@pytest.mark.parametrize(
    ("command", "visible"), [("plan", "5"), ("plan", "0-63"), ("run", "5"), ("preflight", "0,3")]
)
def test_visible_cores_are_refused_alike_in_plan_run_and_preflight(
    command, visible, capsys, monkeypatch
):
    monkeypatch.setenv("NEURON_RT_VISIBLE_CORES", visible)
    args = [command, "--recipe", "qwen3_4b_native", "--instance", "trn2.48xlarge"]
    assert main([*args, "--dry-run"] if command == "run" else args) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and f"NEURON_RT_VISIBLE_CORES={visible} is set" in err


def test_compile_on_neuron_shows_the_neuron_backend(capsys):
    assert main(["plan", "--recipe", "qwen3_4b_native", "--", "--compile.enable"]) == 0
    out = capsys.readouterr().out
    assert "torch.compile, backend neuron" in out and "--compile.backend neuron" in out
    args = ["plan", "--recipe", "qwen3_4b_native", "--", "--compile.enable"]
    assert main([*args, "--compile.backend", "inductor"]) == 2
    assert "Compile backend 'inductor' does not target" in capsys.readouterr().err
