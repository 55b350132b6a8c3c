"""The pilot's parts that need no training: pair verdicts, the compare URL, the picture, its
refusals, the mesh pilot's children and layouts, and the experiment kind every qwentitan
experiment gets. The paths pilot itself trains in tests/integration/test_mlflow_ui.py, the mesh
pilot in tests/launch/test_every_mesh.py."""

from __future__ import annotations

import json
import math
import os
import re
import signal
import subprocess
import sys
import threading
import time
import urllib.parse
from pathlib import Path

import pytest
import torch
from mlflow import MlflowClient

from qwentitan.launch.base.errors import LaunchError
from qwentitan.launch.launcher.pilot import (
    PAIRS,
    compare,
    compare_url,
    loss_url,
    run_pilot,
    runs_url,
)
from qwentitan.launch.launcher.pilot.__main__ import main as pilot_main
from qwentitan.launch.launcher.pilot.compare import VALIDATION
from qwentitan.launch.launcher.pilot.mesh import MESH
from qwentitan.launch.launcher.pilot.plot import plot_losses
from qwentitan.launch.launcher.pilot.run import pilot_request
from qwentitan.launch.launcher.plan import load_config
from qwentitan.launch.launcher.supervisor import SignalForwarder
from qwentitan.launch.tracking.store import EXPERIMENT_KIND_TAG, MODEL_TRAINING, MlflowTarget
from qwentitan.modeling import initial_checkpoint

DENSE = PAIRS["dense"]


def _curves(right_offsets: dict[int, float], steps: int = 5) -> dict[str, dict[int, float]]:
    left = {s: 10.0 - s for s in range(1, steps + 1)}
    return {"hf": left, "native": {s: v + right_offsets.get(s, 0.0) for s, v in left.items()}}


def test_a_pair_within_its_limit_passes_and_says_its_worst_step():
    result = compare(DENSE, _curves({2: 4e-5, 4: 9e-5}), steps=5)
    assert result.passed and result.first_over is None
    assert result.max_diff == pytest.approx(9e-5)
    assert result.verdict() == (
        "dense pair (hf vs native): passed, max |loss difference| 9.00e-05 at step 4 over 5 "
        "steps (limit 1e-04)"
    )


def test_a_pair_fails_at_the_first_step_over_its_limit():
    result = compare(DENSE, _curves({2: 2e-4, 3: 5e-3}), steps=5)
    assert not result.passed and result.first_over == 2
    assert result.verdict().startswith(
        "dense pair (hf vs native): FAILED, |loss difference| 2.00e-04 at step 2 exceeds the "
        "limit 1e-04 (max |loss difference| 5.00e-03 at step 3)"
    )
    nan = compare(DENSE, _curves({4: math.nan}), steps=5)  # a NaN is never within a limit
    assert nan.first_over == 4 and not nan.passed


def test_a_step_one_child_did_not_log_fails_the_pair():
    curves = _curves({})
    del curves["native"][3]
    result = compare(DENSE, curves, steps=5)
    assert not result.passed and result.missing == {"hf": [], "native": [3]}
    assert "native logged no loss for step(s) 3" in result.verdict()
    nothing = compare(DENSE, {"hf": curves["hf"]}, steps=5)  # native never trained
    assert nothing.missing["native"] == [1, 2, 3, 4, 5] and not nothing.passed


def test_validation_is_judged_at_the_steps_either_child_validated():
    tp2 = MESH["tiny_dense.tp2"]
    base, other = tp2.children
    validated = {base: {1: 11.9, 10: 9.0, 20: 8.0}, other: {1: 11.9, 10: 9.0 + 3e-4, 20: 8.0}}
    result = compare(tp2, validated, steps=20, metric=VALIDATION)
    assert sorted(result.diffs) == [1, 10, 20] and result.first_over == 10 and not result.passed
    assert result.key == "layout/tiny_dense.tp2/validation"
    assert result.verdict().startswith(
        "tiny_dense.tp2 layout (tiny_dense.1-rank vs tiny_dense.tp2) validation loss: FAILED, "
        "|validation loss difference| 3.00e-04 at step 10 exceeds the limit 1e-04"
    )
    del validated[other][20]  # a child that stopped validating: a step it did not log
    missing = compare(tp2, validated, steps=20, metric=VALIDATION)
    assert missing.missing == {base: [], other: [20]} and not missing.passed
    assert "tiny_dense.tp2 logged no validation loss for step(s) 20" in missing.verdict()
    # neither child validated (validation off): nothing to judge, not a pass
    assert compare(tp2, {base: {}, other: {}}, steps=20, metric=VALIDATION) is None
    assert compare(tp2, validated, steps=5, metric=VALIDATION).diffs == {1: 0.0}


def test_the_compare_url_is_the_uis_compare_runs_route():
    url = compare_url("sqlite:///mlflow.db", "7", ["a1", "b2"])
    assert url.startswith("http://127.0.0.1:5000/#/compare-runs?")
    query = urllib.parse.parse_qs(url.split("?", 1)[1])
    assert json.loads(query["runs"][0]) == ["a1", "b2"]
    assert json.loads(query["experiments"][0]) == ["7"]
    assert query["workflowType"] == ["machine_learning"]  # else 3.17 opens its GenAI pages
    served = compare_url("http://mlflow.example:8080/", "7", ["a1"])
    assert served.startswith("http://mlflow.example:8080/#/compare-runs?")
    loss = urllib.parse.urlsplit(loss_url("sqlite:///mlflow.db", "7", ["a1", "b2"]))
    assert loss.fragment.startswith("/metric/loss?")
    query = urllib.parse.parse_qs(loss.fragment.split("?", 1)[1])
    assert json.loads(query["runs"][0]) == ["a1", "b2"] and query["x_axis"] == ["step"]
    assert json.loads(query["plot_metric_keys"][0]) == ["loss"]
    assert runs_url("sqlite:///mlflow.db", "7") == (
        "http://127.0.0.1:5000/#/experiments/7/runs?workflowType=machine_learning"
        "&compareRunsMode=CHART"
    )


def test_the_picture_is_a_png_written_whole(tmp_path):
    curves = _curves({3: 2e-6})
    validated = {
        child: {1: c[1], 5: c[5] + 1e-5 * (child == "native")} for child, c in curves.items()
    }
    # step 1 differs by exactly 0; the validation difference is drawn dotted
    results = [compare(DENSE, curves, steps=5), compare(DENSE, validated, 5, VALIDATION)]
    file = plot_losses(curves, results, tmp_path / "losses.png")
    assert file.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert [p.name for p in tmp_path.iterdir()] == ["losses.png"]


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"pairs": ["dense", "sparse"]}, "Unknown pair in \\['dense', 'sparse'\\]; choose among"),
        ({"perturb": "moe-kernels", "pairs": ["dense"]}, "--perturb 'moe-kernels' is none of"),
    ],
)
def test_the_pilot_refuses_bad_choices_before_anything_trains(tmp_path, kwargs, message):
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    with pytest.raises(LaunchError, match=message):
        request = pilot_request(steps=1, ranks_per_node=1, run_dir=str(tmp_path / "pilot"))
        run_pilot(request, tracking_uri=uri, **kwargs)
    assert not (tmp_path / "pilot").exists() and not (tmp_path / "mlflow.db").exists()


def test_experiments_are_marked_model_training_unless_they_say_otherwise(
    tmp_path, new_mlflow_store
):
    target = MlflowTarget(new_mlflow_store(tmp_path))
    client: MlflowClient = target.client
    fresh = client.get_experiment(target._experiment_id("fresh"))
    assert fresh.tags[EXPERIMENT_KIND_TAG] == MODEL_TRAINING == "custom_model_development"
    untagged = client.create_experiment("made-by-hand")
    target._experiment_id("made-by-hand")
    assert client.get_experiment(untagged).tags[EXPERIMENT_KIND_TAG] == MODEL_TRAINING
    genai = client.create_experiment("agents", tags={EXPERIMENT_KIND_TAG: "genai_development"})
    target._experiment_id("agents")
    assert client.get_experiment(genai).tags[EXPERIMENT_KIND_TAG] == "genai_development"


@pytest.mark.parametrize(
    ("overrides", "said"),
    [
        (["--optimizer.lr", "1e-3"], "Unrecognized options: --optimizer.lr, 1e-3; perhaps you "
         "meant --optimizer.param-groups.0.optimizer-kwargs.lr"),
        (["--checkpoint.initial_load_in_hf"], ": initial_load_in_hf requires "
         "initial_load_model_only."),
        (["--training.dtype", "float8"], ": --training.dtype takes one of bfloat16, float32, not "
         "'float8'"),
        (["--training.steps"], ": --training.steps needs a value"),
    ],
)  # fmt: skip
def test_torchtitans_refusal_is_one_sentence_of_ours(capsys, overrides, said):
    with pytest.raises(LaunchError) as refused:
        load_config("tiny_dense", overrides)
    assert str(refused.value).endswith(said)
    assert capsys.readouterr() == ("", "")  # tyro's own box never reaches the terminal


def _saving_child(saved, started):
    """A stand-in for the child `train`: the first SIGINT saves (1 s) and stops; counts them."""
    return (
        "import signal, sys, time\n"
        "got = []\n"
        "def stop(*_):\n"
        "    got.append(1)\n"
        "    if len(got) == 1:\n"
        "        time.sleep(1.0)  # a checkpoint being written\n"
        f"        open({str(saved)!r}, 'a').write(f'saved after {{len(got)}} signal(s)')\n"
        "        sys.exit(130)\n"
        "signal.signal(signal.SIGINT, stop)\n"
        f"open({str(started)!r}, 'a').write('started\\n')\n"
        "time.sleep(60)\n"
    )


def _ctrl_c_once_started(started, pid):
    def ctrl_c():
        deadline = time.monotonic() + 60
        while not started.exists() and time.monotonic() < deadline:
            time.sleep(0.05)
        time.sleep(0.3)
        os.kill(pid, signal.SIGINT)  # the pilot's pid only, or a terminal's Ctrl-C to its group

    threading.Thread(target=ctrl_c, daemon=True).start()


@pytest.fixture
def sigint_ignored():
    """As in a background job or under nox: the pilot must install its own handling."""
    previous = signal.signal(signal.SIGINT, signal.SIG_IGN)
    yield
    signal.signal(signal.SIGINT, previous)


def test_ctrl_c_to_the_pilot_lets_the_child_save_once_then_stops(tmp_path, sigint_ignored):
    saved, started = tmp_path / "saved", tmp_path / "started"
    _ctrl_c_once_started(started, os.getpid())
    # an interrupting forwarder: the signal to its child itself, once, then a stop
    forwarder = SignalForwarder(lambda child: [child], interrupting=True)
    with pytest.raises(KeyboardInterrupt), forwarder:
        forwarder.run([sys.executable, "-c", _saving_child(saved, started)])
    assert saved.read_text() == "saved after 1 signal(s)"  # passed on once, not twice


def test_ctrl_c_stops_the_whole_pilot_and_ends_its_parent_killed(
    tmp_path, monkeypatch, sigint_ignored, new_mlflow_store
):
    from qwentitan.launch.launcher.pilot import run as pilot_run

    saved, started = tmp_path / "saved", tmp_path / "started"
    real_popen = subprocess.Popen

    def fake_agent(command, **kwargs):  # every child's torchrun agent: a stand-in of one rank
        rank = [sys.executable, "-c", _saving_child(saved, started)]
        agent = f"import subprocess, sys; sys.exit(subprocess.call({rank!r}))"
        return real_popen([sys.executable, "-c", agent], **kwargs)

    monkeypatch.setattr(pilot_run, "_start_checkpoint", lambda folder, *_: folder)
    monkeypatch.setattr(subprocess, "Popen", fake_agent)
    _ctrl_c_once_started(started, os.getpid())
    uri = new_mlflow_store(tmp_path)
    with pytest.raises(KeyboardInterrupt):
        request = pilot_request(steps=2, ranks_per_node=1, run_dir=str(tmp_path / "pilot"))
        run_pilot(request, uri, experiment="ctrl-c", pairs=["dense"])
    assert started.read_text() == "started\n"  # no later child started
    assert saved.read_text() == "saved after 1 signal(s)"
    client = MlflowClient(uri)
    (parent,) = client.search_runs([client.get_experiment_by_name("ctrl-c").experiment_id])
    assert parent.info.status == "KILLED"


def test_a_perturbed_paths_child_starts_from_a_copy_with_one_weight_scaled(tmp_path):
    """`--perturb CHILD` of the paths pilot: that child starts from a copy of its pair's seeded
    checkpoint with PERTURBED_WEIGHT scaled (every logit then scales with it, so the pair fails
    at its first step); its partner, and the seeded checkpoint itself, keep the weights."""
    from safetensors.torch import load_file

    from qwentitan.launch.launcher.pilot import run as pilot_run

    def start(perturbed: bool) -> Path:
        overrides, said = pilot_run._start(tmp_path, "tiny-dense", 0, perturbed=perturbed)
        folder = Path(overrides[overrides.index("--checkpoint.initial_load_path") + 1])
        assert said == str(folder)
        return folder

    seeded, perturbed = start(False), start(True)
    assert perturbed == seeded.with_name(f"{seeded.name}-perturbed")
    assert sorted(p.name for p in perturbed.iterdir()) == sorted(p.name for p in seeded.iterdir())
    weights = {}
    for folder in (seeded, perturbed):
        for file in folder.glob("*.safetensors"):
            weights.setdefault(folder, {}).update(load_file(file))
    original, scaled = weights[seeded], weights[perturbed]
    name = pilot_run.PERTURBED_WEIGHT
    assert original.keys() == scaled.keys() and name in original
    assert torch.equal(scaled[name], original[name] * pilot_run.PERTURB_SCALE)
    assert not torch.equal(scaled[name], original[name])
    assert all(torch.equal(scaled[k], original[k]) for k in original if k != name)
    assert start(False) == seeded and start(True) == perturbed  # kept, not written again


def test_a_child_plan_that_cannot_run_is_refused_before_anything_is_written(tmp_path, capsys):
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    argv = ["--ranks", "9999", "--run-dir", str(tmp_path / "p"), "--tracking-uri", uri]
    assert pilot_main(argv) == 2
    err = capsys.readouterr().err
    # the children's plans are resolved first: 9999 CPU ranks leave each too little memory
    assert err.startswith("qwentitan-launch pilot: Recipe 'tiny_hf' needs about")
    # as many ranks as the host's memory holds, each with its process (launcher/memory.py)
    assert re.search(r"; pass --ranks \d+ or fewer\.\n$", err) and err.count("\n") == 1
    assert os.listdir(tmp_path) == []


def test_the_pilot_hands_each_child_its_layout(tmp_path):
    from qwentitan.launch.launcher.plan import resolve_plan

    request = pilot_request(
        tp=2, ac="selective", run_dir=str(tmp_path), overrides=("--debug.seed", "1")
    )
    plan = resolve_plan(request.replace(recipe="tiny_moe"))
    assert (plan.recipe, plan.ranks_per_node, plan.dims.tp, plan.steps) == ("tiny_moe", 2, 2, 20)
    assert plan.activation_checkpoint == "selective" and plan.run_folder == tmp_path
    assert plan.config.debug.seed == 1


def test_a_safetensors_write_on_a_full_disk_is_one_sentence(
    tmp_path, monkeypatch, capsys, new_mlflow_store
):
    from safetensors import SafetensorError

    def disk_full(flavor, folder, *, seed=0):
        raise SafetensorError(
            'Error while serializing: IoError(Os { code: 28, kind: StorageFull, message: "No '
            'space left on device" })'
        )

    monkeypatch.setattr(initial_checkpoint, "write_initial_checkpoint", disk_full)
    uri = new_mlflow_store(tmp_path)
    argv = ["--run-dir", str(tmp_path / "pilot"), "--tracking-uri", uri, "--pair", "dense"]
    assert pilot_main(argv) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "Traceback" not in err
    assert err.startswith(
        "qwentitan-launch pilot: Could not write the seeded checkpoint "
        f"{tmp_path / 'pilot' / 'start' / 'tiny-dense'}"
        " (no space left on the disk); free some space"
    )


def test_a_full_disk_is_one_sentence_exit_2_and_the_parent_run_is_ended(
    tmp_path, monkeypatch, capsys, new_mlflow_store
):
    def disk_full(flavor, folder, *, seed=0):
        raise OSError(28, "No space left on device", str(folder))

    monkeypatch.setattr(initial_checkpoint, "write_initial_checkpoint", disk_full)
    uri = new_mlflow_store(tmp_path)
    argv = ["--run-dir", str(tmp_path / "pilot"), "--tracking-uri", uri, "--pair", "dense"]
    assert pilot_main(argv) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "Traceback" not in err
    assert err.startswith(f"pilot: could not write ({tmp_path / 'pilot' / 'start' / 'tiny-dense'})")
    assert "No space left on device; free some space or pass --run-dir on another disk." in err
    (parent,) = MlflowClient(uri).search_runs(
        [MlflowClient(uri).get_experiment_by_name("qwentitan-pilot").experiment_id]
    )
    assert parent.info.status == "FAILED"  # not left RUNNING
    not_a_folder = tmp_path / "file"
    not_a_folder.write_text("")
    assert pilot_main(["--run-dir", str(not_a_folder / "pilot"), "--tracking-uri", uri]) == 2
    assert capsys.readouterr().err.startswith("pilot: could not write")


def test_without_a_run_dir_the_pilot_writes_a_new_folder_that_latest_names(
    tmp_path, monkeypatch, capsys, new_mlflow_store
):
    """Issue 56: as `train`'s outputs/RECIPE/latest (the children's start stood in by a full
    disk: what the pilot wrote before it is what matters here)."""

    def disk_full(flavor, folder, *, seed=0):
        raise OSError(28, "No space left on device", str(folder))

    monkeypatch.setattr(initial_checkpoint, "write_initial_checkpoint", disk_full)
    uri = new_mlflow_store(tmp_path)
    monkeypatch.chdir(tmp_path)
    latest = tmp_path / "outputs" / "pilot" / "latest"
    for _ in range(2):
        assert pilot_main(["--tracking-uri", uri, "--pair", "dense"]) == 2
        assert latest.is_symlink() and latest.resolve().parent == latest.parent
        assert f"pilot: could not write ({latest.resolve()}/start" in capsys.readouterr().err
    assert len(list((tmp_path / "outputs" / "pilot").iterdir())) == 3  # two runs and latest


def test_a_layout_over_its_limit_is_one_sentence_naming_layout_step_and_difference():
    tp2 = MESH["tiny_dense.tp2"]
    curves = _curves({2: 2e-4, 3: 5e-3})
    curves = {tp2.children[0]: curves["hf"], tp2.children[1]: curves["native"]}
    verdict = compare(tp2, curves, steps=5).verdict()
    assert verdict.startswith(
        "tiny_dense.tp2 layout (tiny_dense.1-rank vs tiny_dense.tp2): FAILED, |loss difference| "
        "2.00e-04 at step 2 exceeds the limit 1e-04"
    )
    assert "\n" not in verdict


def test_the_mesh_pilot_trains_each_child_once_and_perturbs_only_the_one_named(
    tmp_path, monkeypatch, new_mlflow_store
):
    from qwentitan.launch.launcher.pilot import run as pilot_run

    started, planned = [], {}
    real_popen, real_plan = subprocess.Popen, pilot_run.resolve_plan

    def plan(request):  # every child's plan, resolved before anything trains
        planned[Path(request.run_dir).name] = real_plan(request)
        return planned[Path(request.run_dir).name]

    def fake_agent(command, **kwargs):  # each child's torchrun agent fails at once
        if "qwentitan.launch.launcher.agent" not in command:
            return real_popen(command, **kwargs)
        assert kwargs["env"]["QWENTITAN_TEST_TOKEN"] == "s3cr3t"  # the ranks inherit the shell
        started.append(command)  # the torchrun line
        return real_popen([sys.executable, "-c", "raise SystemExit(1)"], **kwargs)

    monkeypatch.setattr(subprocess, "Popen", fake_agent)
    monkeypatch.setattr(pilot_run, "resolve_plan", plan)
    monkeypatch.setenv("QWENTITAN_TEST_TOKEN", "s3cr3t")
    uri = new_mlflow_store(tmp_path)
    request = pilot_request(steps=3, run_dir=str(tmp_path / "pilot"))
    pilot = run_pilot(request, uri, pairs=tuple(MESH), perturb="tiny_dense.tp2")
    wanted = {  # (FSDP, DP-replicate, TP, PP, EP), as torchtitan's ParallelDims holds them
        "1-rank": (1, 1, 1, 1, 1),
        "fsdp2": (2, 1, 1, 1, 1),
        "tp2": (1, 1, 2, 1, 1),
        "fsdp2-tp2": (2, 1, 2, 1, 1),
        "hsdp2x2": (2, 2, 1, 1, 1),
        "pp2": (1, 1, 1, 2, 1),
        "ep2": (2, 1, 1, 1, 2),
        "fsdp4-ep2": (4, 1, 1, 1, 2),
    }
    dims = {c: (p.dims.dp_shard, p.dims.dp_replicate, p.dims.tp, p.dims.pp, p.dims.ep)
            for c, p in planned.items()}  # fmt: skip
    assert dims == {c: wanted[c.split(".")[1]] for c in planned}
    assert {p.global_batch for p in planned.values()} == {8}  # on this host's 2 cores too
    argv = {command[command.index("--metrics.mlflow.run_name") + 1]: command for command in started}
    assert len(argv) == len(started) == 14  # tiny_dense.1-rank is the baseline of four pairs
    assert {name: a[a.index("--debug.seed") + 1] for name, a in argv.items()} == {
        name: "1" if name == "tiny_dense.tp2" else "0" for name in argv
    }
    fsdp_tp = argv["tiny_dense.fsdp2-tp2"]
    assert "--nproc-per-node=4" in fsdp_tp
    assert fsdp_tp[fsdp_tp.index("--config") : fsdp_tp.index("--debug.seed")] == [
        "--config", "tiny_dense", "--target", "cpu", "--training.local-batch-size", "2",
        "--training.global-batch-size", "8", "--training.steps", "3",
        "--parallelism.data-parallel-shard-degree", "2", "--parallelism.tensor-parallel-degree",
        "2", "--dump-folder", str(tmp_path / "pilot" / "tiny_dense.fsdp2-tp2"),
    ]  # fmt: skip
    assert not list((tmp_path / "pilot").glob(".*.prepared.json"))  # removed after each child
    assert not any("--checkpoint.initial_load_path" in a for a in argv.values())
    assert sorted(pilot.failed) == sorted(argv) and not pilot.passed
    parent = MlflowClient(uri).get_run(pilot.parent_run_id)
    assert parent.info.run_name.startswith("mesh-pilot-") and parent.info.status == "FAILED"
    assert parent.data.tags["pilot.perturbed"] == "tiny_dense.tp2"


def test_the_mesh_pilot_refuses_a_layout_flag_of_its_own(tmp_path, capsys):
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    argv = ["--mesh", "--tp", "2", "--run-dir", str(tmp_path / "p"), "--tracking-uri", uri]
    assert pilot_main(argv) == 2
    assert capsys.readouterr().err == (
        "qwentitan-launch pilot: The mesh pilot places every child on its own layout; drop --tp.\n"
    )
    assert os.listdir(tmp_path) == []


def test_one_ctrl_c_relayed_three_times_is_one_request():
    """A terminal signals the whole process group and `uv run` and nox relay it again within a
    fraction of a second: that is one Ctrl-C. A second one a second later is a second request
    (which the ranks take as "stop at once")."""
    from qwentitan.launch.launcher import supervisor

    clock = iter([100.0, 100.2, 100.4, 101.5])
    forwarder = supervisor.SignalForwarder(clock=lambda: next(clock))
    for _ in range(3):
        forwarder._on_signal(signal.SIGINT, None)
    assert forwarder.received == [signal.SIGINT]
    forwarder._on_signal(signal.SIGINT, None)
    assert forwarder.received == [signal.SIGINT, signal.SIGINT]
