"""LaunchPlan resolution on torchtitan's own Qwen3 recipes (independent of qwentitan's recipes)."""

import json

import pytest

import qwentitan.launch.launcher.plan as plan_module
from qwentitan.launch.base.errors import LaunchError
from qwentitan.launch.launcher.environment import lnc_in_compiler_flags, merged_env
from qwentitan.launch.launcher.plan import resolve_plan
from qwentitan.launch.launcher.plan_cli import describe


@pytest.fixture(autouse=True)
def torchtitan_recipes(monkeypatch):
    monkeypatch.setattr(plan_module, "RECIPES_MODULE", "torchtitan.models.qwen3.config_registry")


def plan(recipe="qwen3_debugmodel", **kw):
    kw.setdefault("instance", "trn2.48xlarge")
    kw.setdefault("seq_len", 2048)
    return resolve_plan(recipe, **kw)


def test_fsdp_over_all_64_ranks_by_default():
    p = plan()
    d = p.to_dict()
    assert (d["world_size"], d["ranks_per_node"], d["lnc"]) == (64, 64, 2)
    assert d["parallelism"] == {"fsdp": 64, "dp_replicate": 1, "tp": 1, "cp": 1, "pp": 1, "ep": 1}
    assert d["seq_len_rule"] == {"multiple_of": 256, "rule": "128 x LNC 2", "ok": True}
    json.dumps(d)  # serialisable as printed by `plan --json`


def test_env_keeps_runtime_lnc_and_compiler_flag_equal():
    for lnc in (2, 1):
        env = plan(lnc=lnc).env
        assert env["NEURON_LOGICAL_NC_CONFIG"] == str(lnc)
        assert lnc_in_compiler_flags(env["NEURON_CC_FLAGS"]) == lnc
        assert "NEURON_RT_VISIBLE_CORES" not in env  # TorchNeuron sets one core per rank
        assert env["TORCH_NEURONX_NEFF_CACHE_DIR"]
        assert "FI_PROVIDER" not in env  # EFA only across nodes


def test_two_nodes_double_the_world_and_add_efa():
    p = plan(nodes=2, rdzv_endpoint="head:29500", node_rank=1)
    assert p.world_size == 128 and p.degrees.data_parallel_shard == 128
    assert p.env["FI_PROVIDER"] == "efa"
    args = p.torchrun_args()
    assert "--nnodes=2" in args and "--nproc-per-node=64" in args
    assert "--rdzv-id=qwentitan-qwen3_debugmodel" in args
    assert "--rdzv-backend=c10d" in args and "--rdzv-endpoint=head:29500" in args


def test_torchrun_line_passes_recipe_and_overrides_to_the_trainer():
    p = plan(tp=4, local_batch=2, activation_checkpoint="full")
    args = p.torchrun_args()
    entry = args.index("-m")
    assert args[entry + 1] == plan_module.TRAIN_ENTRY
    tail = args[entry + 2 :]
    assert tail[:4] == ["--module", plan_module.RECIPES_MODULE, "--config", "qwen3_debugmodel"]
    assert tail[-1] == "activation-checkpoint:full"  # a tyro subcommand, so last
    assert p.degrees.tensor_parallel == 4 and p.degrees.data_parallel_shard == 16
    assert p.config.training.local_batch_size == 2 and p.activation_checkpoint == "full"


@pytest.mark.parametrize(
    ("kw", "match"),
    [
        ({"fsdp": 8, "tp": 4}, r"FSDP 8 x TP 4 .* = 32 is not the world size of 64 ranks"),
        ({"tp": 3}, r"= 3 does not divide the world size of 64 ranks.*--tp"),
        ({"lnc": 3}, r"LNC 3 is not valid on trn2.48xlarge.*--lnc 2"),
        ({"seq_len": 1000}, r"--seq-len 1000 is not a multiple of 256.*--seq-len 1024"),
        ({"instance": "g5.xlarge"}, r"Unknown instance 'g5.xlarge'.*--instance"),
        ({"ep": 2}, r"no experts.*drop --ep"),
    ],
)
def test_wrong_combinations_are_refused_in_one_sentence(kw, match):
    with pytest.raises(LaunchError, match=match) as info:
        plan(**kw)
    assert "\n" not in str(info.value)


def test_lnc1_accepts_seq_len_multiple_of_128_only():
    assert plan(lnc=1, seq_len=1152).seq_len == 1152
    with pytest.raises(LaunchError, match="multiple of 256"):
        plan(lnc=2, seq_len=1152)


def test_unknown_recipe_is_refused():
    with pytest.raises(LaunchError, match=r"Unknown recipe 'nope'.*--recipe"):
        plan("nope")


def test_memory_refusal_names_the_knob():
    # torchtitan's 32B recipe on one trn2: weights dominate, so more shards is the knob.
    with pytest.raises(LaunchError, match=r"needs about .* GiB per rank .* 24.0 GiB.*--nodes 2"):
        plan("qwen3_32b", seq_len=None)
    # It fits on two nodes (128 shards).
    assert plan("qwen3_32b", seq_len=None, nodes=2, rdzv_endpoint="h:1").memory.fits
    # Activations dominate without checkpointing: the knob is --ac full.
    with pytest.raises(LaunchError, match="--ac full"):
        plan("qwen3_14b", seq_len=8192, nodes=2, rdzv_endpoint="h:1", activation_checkpoint="none")


def test_moe_recipe_accepts_expert_parallelism_dividing_fsdp():
    p = plan("qwen3_moe_debug", ep=8, seq_len=None)
    assert p.degrees.expert_parallel == 8 and p.model_shape.experts == 64
    with pytest.raises(LaunchError, match="Expert parallelism 3 does not divide"):
        plan("qwen3_moe_debug", ep=3, seq_len=None)


def test_describe_shows_the_numbers():
    text = describe(plan())
    assert "64 = 1 x 64 per node" in text and "LNC 2" in text and "FSDP 64" in text
    assert "NEURON_LOGICAL_NC_CONFIG=2" in text and "torchrun" in text


def test_merged_env_refuses_a_conflicting_shell_lnc():
    p = plan()
    with pytest.raises(LaunchError, match="NEURON_LOGICAL_NC_CONFIG=1 is set"):
        merged_env(p, {"NEURON_LOGICAL_NC_CONFIG": "1"})
    with pytest.raises(LaunchError, match="NEURON_CC_FLAGS sets --lnc=1"):
        merged_env(p, {"NEURON_CC_FLAGS": "--lnc 1 -O1"})
    env = merged_env(p, {"NEURON_CC_FLAGS": "-O1", "PATH": "/bin"})
    assert env["NEURON_CC_FLAGS"] == "-O1 --lnc=2" and env["PATH"] == "/bin"
