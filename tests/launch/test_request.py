"""One `RunRequest` from one set of flags: every command takes the same layout flags with one
meaning, the old spellings still work, and a refusal names the flag the user typed."""

from __future__ import annotations

import json

import pytest

from qwentitan.launch.base.errors import LaunchError
from qwentitan.launch.launcher import cli
from qwentitan.launch.launcher.plan import RunRequest, resolve_plan
from qwentitan.launch.launcher.plan_cli import FLAGS, flag_of

LAYOUT_FLAGS = ("--tp", "--fsdp", "--ep", "--pp", "--dp-replicate", "--ac", "--global-batch-size")


@pytest.mark.parametrize("command", ["train", "plan", "run", "slurm", "preflight", "pilot"])
def test_every_command_lists_the_layout_flags(capsys, command):
    with pytest.raises(SystemExit) as done:
        cli.main([command, "--help"])
    assert done.value.code == 0
    shown = capsys.readouterr().out
    missing = [flag for flag in LAYOUT_FLAGS if f"{flag} " not in shown]
    assert missing == [], f"{command} --help lacks {missing}"


@pytest.mark.parametrize("command", ["train", "plan", "run", "slurm", "preflight"])
def test_the_run_folder_resume_and_ranks_have_one_name_and_keep_their_old_one(capsys, command):
    with pytest.raises(SystemExit):
        cli.main([command, "--help"])
    shown = capsys.readouterr().out
    for names in (("--run-dir", "--dump-folder"), ("--ranks-per-node", "--ranks"), ("--resume",)):
        assert all(f"{name} " in shown or f"{name}," in shown for name in names), names


def _plan_json(capsys, *argv: str) -> dict:
    assert cli.main(["plan", "--recipe", "tiny_dense", "--instance", "cpu", *argv, "--json"]) == 0
    return json.loads(capsys.readouterr().out)


def test_aliases_mean_the_same_field(capsys, tmp_path):
    folder = str(tmp_path / "run")
    new = _plan_json(capsys, "--ranks-per-node", "1", "--run-dir", folder, "--nodes", "1")
    old = _plan_json(capsys, "--ranks", "1", "--dump-folder", folder, "--nnodes", "1")
    assert new == old and new["ranks_per_node"] == 1 and new["config"]["dump_folder"] == folder


def test_a_bare_resume_continues_the_latest_and_each_command_keeps_its_default(capsys):
    assert _plan_json(capsys)["resume"] == "auto"
    assert _plan_json(capsys, "--resume")["resume"] == "latest"
    assert _plan_json(capsys, "--resume", "fresh")["resume"] == "fresh"
    from qwentitan.launch.launcher.cli import build_parser

    assert build_parser().parse_args(["train"]).resume == "fresh"
    assert build_parser().parse_args(["train", "--resume"]).resume == "latest"


def test_layout_flags_reach_torchtitans_parallelism(capsys):
    words = RunRequest(recipe="x", pp=2, dp_replicate=3, tp=4, fsdp=5, ep=6).trainer_overrides()
    pairs = dict(zip(words[::2], words[1::2], strict=True))
    assert pairs == {
        "--parallelism.data-parallel-shard-degree": "5",
        "--parallelism.data-parallel-replicate-degree": "3",
        "--parallelism.tensor-parallel-degree": "4",
        "--parallelism.pipeline-parallel-degree": "2",
        "--parallelism.expert-parallel-degree": "6",
    }
    # through the plan, on the CPU host (4 ranks on however many cores: a note, not a refusal)
    planned = _plan_json(capsys, "--ranks", "4", "--dp-replicate", "2")
    assert planned["parallelism"] == {
        "fsdp": 2, "dp_replicate": 2, "tp": 1, "cp": 1, "pp": 1, "ep": 1,
    }  # fmt: skip
    assert "--parallelism.data-parallel-replicate-degree" in planned["torchrun"]


@pytest.mark.usefixtures("torchtitan_recipes")
def test_pipeline_degree_is_planned():
    plan = resolve_plan(
        # untied embeddings: a tied pair cannot be split over pipeline stages (plan_rules)
        RunRequest(recipe="qwen3_moe_debug", instance="trn2.48xlarge", seq_len=2048, pp=2)
    )
    assert (plan.dims.pp, plan.dims.dp_shard) == (2, 32)


@pytest.mark.parametrize(
    ("argv", "said"),
    [
        (["--ranks", "65"], "--ranks 65 is more than trn2.48xlarge holds (64 logical cores at "
         "LNC 2); pass --ranks 64 or fewer."),
        (["--ranks-per-node", "65"], "--ranks-per-node 65 is more than trn2.48xlarge holds (64 "
         "logical cores at LNC 2); pass --ranks-per-node 64 or fewer."),
        (["--tp", "3"], "choose --tp dividing 64."),
        (["--ranks-per-node", "2", "--dp-replicate", "3"], "choose --dp-replicate dividing 2."),
        (["--ranks-per-node", "8", "--tp", "2", "--pp", "3"], "choose --tp and --pp whose product "
         "divides 8."),
        (["--seq-len", "1000"], "pass --seq-len 1024."),
    ],
)  # fmt: skip
def test_the_command_line_names_the_field_by_the_flag_typed(capsys, argv, said):
    argv = ["plan", "--recipe", "qwen3_4b_native", "--instance", "trn2.48xlarge", *argv]
    assert cli.main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("qwentitan-launch plan: ") and err.endswith(said), err


def test_the_library_names_the_field_itself():
    with pytest.raises(LaunchError) as refused:
        resolve_plan(RunRequest(recipe="qwen3_4b_native", ranks_per_node=65))
    assert refused.value.field == "ranks_per_node"
    assert str(refused.value).endswith("pass ranks_per_node 64 or fewer.")
    assert "--" not in str(refused.value)
    for field, value in (("tp", 0), ("ac", "most"), ("resume", "newest"), ("max_restarts", -1)):
        with pytest.raises(LaunchError) as refused:
            RunRequest(recipe="tiny_dense", **{field: value})
        assert refused.value.field == field and f"{{{field}}}" in refused.value.template


def test_every_flag_sets_the_request_field_of_its_name():
    fields = set(RunRequest.__dataclass_fields__)
    assert set(FLAGS) <= fields
    for field, flag in FLAGS.items():
        assert flag_of(field) == flag.names[0] == "--" + field.replace("_", "-")
