"""LaunchPlan resolution on torchtitan's own Qwen3 recipes (independent of qwentitan's recipes)."""

import json

import pytest

import qwentitan.launch.launcher.plan as plan_module
from qwentitan.launch.base.errors import LaunchError
from qwentitan.launch.launcher.environment import CPU_HUGE_PAGES, check_shell, rank_env
from qwentitan.launch.launcher.plan import RunRequest, resolve_plan
from qwentitan.launch.launcher.plan_cli import describe

pytestmark = pytest.mark.usefixtures("torchtitan_recipes")


def plan(recipe="qwen3_debugmodel", shell=None, **kw):
    kw.setdefault("instance", "trn2.48xlarge")
    kw.setdefault("seq_len", 2048)
    return resolve_plan(RunRequest(recipe=recipe, **kw), shell=shell)


def test_fsdp_over_all_64_ranks_by_default():
    p = plan()
    d = p.facts()
    assert (d["world_size"], d["ranks_per_node"], d["lnc"]) == (64, 64, 2)
    assert d["parallelism"] == {"fsdp": 64, "dp_replicate": 1, "tp": 1, "cp": 1, "pp": 1, "ep": 1}
    assert d["seq_len_rule"] == {"multiple_of": 512, "rule": "NKI attention", "ok": True}
    json.dumps(d)  # serialisable as printed by `plan --json`


def test_env_sets_the_runtime_lnc_only():
    for lnc in (2, 1):
        env = plan(lnc=lnc).env
        assert env["NEURON_LOGICAL_NC_CONFIG"] == str(lnc)
        # TorchNeuron passes --lnc from the runtime's variable to the compiler itself
        assert "NEURON_CC_FLAGS" not in env
        assert "NEURON_RT_VISIBLE_CORES" not in env  # TorchNeuron sets one core per rank
        assert env["TORCH_NEURONX_NEFF_CACHE_DIR"]
        assert "FI_PROVIDER" not in env  # EFA only across nodes


def test_two_nodes_double_the_world_and_add_efa():
    p = plan(nodes=2, rdzv_endpoint="head:29500")
    assert p.world_size == 128 and p.dims.dp_shard == 128
    assert p.env["FI_PROVIDER"] == "efa"
    args = p.torchrun_args()
    assert "--nnodes=2" in args and "--nproc-per-node=64" in args
    assert "--rdzv-id=qwentitan-qwen3_debugmodel" in args
    assert "--rdzv-backend=c10d" in args and "--rdzv-endpoint=head:29500" in args


def test_torchrun_line_passes_recipe_and_overrides_to_the_trainer():
    p = plan(tp=4, local_batch_size=2, ac="full")
    args = p.torchrun_args()
    entry = args.index("-m")
    assert args[entry + 1] == plan_module.TRAIN_ENTRY
    tail = args[entry + 2 :]
    assert tail[:4] == ["--module", plan_module.RECIPES_MODULE, "--config", "qwen3_debugmodel"]
    assert tail[-1] == "activation-checkpoint:full"  # a tyro subcommand, so last
    assert p.dims.tp == 4 and p.dims.dp_shard == 16
    assert p.config.training.local_batch_size == 2 and p.activation_checkpoint == "full"


@pytest.mark.parametrize(
    ("kw", "match"),
    [
        ({"fsdp": 8, "tp": 4}, r"FSDP 8 x TP 4 .* = 32 is not the world size of 64 ranks"),
        ({"tp": 3}, r"= 3 does not divide the world size of 64 ranks.*choose tp dividing"),
        ({"lnc": 3}, r"LNC 3 is not valid on trn2.48xlarge.*pass lnc 2"),
        ({"seq_len": 1000}, r"seq_len 1000 is not a multiple of 512.*pass seq_len 1024"),
        ({"instance": "g5.xlarge"}, r"Unknown instance 'g5.xlarge'.*with instance"),
        ({"ep": 2}, r"no experts.*drop ep"),
    ],
)
def test_wrong_combinations_are_refused_in_one_sentence(kw, match):
    with pytest.raises(LaunchError, match=match) as info:
        plan(**kw)
    assert "\n" not in str(info.value)
    # the refusal names the request field it is about (the command line says its flag)
    assert info.value.field in kw


def test_neuron_seq_len_follows_the_nki_attention_kernels_at_any_lnc():
    assert plan(lnc=1, seq_len=1536).seq_len == 1536
    for lnc in (1, 2):
        with pytest.raises(LaunchError, match="multiple of 512"):
            plan(lnc=lnc, seq_len=1152)


def test_unknown_recipe_is_refused():
    with pytest.raises(LaunchError, match=r"Unknown recipe 'nope'.*with recipe"):
        plan("nope")


def test_memory_refusal_names_the_knob():
    # torchtitan's 32B recipe on one trn2: weights dominate, so more shards is the knob.
    with pytest.raises(LaunchError, match=r"needs about .* GiB per rank .* 24.0 GiB.*nodes 2"):
        plan("qwen3_32b", seq_len=None)
    # It fits on two nodes (128 shards).
    assert plan("qwen3_32b", seq_len=None, nodes=2, rdzv_endpoint="h:1").memory.fits
    # Activations dominate without checkpointing: the knob is full activation checkpointing.
    with pytest.raises(LaunchError, match="with ac full") as info:
        plan("qwen3_14b", seq_len=8192, nodes=2, rdzv_endpoint="h:1", ac="none")
    assert info.value.field == "ac"


def test_moe_recipe_accepts_expert_parallelism_dividing_fsdp():
    p = plan("qwen3_moe_debug", ep=8, seq_len=None)
    assert p.dims.ep == 8 and p.model_shape.experts == 64
    with pytest.raises(LaunchError, match="Expert parallelism 3 does not divide"):
        plan("qwen3_moe_debug", ep=3, seq_len=None)


def test_describe_shows_the_numbers():
    text = describe(plan())
    assert "64 = 1 x 64 per node" in text and "LNC 2" in text and "FSDP 64" in text
    assert "NEURON_LOGICAL_NC_CONFIG=2" in text and "torchrun" in text
    # issue 56: the estimate says what it adds up and what the step lines measure instead
    (memory,) = (line for line in text.splitlines() if line.startswith("memory/rank"))
    assert "estimated: model and optimizer state " in memory and "activations " in memory
    assert memory.endswith("(a step line's memory: the peak HBM the Neuron runtime gave "
                           "TorchNeuron's allocator)")  # fmt: skip
    cpu = describe(plan("tiny_dense", instance="cpu", seq_len=None, ranks_per_node=2))
    assert "(a step line's memory: the rank's peak RSS, its whole process" in cpu


def test_the_shell_is_checked_when_the_plan_is_resolved():
    p = plan()
    with pytest.raises(LaunchError, match="NEURON_CC_FLAGS sets --lnc=1"):
        check_shell(p.topology, {"NEURON_CC_FLAGS": "--lnc 1 -O1"})
    with pytest.raises(LaunchError, match="NEURON_CC_FLAGS sets --lnc=1"):
        plan(shell={"NEURON_CC_FLAGS": "--lnc 1 -O1"})
    env = p.rank_env({"NEURON_CC_FLAGS": "-O1", "PATH": "/bin"})
    assert env["NEURON_CC_FLAGS"] == "-O1" and env["PATH"] == "/bin"
    assert env["NEURON_LOGICAL_NC_CONFIG"] == "2"


@pytest.mark.parametrize("visible", ["5", "0,1", "0-63"])
def test_visible_cores_in_the_shell_are_refused_for_several_ranks_per_node(visible):
    with pytest.raises(LaunchError, match=rf"^NEURON_RT_VISIBLE_CORES={visible} is set") as info:
        plan(shell={"NEURON_RT_VISIBLE_CORES": visible})
    assert "\n" not in str(info.value)
    # one rank per node may keep one named core; never several
    assert plan(ranks_per_node=1, fsdp=1, shell={"NEURON_RT_VISIBLE_CORES": "5"}).world_size == 1


def test_compile_on_neuron_gets_the_neuron_backend_and_refuses_others():
    p = plan(overrides=("--compile.enable",))
    assert p.config.compile.backend == p.compile_backend == "neuron"
    at = p.overrides.index("--compile.backend")  # the placement's, before the user's overrides
    assert p.overrides[at + 1] == "neuron" and at < p.overrides.index("--compile.enable")
    assert "backend neuron" in describe(p)
    with pytest.raises(LaunchError, match=r"^Compile backend 'inductor' does not target trn2"):
        plan(overrides=("--compile.enable", "--compile.backend", "inductor"))
    assert plan(instance="cpu", seq_len=None).config.compile.enable is False


def test_cpu_ranks_get_huge_pages_unless_the_shell_says_otherwise():
    cpu = RunRequest(recipe="tiny_dense", instance="cpu", ranks_per_node=2)
    env = resolve_plan(cpu, shell={}).env
    assert env[CPU_HUGE_PAGES] == "1"
    assert rank_env(env, device_type="cpu", ranks_per_node=2, shell={})[CPU_HUGE_PAGES] == "1"
    # the user's own setting reaches the ranks, not the plan's
    shell = {CPU_HUGE_PAGES: "0"}
    env = resolve_plan(cpu, shell=shell).env
    assert CPU_HUGE_PAGES not in env
    assert rank_env(env, device_type="cpu", ranks_per_node=2, shell=shell)[CPU_HUGE_PAGES] == "0"
    assert CPU_HUGE_PAGES not in plan().env  # a trn2 plan
