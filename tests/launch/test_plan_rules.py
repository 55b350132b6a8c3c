"""Every rule of a run is `resolve_plan`'s: plan, run and train refuse the same runs, in one
sentence with exit code 2, whether a value comes from our flags or from a torchtitan override."""

from __future__ import annotations

import re

import pytest

from qwentitan.launch.base.errors import LaunchError
from qwentitan.launch.launcher import cli
from qwentitan.launch.launcher.plan import RunRequest, resolve_plan


def refusal(capsys, argv: list[str]) -> str:
    code = cli.main(argv)
    out, err = capsys.readouterr()
    assert code == 2, out + err
    line = err.strip()
    assert "\n" not in line and "Traceback" not in err, err
    return line.removeprefix(f"qwentitan-launch {argv[0]}: ")


@pytest.mark.parametrize("command", ["plan", "train"])
def test_a_sequence_longer_than_the_model_is_refused_by_plan_as_by_train(capsys, command):
    argv = [command, "--recipe", "tiny_dense", "--seq-len", "4096"]
    assert refusal(capsys, argv) == (
        "--seq-len 4096 is longer than the model's 2048 positions; pass --seq-len 2048 or less."
    )


def test_a_sequence_the_chunked_loss_cannot_split_is_one_sentence(capsys):
    message = refusal(capsys, ["plan", "--recipe", "tiny_dense", "--seq-len", "7"])
    assert message.startswith("--seq-len 7 does not split into the loss's 8 chunks")
    assert message.endswith("pass --seq-len 8 or another multiple of 8.")


@pytest.mark.parametrize(
    ("override", "flag"),
    [
        (["--training.steps", "0"], "--training.steps 0 is out of range"),
        (["--training.local-batch-size", "0"], "--training.local-batch-size 0 is out of range"),
        (["--validator.freq", "0"], "--validator.freq 0 is out of range"),
        (
            ["--stop-after", "0"],
            "--stop-after 0 is out of range; pass a whole number of 1 or more with --stop-after.",
        ),
        (["--training.global-batch-size", "0"], "--training.global-batch-size 0 is out of range"),
    ],
)
def test_torchtitan_overrides_get_the_range_checks_of_our_flags(capsys, override, flag):
    message = refusal(capsys, ["plan", "--recipe", "tiny_dense", "--", *override])
    assert message.startswith(flag)


def test_stop_after_must_fall_between_the_resumed_step_and_the_last(tmp_path):
    saved = tmp_path / "checkpoint" / "step-20"
    saved.mkdir(parents=True)
    (saved / ".metadata").write_bytes(b"")
    plan = dict(instance="cpu", run_dir=str(tmp_path), resume="latest")
    with pytest.raises(LaunchError, match=r"^stop_after 20 is not after step 20, where the run"):
        resolve_plan(RunRequest(recipe="tiny_dense", stop_after=20, **plan))
    with pytest.raises(LaunchError, match=r"^stop_after 40 is not before the last step 40"):
        resolve_plan(RunRequest(recipe="tiny_dense", stop_after=40, **plan))
    assert (
        resolve_plan(RunRequest(recipe="tiny_dense", stop_after=21, **plan)).config.stop_after == 21
    )
    # the same rule for the value given as a torchtitan override
    with pytest.raises(LaunchError, match=r"^stop_after 5 is not after step 20"):
        resolve_plan(RunRequest(recipe="tiny_dense", overrides=["--stop-after", "5"], **plan))
    # a fresh run resumes nothing
    assert (
        resolve_plan(
            RunRequest(recipe="tiny_dense", stop_after=5, instance="cpu")
        ).config.stop_after
        == 5
    )


def test_the_device_reaches_the_ranks_as_config(capsys):
    plan = resolve_plan(RunRequest(recipe="tiny_moe", instance="cpu"))
    words = plan.torchrun_args()
    assert words[words.index("--target") + 1] == "cpu"
    assert plan.config.target == "cpu" and plan.config.training.disable_cuda_graphs
    assert "QWENTITAN_PLATFORM" not in plan.rank_env({})


def test_a_global_batch_no_step_could_finish_is_refused(capsys):
    argv = ["plan", "--recipe", "tiny_dense", "--ranks-per-node", "1"]
    line = refusal(capsys, [*argv, "--global-batch-size", "1000000000000"])
    assert re.fullmatch(
        r"Global batch 1000000000000 would take \d+ microbatches per optimizer step on each of 1 "
        r"data-parallel rank\(s\) \(local batch \d+\), more than 65536; pass "
        r"--global-batch-size \d+ or less\.",
        line,
    ), line


def test_pipeline_parallelism_with_fewer_microbatches_than_stages_is_refused(capsys):
    argv = ["plan", "--recipe", "tiny_dense_untied", "--ranks-per-node", "2", "--pp", "2"]
    assert refusal(capsys, [*argv, "--local-batch-size", "1"]) == (
        "Pipeline parallelism 2 with the 1F1B schedule needs at least 2 microbatches per local "
        "batch, and --local-batch-size 1 holds 1 of size 1; pass --local-batch-size 2 or more, "
        "or a smaller --pp."
    )
    assert cli.main([*argv, "--local-batch-size", "2"]) == 0


def test_more_cpu_ranks_than_the_host_s_memory_holds_are_refused(capsys, monkeypatch):
    """A CPU rank is a whole Python process with torch loaded (1.28 GiB RSS measured for
    tiny_dense) besides its model: 64 of them do not fit a 23 GiB host."""
    from qwentitan.launch.base import host

    monkeypatch.setattr(host, "memory_bytes", lambda: 23 << 30)
    argv = ["plan", "--recipe", "tiny_dense", "--instance", "cpu", "--ranks-per-node"]
    line = refusal(capsys, [*argv, "64"])
    assert re.fullmatch(
        r"Recipe 'tiny_dense' needs about 1\.\d GiB per rank but a cpu rank has 0\.4 GiB \(90% "
        r"usable\); pass --ranks-per-node 1\d or fewer\.",
        line,
    ), line
    fewer = int(line.rsplit(" ", 3)[-3])
    assert cli.main([*argv, str(fewer)]) == 0
