"""Every mesh, one curve: the same recipe, seed and global batch give the same step-0 weights
and the same documents in every step's global batch, whatever the layout."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from qwentitan.launch.runtime.data import TextDataLoader

GLOBAL_BATCH = 8


@pytest.fixture(scope="module")
def documents(tmp_path_factory):
    data = tmp_path_factory.mktemp("data") / "data.jsonl"
    lines = [json.dumps({"text": f"document {i} " + "word " * (i % 7)}) for i in range(60)]
    data.write_text("\n".join(lines) + "\n")
    return str(data)


def _loaders(documents, qwen, ranks, local):
    return [
        TextDataLoader.Config(dataset=documents).build(
            dp_world_size=ranks, dp_rank=r, tokenizer=qwen, seq_len=8, local_batch_size=local
        )
        for r in range(ranks)
    ]


def _steps(iterators, local, ranks, steps):
    """The windows of each step: every rank's microbatches, as torchtitan's loop takes them."""
    accumulation = GLOBAL_BATCH // (local * ranks)
    taken = []
    for _ in range(steps):
        windows = []
        for _ in range(accumulation):
            for it in iterators:
                inputs, _labels = next(it)
                windows += [tuple(row.tolist()) for row in inputs["input"]]
        taken.append(sorted(windows))
    return taken


@pytest.mark.parametrize(("ranks", "local"), [(2, 2), (4, 2), (2, 4), (4, 1)])
def test_each_step_reads_the_same_windows_for_any_data_parallel_degree(
    documents, qwen, ranks, local
):
    one = _steps([iter(_loaders(documents, qwen, 1, 2)[0])], 2, 1, steps=3)
    many = _steps(
        [iter(loader) for loader in _loaders(documents, qwen, ranks, local)], local, ranks, 3
    )
    assert many == one
    assert len({w for step in one for w in step}) == 3 * GLOBAL_BATCH  # no window twice


def test_a_run_resumes_its_data_position_with_another_data_parallel_degree(documents, qwen):
    two = _loaders(documents, qwen, 2, 2)
    iterators = [iter(loader) for loader in two]
    _steps(iterators, 2, 2, steps=1)
    saved = [loader.state_dict() for loader in two]
    assert saved[0] == saved[1]  # one position for all ranks, saved once under one key
    resumed = _loaders(documents, qwen, 1, 2)[0]
    resumed.load_state_dict(saved[0])
    straight = _steps([iter(_loaders(documents, qwen, 1, 2)[0])], 2, 1, steps=3)
    assert _steps([iter(resumed)], 2, 1, steps=2) == straight[1:]


@pytest.fixture(scope="module")
def on_two_ranks(tmp_path_factory):
    """What `mesh_ranks.py` saw on two gloo ranks, by file name: the initial weights of
    tiny-dense under FSDP 2 and TP 2 with qwentitan's init and torchtitan's own, and each rank's
    uneven expert-token exchange."""
    out = tmp_path_factory.mktemp("mesh-ranks")
    ranks = Path(__file__).with_name("mesh_ranks.py")
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone",
               "--nproc-per-node=2", str(ranks), str(out)]  # fmt: skip
    done = subprocess.run(command, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    return {file.stem: torch.load(file) for file in out.glob("*.pt")}


@pytest.fixture(scope="module")
def one_rank_weights():
    """tiny-dense initialised by torchtitan on one rank (no DTensor), seeded as the ranks are."""
    from qwentitan.modeling import model_spec

    with torch.device("meta"):
        model = model_spec("tiny-dense").model.build()
    model.to_empty(device="cpu")
    torch.manual_seed(0)
    model.init_weights(buffer_device=None)
    return dict(model.named_parameters())


@pytest.mark.slow
@pytest.mark.parametrize("layout", ["fsdp2", "tp2"])
def test_every_layout_starts_from_the_weights_of_one_rank(on_two_ranks, one_rank_weights, layout):
    ours = on_two_ranks[f"{layout}-qwentitan"]
    assert ours.keys() == one_rank_weights.keys()
    for name, weight in one_rank_weights.items():
        assert torch.equal(ours[name], weight), name
    # torchtitan's own init on this CPU mesh: each rank draws its shard from the same seed
    theirs = on_two_ranks[f"{layout}-torchtitan"]
    assert not all(torch.equal(theirs[n], w) for n, w in one_rank_weights.items())


@pytest.mark.slow
def test_expert_tokens_cross_gloo_ranks_in_uneven_splits(on_two_ranks):
    zero, one = on_two_ranks["exchange-0"], on_two_ranks["exchange-1"]
    # rank 0 sends [0] to itself and [1, 2] to rank 1; rank 1 sends [100, 101] and [102..104]
    assert zero["arrived"] == [0.0, 100.0, 101.0]
    assert one["arrived"] == [1.0, 2.0, 102.0, 103.0, 104.0]
    assert zero["back"] == [0.0, 2.0, 4.0] and one["back"] == [200.0, 202.0, 204.0, 206.0, 208.0]
    assert zero["grad"] == [2.0] * 3 and one["grad"] == [2.0] * 5  # through both exchanges
    assert "invalid tensor size" in zero["gloo_lists"]  # why torchtitan's exchange fails here


def _refused(capsys, *argv):
    """`qwentitan-launch plan ARGV` on this host's 2 ranks: its one-sentence refusal."""
    from qwentitan.launch.launcher import cli

    assert cli.main(["plan", "--ranks", "2", *argv]) == 2
    message = capsys.readouterr().err.strip()
    assert "\n" not in message and "Traceback" not in message
    return message.removeprefix("qwentitan-launch plan: ")


@pytest.mark.parametrize(
    ("layout_flags", "layout", "fix"),
    [
        (["--tp", "2"], "TP 2", "--tp 1"),
        (["--pp", "2"], "PP 2", "--pp 1"),
        (
            ["--", "--parallelism.context-parallel-degree", "2"],
            "CP 2",
            "--parallelism.context-parallel-degree 1",
        ),
    ],
)
def test_the_hf_path_shards_with_fsdp_only_and_says_so_at_plan_time(
    capsys, layout_flags, layout, fix
):
    message = _refused(capsys, "--recipe", "tiny_hf", *layout_flags)
    assert f"not {layout}; pass {fix}," in message and "native-path recipe" in message


def test_context_parallelism_is_refused_on_cpu(capsys):
    message = _refused(
        capsys, "--recipe", "tiny_dense", "--", "--parallelism.context-parallel-degree", "2"
    )
    assert "does not train on CPU" in message
    assert message.endswith("pass --parallelism.context-parallel-degree 1 here.")


def test_pipeline_parallelism_needs_untied_embeddings(capsys):
    message = _refused(capsys, "--recipe", "tiny_dense", "--pp", "2")
    assert "ties its input embedding to its output head" in message and "--pp 1" in message
    from qwentitan.launch.launcher.plan import RunRequest, resolve_plan

    untied = resolve_plan(RunRequest(recipe="tiny_moe", instance="cpu", ranks_per_node=2, pp=2))
    # the console shows the last stage's first rank, the only one with the loss
    assert "--local-ranks-filter=1" in untied.torchrun_args()


def test_expert_parallelism_spelled_as_extra_ranks_names_the_layout_it_means(capsys):
    message = _refused(capsys, "--recipe", "tiny_moe", "--ranks", "4", "--fsdp", "2", "--ep", "2")
    assert "borrows its ranks from FSDP x CP x TP" in message
    assert "pass --fsdp 4 --ep 2" in message
    from qwentitan.launch.launcher.plan import RunRequest, resolve_plan

    right = RunRequest(recipe="tiny_moe", instance="cpu", ranks_per_node=4, fsdp=4, ep=2)
    assert resolve_plan(right).dims.ep == 2


@pytest.mark.parametrize("schedule", ["1F1B", "ZBVZeroBubble"])
def test_the_console_rank_is_torchtitans_metrics_rank_on_its_node(schedule):
    from qwentitan.launch.base.target import get_topology
    from qwentitan.launch.launcher.launch_plan import LaunchPlan

    def shown(pp: int, nodes: int = 1, schedule: str = schedule) -> int:
        words = ("--target", "cpu", "--parallelism.pipeline-parallel-degree", str(pp),
                 "--parallelism.pipeline-parallel-schedule", schedule)  # fmt: skip
        topology = get_topology("cpu", ranks_per_node=4)
        return LaunchPlan(recipe="tiny_moe", overrides=words, topology=topology, nodes=nodes)\
            .console_rank  # fmt: skip

    last = 0 if schedule == "ZBVZeroBubble" else 2  # V schedules end on the first rank
    assert shown(pp=2) == last
    assert shown(pp=1) == 0
    # 2 nodes x 4, PP 4: the last stage starts at rank 6, local rank 2 of the second node
    assert shown(pp=4, nodes=2, schedule="1F1B") == 2


def test_aws_reference_run_plans_as_its_tutorial_defines_it():
    from qwentitan.launch.launcher.plan import RunRequest, resolve_plan
    from qwentitan.launch.recipes import recipe_info

    plan = resolve_plan(RunRequest(recipe="qwen3_8b_tp4_fsdp16_sac")).facts()
    assert plan["topology"]["instance"] == "trn2.48xlarge" and plan["world_size"] == 64
    assert plan["parallelism"] == {
        "fsdp": 16,
        "dp_replicate": 1,
        "tp": 4,
        "cp": 1,
        "pp": 1,
        "ep": 1,
    }
    assert plan["activation_checkpoint"] == "selective" and not plan["config"]["compile"]
    assert (plan["seq_len"], plan["local_batch"], plan["global_batch"]) == (4096, 1, 16)
    assert plan["model"]["flavor"] == "qwen3-8b" and plan["config"]["initial_load_in_hf"]
    memory = plan["memory_per_rank"]
    assert memory["available_gib"] == 24.0 and memory["fits"]
    assert recipe_info("qwen3_8b_tp4_fsdp16_sac").hub_model == "Qwen/Qwen3-8B"


def test_the_cpu_twin_has_the_same_mesh_shape():
    from qwentitan.launch.launcher.plan import RunRequest, resolve_plan

    plan = resolve_plan(RunRequest(recipe="tiny_tp2_fsdp2_sac", instance="cpu", ranks_per_node=4))
    assert (plan.dims.tp, plan.dims.dp_shard) == (2, 2)
    assert plan.activation_checkpoint == "selective"
    assert plan.global_batch == 8  # pinned: the same windows on 2 or 4 ranks


def test_torchtitans_pipeline_hint_is_dropped_since_the_console_shows_the_last_stage(caplog):
    import logging

    from qwentitan.launch.runtime.console import quiet_console

    quiet_console()
    with caplog.at_level(logging.INFO):
        logging.getLogger().warning(  # as torchtitan colours it
            "\x1b[31mPipeline Parallel loss is not visible. Please add \x1b[33mrank 1\x1b[31m "
            "to LOG_RANK environment variable in run_train.sh.\x1b[39m"
        )
        logging.getLogger().info("step:  1  loss: 11.95195")
    assert [r.getMessage() for r in caplog.records] == ["step:  1  loss: 11.95195"]


# The mesh pilot's short version (CI): 3 steps of 8 windows of 64 tokens. Its pairs cover FSDP x
# TP (4 ranks) against 1 rank, EP on the kernel experts against tiny_moe's FSDP 2, and tiny_moe
# under FSDP 2 x TP 2 (the trn2 MoE recipe's mesh in small) against that same FSDP 2; a third,
# TP 2 from the next seed (`--perturb`), must fail: the pilot can fail. Each pair is judged on
# its training loss and on its validation loss (at step 1, the one validation of 3 steps). (The
# paths pilot's dense pair trains in tests/integration/test_mlflow_ui.py; its perturbed
# checkpoint and the mesh pilot's failure sentence are tests/launch/test_pilot.py's.)
CI_PAIRS = ("tiny_dense.fsdp2-tp2", "tiny_moe_kernels.ep2", "tiny_moe.fsdp2-tp2")
PERTURBED = "tiny_dense.tp2"
CI_STEPS = 3


@pytest.mark.slow
def test_every_layout_trains_one_curve_and_a_perturbed_one_fails_in_the_mesh_pilot(
    tmp_path, capsys, new_mlflow_store
):
    from mlflow import MlflowClient

    from qwentitan.launch.launcher.pilot.__main__ import main as pilot_main

    uri = new_mlflow_store(tmp_path)
    pairs = [word for name in (*CI_PAIRS, PERTURBED) for word in ("--pair", name)]
    argv = [*pairs, "--perturb", PERTURBED, "--steps", str(CI_STEPS), "--seq-len", "64",
            "--run-dir", str(tmp_path / "pilot"), "--tracking-uri", uri]  # fmt: skip
    assert pilot_main(argv) == 1  # the perturbed pair failed, and so the pilot
    verdicts = {  # (layout, curve) -> its verdict: training loss, validation loss (step 1)
        (line.split()[1], "validation" if ") validation loss: " in line else "loss"): line
        for line in capsys.readouterr().out.splitlines()
        if line.startswith("pilot: tiny_") and " layout (" in line
    }
    assert set(verdicts) == {(n, c) for n in (*CI_PAIRS, PERTURBED) for c in ("loss", "validation")}
    for name in CI_PAIRS:
        assert ": passed, max |loss difference|" in verdicts[name, "loss"]
        said = verdicts[name, "validation"]
        assert ": passed, max |validation loss difference|" in said and "over 1 step (" in said
    for curve, words in (("loss", "loss"), ("validation", "validation loss")):
        said = verdicts[PERTURBED, curve]
        assert f": FAILED, |{words} difference|" in said and "exceeds the limit 1e-04" in said
    client = MlflowClient(uri)
    (parent,) = client.search_runs(
        [client.get_experiment_by_name("qwentitan-pilot").experiment_id],
        filter_string="attributes.run_name LIKE 'mesh-pilot-%'",
    )
    assert parent.info.status == "FAILED" and parent.data.tags["pilot.result"] == "failed"
    assert parent.data.tags["pilot.perturbed"] == PERTURBED
    assert parent.data.tags["pilot.failed"] == "none"  # every child trained
    for name in (*CI_PAIRS, PERTURBED):
        history = client.get_metric_history(parent.info.run_id, f"layout/{name}/abs_loss_diff")
        assert sorted(m.step for m in history) == list(range(1, CI_STEPS + 1)), name
        key = f"layout/{name}/validation/abs_loss_diff"  # torchtitan validates at step 1
        assert [m.step for m in client.get_metric_history(parent.info.run_id, key)] == [1], name
        assert parent.data.tags[f"layout/{name}/validation/result"] == (
            "failed" if name == PERTURBED else "passed"
        )
    assert [a.path for a in client.list_artifacts(parent.info.run_id, "plots")] == [
        "plots/pilot_losses.png"
    ]
