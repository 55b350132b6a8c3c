"""Multi-node: the global batch follows the world size unless pinned, and refusals name a fix that works."""

from __future__ import annotations

import json
import shlex

import pytest

from qwentitan.launch.base.errors import LaunchError
from qwentitan.launch.launcher import cli
from qwentitan.launch.launcher.plan import RunRequest, resolve_plan
from qwentitan.launch.launcher.slurm import LOG_FILE_OVERRIDES


def accumulation(plan) -> int:
    return plan.facts()["gradient_accumulation_steps"]


def test_the_recipes_batch_is_per_node_and_scales_with_nodes():
    one = resolve_plan(RunRequest(recipe="qwen3_4b_native", nodes=1))
    assert (one.world_size, one.global_batch, accumulation(one)) == (64, 64, 1)
    assert "--training.global-batch-size" not in one.overrides  # the recipe's own number
    four = resolve_plan(RunRequest(recipe="qwen3_4b_native", nodes=4))
    assert (four.world_size, four.global_batch, accumulation(four)) == (256, 256, 1)
    # The ranks load the recipe too: they are told the scaled batch, before the AC subcommand.
    at = four.overrides.index("--training.global-batch-size")
    assert four.overrides[at + 1] == "256"
    assert four.config.training.global_batch_size == 256


def test_fewer_data_parallel_ranks_keep_the_batch_by_accumulating():
    plan = resolve_plan(RunRequest(recipe="qwen3_4b_native", nodes=4, tp=2))
    assert plan.dims.dp_shard == 128
    assert (plan.global_batch, accumulation(plan)) == (256, 2)


def test_a_recipe_without_a_global_batch_takes_one_local_batch_per_rank():
    plan = resolve_plan(RunRequest(recipe="tiny_dense", instance="cpu", nodes=2, ranks_per_node=1))
    assert plan.global_batch == plan.local_batch * 2 and accumulation(plan) == 1
    assert "--training.global-batch-size" not in plan.overrides


def test_a_pinned_global_batch_is_kept_on_any_number_of_nodes():
    for nodes in (1, 2, 4):
        plan = resolve_plan(
            RunRequest(recipe="qwen3_4b_native", nodes=nodes, global_batch_size=512)
        )
        assert plan.global_batch == 512 and accumulation(plan) == 512 // (64 * nodes)
        at = plan.overrides.index("--training.global-batch-size")
        assert plan.overrides[at + 1] == "512"


@pytest.mark.parametrize(
    ("kw", "fix"),
    [
        ({"nodes": 4, "global_batch_size": 100}, 256),
        ({"nodes": 4, "lnc": 1}, 512),  # 128 ranks per node: the recipe's 64 per node is too few
    ],
)
def test_a_batch_that_does_not_divide_names_a_global_batch_that_works(kw, fix):
    with pytest.raises(LaunchError) as info:
        resolve_plan(RunRequest(recipe="qwen3_4b_native", **kw))
    message = str(info.value)
    assert "\n" not in message and f"pass global_batch_size {fix} " in message
    plan = resolve_plan(
        RunRequest(recipe="qwen3_4b_native", **{**kw, "global_batch_size": fix})
    )  # the advice works
    assert plan.global_batch == fix


def test_readme_example_writes_the_script_and_every_node_resolves_the_same_plan(
    tmp_path, monkeypatch, capsys
):
    monkeypatch.chdir(tmp_path)
    argv = ["slurm", "--recipe", "qwen3_4b_native", "--nodes", "4", "-o", "job.sbatch"]
    assert cli.main(argv) == 0
    assert "4 nodes x 64 ranks" in capsys.readouterr().out
    script = (tmp_path / "job.sbatch").read_text()
    joined = script.replace("\\\n", " ")
    srun = next(line for line in joined.splitlines() if "launcher.cli run" in line)
    words = shlex.split(srun)
    node_args = words[words.index("run") :]
    assert node_args[:2] == ["run", "--plan"]
    written = json.loads((tmp_path / "job.plan.json").read_text())
    overrides = written["overrides"]
    assert overrides[overrides.index("--training.global-batch-size") + 1] == "256"
    # What SLURM fills in on every node; --dry-run stops after printing the plan.
    node_args = [a.replace("$HEAD_ADDR:$RDZV_PORT", "head:29500") for a in node_args]
    assert cli.main([*node_args, "--dry-run"]) == 0
    printed = capsys.readouterr().out
    expected = resolve_plan(
        RunRequest(
            recipe="qwen3_4b_native",
            nodes=4,
            rdzv_endpoint="head:29500",
            max_restarts=3,
            overrides=LOG_FILE_OVERRIDES,  # what `slurm` adds: its ranks log to a file
        )
    )
    assert f"global {expected.global_batch}," in printed
    assert expected.command() in printed
