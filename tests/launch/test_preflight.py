"""Preflight checks that need no training: the report, the plan-level checks, the weights check."""

import dataclasses
import json
from functools import partial
from pathlib import Path

import pytest
import torch

from qwentitan.launch.launcher.plan import RunRequest, resolve_plan
from qwentitan.launch.launcher.preflight import CheckResult, PreflightReport
from qwentitan.launch.launcher.preflight.checks import check_lnc, check_seq_len, check_versions
from qwentitan.launch.launcher.preflight.weights import check_weights


@pytest.fixture(scope="module")
def trn2_plan():
    return resolve_plan(RunRequest(recipe="qwen3_4b_native"))


@pytest.fixture(scope="module")
def tiny_plan():
    return resolve_plan(RunRequest(recipe="tiny_dense", instance="cpu", ranks_per_node=1))


def test_report_names_failures_and_skips():
    report = PreflightReport("r", "trn2.48xlarge", "here (cpu)")
    report.checks += [
        CheckResult("versions", "pass", "ok", {"torch": "2.14.1"}),
        CheckResult("devices", "skip", "no neuron devices"),
        CheckResult("weights", "fail", "missing"),
    ]
    assert not report.passed and report.failed == ["weights"] and report.skipped == ["devices"]
    text = report.render()
    assert "FAIL  weights" in text and "SKIP  devices" in text
    assert text.splitlines()[-1] == "preflight FAILED: weights (1 skipped: devices)"
    assert json.loads(report.to_json())["checks"][0]["figures"] == {"torch": "2.14.1"}


def test_report_is_attached_to_an_mlflow_run(tmp_path, new_mlflow_store):
    import mlflow

    report = PreflightReport("r", "cpu", "here (cpu)", [CheckResult("disk", "pass", "plenty")])
    uri = new_mlflow_store(tmp_path)
    run_id = report.log_to_mlflow(uri)
    client = mlflow.MlflowClient(tracking_uri=uri)
    run = client.get_run(run_id)
    assert run.data.tags["preflight"] == "passed"
    assert run.data.metrics["preflight_failed_checks"] == 0
    local = mlflow.artifacts.download_artifacts(run_id=run_id, artifact_path="preflight/report.json",
                                                tracking_uri=uri, dst_path=str(tmp_path / "a"))  # fmt: skip
    assert json.loads(Path(local).read_text())["passed"] is True


def test_plan_level_checks_run_on_cpu_for_a_trn2_plan(trn2_plan, monkeypatch):
    for key in ("NEURON_LOGICAL_NC_CONFIG", "NEURON_CC_FLAGS"):
        monkeypatch.delenv(key, raising=False)
    lnc = check_lnc(trn2_plan)
    assert lnc.status == "pass" and lnc.figures["runtime"] == 2
    assert lnc.figures["shell_compiler"] is None  # TorchNeuron passes --lnc from the runtime's
    monkeypatch.setenv("NEURON_CC_FLAGS", "--lnc=1")
    assert check_lnc(trn2_plan).status == "fail"
    seq = check_seq_len(trn2_plan)
    assert seq.status == "pass" and seq.figures == {"seq_len": 4096, "multiple_of": 512}
    assert check_versions(trn2_plan).status == "pass"  # this environment is the tested matrix


def test_weights_check_against_the_flavor(tiny_plan, tmp_path):
    from transformers import AutoModelForCausalLM

    from qwentitan.modeling import flavor_to_hf_config

    assert check_weights(tiny_plan, tmp_path / "absent").status == "fail"
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(flavor_to_hf_config("tiny-dense"))
    model.save_pretrained(tmp_path / "good")
    good = check_weights(tiny_plan, tmp_path / "good")
    assert good.status == "pass" and good.figures["missing"] == []
    moe = AutoModelForCausalLM.from_config(flavor_to_hf_config("tiny-moe"))
    moe.save_pretrained(tmp_path / "other")
    other = check_weights(tiny_plan, tmp_path / "other")
    assert other.status == "fail" and "does not hold flavor tiny-dense" in other.detail
    # a MoE folder holds its experts one tensor each, as save_pretrained writes them
    moe_plan = resolve_plan(RunRequest(recipe="tiny_moe", instance="cpu", ranks_per_node=1))
    assert check_weights(moe_plan, tmp_path / "other").status == "pass"
    # a damaged file is named by the one folder reader, not reported as a crash
    shard = tmp_path / "good" / "model.safetensors"
    shard.write_bytes(shard.read_bytes()[:-8])
    damaged = check_weights(tiny_plan, tmp_path / "good")
    assert damaged.status == "fail" and f"{shard} is truncated or corrupt" in damaged.detail


def test_kernels_check_launches_each_op_of_the_recipe_and_names_route_and_difference(monkeypatch):
    from qwentitan.kernels import numerics
    from qwentitan.launch.launcher.preflight.checks import check_kernels

    monkeypatch.setenv("QWENTITAN_KERNELS", "attention=reference")  # read when the plan is built
    plan = resolve_plan(RunRequest(recipe="tiny_moe_kernels", instance="cpu", ranks_per_node=1))
    result = check_kernels(plan)
    # Every op the model runs, by the route it takes on this host: the reference twins on cpu.
    assert set(result.figures) == {"rope", "causal_attention", "grouped_experts"}
    assert {f["route"] for f in result.figures.values()} == {"reference twin"}
    assert result.status == "pass" and result.figures["rope"]["max_abs_diff"] == 0.0
    assert result.detail.startswith("rope reference twin 0.00e+00, causal_attention reference twin")
    monkeypatch.delenv("QWENTITAN_KERNELS")
    default = check_kernels(
        resolve_plan(RunRequest(recipe="tiny_moe_kernels", instance="cpu", ranks_per_node=1))
    )
    assert set(default.figures) == {"rope", "grouped_experts"}, "attention stays torchtitan's"

    real = numerics.numerics_report

    def off(*args, **kwargs):
        report = real(*args, **kwargs)
        return dataclasses.replace(report, forward_max_abs_diff=0.5)

    monkeypatch.setattr(numerics, "numerics_report", off)
    failed = check_kernels(plan)
    assert failed.status == "fail" and "5.00e-01" in failed.detail
    assert (
        check_kernels(
            resolve_plan(RunRequest(recipe="tiny_dense", instance="cpu", ranks_per_node=1))
        ).status
        == "skip"
    )


def test_init_ops_check_refuses_trunc_normal_on_a_neuron_plan():
    from torch import nn

    from qwentitan.launch.launcher.preflight.init_ops import check_init_ops

    plan = resolve_plan(RunRequest(recipe="qwen3_moe_kernels"))
    passed = check_init_ops(plan)
    assert passed.status == "pass" and passed.figures["ops"] == ["normal_", "ones_", "zeros_"]
    model = plan.config.model_spec.model
    init = {"weight": partial(nn.init.trunc_normal_, std=0.02)}
    plan.config.model_spec.model = dataclasses.replace(
        model, lm_head=dataclasses.replace(model.lm_head, param_init=init)
    )
    failed = check_init_ops(plan)
    assert failed.status == "fail" and "first: lm_head.param_init.weight" in failed.detail
    assert "trunc_normal_" in failed.figures["ops"]
    # Only TorchNeuron mishandles it: a cpu plan passes and says why.
    tiny = resolve_plan(RunRequest(recipe="tiny_moe", instance="cpu", ranks_per_node=1))
    tiny.config.model_spec.model = dataclasses.replace(
        tiny.config.model_spec.model, lm_head=plan.config.model_spec.model.lm_head
    )
    assert check_init_ops(tiny).status == "pass"
    assert "refused on neuron plans only" in check_init_ops(tiny).detail
    hf = check_init_ops(resolve_plan(RunRequest(recipe="qwen3_4b_hf")))
    assert hf.status == "skip" and "transformers" in hf.detail


_MOUNTS = """\
/dev/nvme0n1p1 / ext4 rw,relatime 0 0
10.0.0.5@tcp:/abcdefgh /fsx lustre rw,flock 0 0
fs-0123.efs.us-east-1.amazonaws.com:/ /mnt/efs nfs4 rw,vers=4.1 0 0
"""


@pytest.mark.parametrize(
    ("nodes", "cache", "status", "says"),
    [
        (2, None, "warn", "each of the 2 nodes compiles every graph again; pass --compile-cache"),
        (2, "/fsx/neuron-compile-cache", "pass", "on lustre (/fsx): the 2 nodes share it"),
        (4, "/mnt/efs/neff", "pass", "on nfs4 (/mnt/efs): the 4 nodes share it"),
        (2, "/fsxdata/neff", "warn", "on this host's ext4 at /"),
        (1, None, "pass", "one node"),
    ],
)
def test_compile_cache_warns_when_a_multi_node_plan_compiles_on_every_host(
    nodes, cache, status, says
):
    from qwentitan.launch.launcher.preflight.compile_cache import check_compile_cache

    request = RunRequest(recipe="qwen3_4b_native", nodes=nodes, compile_cache=cache)
    result = check_compile_cache(resolve_plan(request, shell={}), mounts=_MOUNTS)
    assert result.status == status and says in result.detail, result.detail
    if cache is None:  # the default, under the home folder
        assert result.figures["source"] == "default"


def test_a_warning_is_reported_but_does_not_fail_preflight():
    report = PreflightReport("r", "trn2.48xlarge", "here (cpu)")
    report.checks += [
        CheckResult("compile_cache", "warn", "per host"),
        CheckResult("disk", "pass", "ok"),
    ]
    assert report.passed and report.warned == ["compile_cache"]
    assert report.render().splitlines()[-1] == "preflight PASSED (1 warned: compile_cache)"
    assert report.to_dict()["warned"] == ["compile_cache"]


@pytest.mark.parametrize(
    ("recipe", "weights_dir", "skipped"),
    [
        ("tiny_dense", None, True),  # random init: the tokenizer's folder holds no weights
        ("tiny_moe", None, True),
        ("qwen3_4b_native", None, True),  # its Hub folder is read for the tokenizer only
        ("qwen3_4b_hf", None, False),  # starts from the Hub weights
        ("tiny_dense", "some/folder", False),  # --weights asks for the folder's check
    ],
)
def test_weights_checks_are_skipped_with_the_reason_where_the_plan_loads_no_weights(
    recipe, weights_dir, skipped, monkeypatch
):
    from qwentitan.launch.launcher.preflight import run as preflight_run
    from qwentitan.launch.launcher.preflight import weights

    here = {"instance": "cpu", "ranks_per_node": 1} if recipe.startswith("tiny") else {}
    plan = resolve_plan(RunRequest(recipe=recipe, **here))
    checked = []
    # Only the weights checks run for real here; every other check passes at once.
    passing = lambda *a, **k: CheckResult("other", "pass", "ok")  # noqa: E731
    for module in ("checks", "neuron_stack", "host_os", "efa", "dataset", "init_ops"):
        for name in dir(getattr(preflight_run, module)):
            if name.startswith("check_"):
                monkeypatch.setattr(getattr(preflight_run, module), name, passing)
    for name in preflight_run.WEIGHT_CHECKS:
        fn = f"check_{name}"
        monkeypatch.setattr(
            weights, fn, lambda *a, _n=name, **k: checked.append(_n) or CheckResult(_n, "pass", "")
        )
    report = preflight_run.run_preflight(plan, weights_dir=weights_dir)
    if skipped:
        assert report.passed and checked == []
        for name in preflight_run.WEIGHT_CHECKS:
            assert report.get(name).status == "skip"
            assert report.get(name).detail.startswith("the recipe starts from random weights")
    else:
        assert checked == list(preflight_run.WEIGHT_CHECKS)
