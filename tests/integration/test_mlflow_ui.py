"""MLflow tracking end to end: real training ranks, a real `mlflow ui` server on loopback, and
the pilot's runs and compare pages opened in headless Chromium (screenshots kept in
outputs/test-artifacts/).

The browser part needs Debian's `chromium` (.ci/run installs it); without it only that part is
skipped, after every training and tracking assertion has run.
"""

from __future__ import annotations

import json
import math
import os
import re
import shutil
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest
from mlflow import MlflowClient

from qwentitan.launch.launcher.cli import main as launch_main
from qwentitan.launch.launcher.pilot import pilot_request, run_pilot, runs_url
from qwentitan.launch.tracking.spool import SPOOL_FOLDER, read_spool

# One worker for the files that share the `trained_tiny` training (tests/conftest.py: SAME_WORKER).
pytestmark = pytest.mark.slow
REPO = Path(__file__).resolve().parents[2]
ARTIFACTS = REPO / "outputs" / "test-artifacts"
CHROMIUM_FLAGS = [
    "--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
    "--disable-background-networking", "--disable-component-update", "--disable-sync",
    "--window-size=1600,1000", "--virtual-time-budget=30000",
]  # fmt: skip


@pytest.fixture(scope="module")
def mlflow_ui(tmp_path_factory, free_port):
    """`mlflow ui` serving a fresh sqlite store on 127.0.0.1; yields its URL. One worker process
    (MLflow starts 4 by default, each importing its server: 13 CPU-s more for one browser)."""
    root = tmp_path_factory.mktemp("ui")
    port = free_port()
    log = (root / "server.log").open("w")
    process = subprocess.Popen(
        [sys.executable, "-m", "mlflow", "ui", "--host", "127.0.0.1", "--port", str(port),
         "--backend-store-uri", f"sqlite:///{root / 'mlflow.db'}",
         "--artifacts-destination", str(root / "artifacts"), "--workers", "1"],
        cwd=root, stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
        env={**os.environ, "MLFLOW_SERVER_ENABLE_JOB_EXECUTION": "false"},
    )  # fmt: skip
    uri = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 300  # a loaded 2-core machine takes minutes to start it
    while True:
        try:
            with urllib.request.urlopen(f"{uri}/health", timeout=2) as answer:
                if answer.status == 200:
                    break
        except OSError:
            pass
        if process.poll() is not None or time.monotonic() > deadline:
            os.killpg(process.pid, signal.SIGKILL)
            pytest.fail(f"mlflow ui did not start:\n{(root / 'server.log').read_text()[-3000:]}")
        time.sleep(1)
    yield uri
    os.killpg(process.pid, signal.SIGTERM)
    try:
        process.wait(timeout=30)
    except subprocess.TimeoutExpired:
        os.killpg(process.pid, signal.SIGKILL)


def test_two_cpu_ranks_against_an_unreachable_server_then_sync(
    trained_tiny, tmp_path, mlflow_ui, capsys
):
    """The shared run trained with MLflow pointed at a closed port: all went to the spool."""
    run_dir, steps = trained_tiny.run_dir, trained_tiny.steps
    (spool,) = (run_dir / SPOOL_FOLDER).glob("*.jsonl")  # one run, from the metrics rank only
    records = read_spool(spool)
    spooled = {(k, r["step"]) for r in records if r["kind"] == "metrics" for k in r["values"]}
    assert {step for key, step in spooled if key == "loss"} == set(range(1, steps + 1))

    for _ in range(2):  # the second replay must add nothing
        assert launch_main(["sync-mlflow", str(run_dir), "--tracking-uri", mlflow_ui]) == 0
    reports = [line for line in capsys.readouterr().out.splitlines() if line.startswith("run ")]
    assert f"{len(spooled)} metric points added" in reports[0]
    assert "0 metric points added" in reports[1]

    client = MlflowClient(mlflow_ui)
    (run,) = client.search_runs(
        [client.get_experiment_by_name(trained_tiny.experiment).experiment_id]
    )
    assert run.info.status == "FINISHED"
    seen: dict[tuple[str, int], int] = {}
    for key in {key for key, _ in spooled}:
        for point in client.get_metric_history(run.info.run_id, key):
            seen[(key, point.step)] = seen.get((key, point.step), 0) + 1
    assert seen == dict.fromkeys(spooled, 1)
    for key in ("loss", "grad_norm", "tokens_per_second", "step_time_s", "memory/rss_gib"):
        assert {step for k, step in seen if k == key} == set(range(1, steps + 1)), key
    assert "mfu_percent" not in run.data.metrics  # CPU: no peak FLOPs, so no MFU
    assert run.data.params["training.steps"] == str(steps)
    tags = run.data.tags
    expected = {"recipe": "tiny_dense", "path": "native", "flavor": "tiny-dense",
                "platform": "cpu", "world_size": "2", "parallel.dp_shard": "2", "lnc": "n/a"}  # fmt: skip
    assert {k: tags.get(k) for k in expected} == expected
    for key in ("instance_type", "git_commit", "version.torch", "version.torch-neuronx",
                "version.transformers", "version.torchtitan", "version.qwentitan-modeling"):  # fmt: skip
        assert tags.get(key), key
    config = client.download_artifacts(run.info.run_id, "config", str(tmp_path / "dl"))
    resolved = json.loads((Path(config) / "resolved_config.json").read_text())
    assert resolved["training"]["steps"] == steps


# Small enough for CI (the pilot's own default is 20 steps of 4 x 128 tokens per rank). Two
# ranks: a gradient scaled by the world size on one path (the hf path's old FSDP division)
# shows only with more than one.
PILOT = {"steps": 8, "ranks_per_node": 2, "seq_len": 64, "local_batch_size": 2}
CHILDREN = {"hf", "native"}


def test_the_dense_paths_agree_and_the_ui_opens_on_them(tmp_path, mlflow_ui):
    """The paths pilot's dense pair: hf and native train one curve from one seeded checkpoint.
    The hf child is also the test of the hf path (the Transformers v5 model) in torchtitan's
    Trainer on two FSDP ranks, through `train`. (That the kernel MoE path agrees with the native
    one, and that a perturbed child fails its pair, is the mesh pilot's in
    tests/launch/test_every_mesh.py; the paths pilot's perturbed checkpoint is checked in
    tests/launch/test_pilot.py.)"""
    request = pilot_request(**PILOT, run_dir=str(tmp_path / "pilot"))
    pilot = run_pilot(request, tracking_uri=mlflow_ui, pairs=("dense",))
    # Every path trains and logs, before anything here may skip for want of a browser.
    assert pilot.failed == [], pilot.failed
    assert set(pilot.children) == CHILDREN
    dense, validated = pilot.pairs  # the training loss, and the validation loss beside it
    assert set(dense.diffs) == set(range(1, PILOT["steps"] + 1))
    assert dense.passed and dense.max_diff <= dense.pair.limit, dense.verdict()
    assert validated.metric == "validation/loss" and set(validated.diffs) == {1}  # freq 10
    assert validated.passed, validated.verdict()
    assert pilot.passed
    client = MlflowClient(mlflow_ui)
    hf = client.get_run(pilot.children["hf"])
    assert hf.data.tags["parallel.dp_shard"] == "2"
    losses = {m.step: m.value for m in client.get_metric_history(hf.info.run_id, "loss")}
    # its start is a fresh initialisation (the seeded checkpoint): near ln(vocabulary), then down
    assert losses[1] == pytest.approx(math.log(151936), abs=0.1)
    assert losses[PILOT["steps"]] < losses[PILOT["steps"] // 2] < losses[1]
    assert (Path(request.run_dir) / "hf" / "checkpoint" / f"step-{PILOT['steps']}").is_dir()
    names = [set(client.get_run(run_id).data.metrics) for run_id in pilot.children.values()]
    assert all(n == names[0] for n in names), "the paths must log identical metric names"
    parent = client.get_run(pilot.parent_run_id)
    assert parent.info.status == "FINISHED" and parent.data.tags["pilot.result"] == "passed"
    assert parent.data.tags["pilot.perturbed"] == "none"
    history = client.get_metric_history(parent.info.run_id, "pair/dense/abs_loss_diff")
    assert sorted(m.step for m in history) == list(range(1, PILOT["steps"] + 1))
    assert parent.data.metrics["pair/dense/max_abs_loss_diff"] == max(m.value for m in history)
    assert parent.data.tags["pair/dense/validation/result"] == "passed"
    assert [a.path for a in client.list_artifacts(parent.info.run_id, "plots")] == [
        "plots/pilot_losses.png"
    ]
    experiment = client.get_experiment(parent.info.experiment_id)
    assert experiment.tags["mlflow.experimentKind"] == "custom_model_development"

    chromium = shutil.which("chromium")
    if chromium is None:
        pytest.skip("Debian's chromium is not installed (.ci/run installs it): UI not opened")
    flags = [chromium, *CHROMIUM_FLAGS]

    def rendered_text(url: str, name: str) -> set[str]:
        """The page's text once rendered, and its screenshot kept as ARTIFACTS/`name`, from one
        Chromium run."""
        file = ARTIFACTS / name
        dom = subprocess.run(
            [*flags, f"--user-data-dir={tmp_path / name}", f"--screenshot={file}", "--dump-dom",
             url],
            capture_output=True, text=True, timeout=180,
        )  # fmt: skip
        assert dom.returncode == 0 and file.read_bytes()[:4] == b"\x89PNG", dom.stderr[-2000:]
        html = re.sub(r"<script.*?</script>|<style.*?</style>", "", dom.stdout, flags=re.S)
        return {cell.strip() for cell in re.findall(r">([^<>]+)<", html)}

    ARTIFACTS.mkdir(parents=True, exist_ok=True)
    runs = runs_url(mlflow_ui, parent.info.experiment_id)
    seen = rendered_text(runs, "mlflow_ui_pilot_runs.png")
    # The runs table (its parent row, the pair charts' sections), not the traces overview.
    assert {parent.info.run_name, "pair/dense"} <= seen, f"no runs view at {runs}"
    assert not {"Traces", "Latency"} <= seen
    seen = rendered_text(pilot.compare_url, "mlflow_ui_pilot_compare.png")
    assert seen >= CHILDREN, f"the children are not side by side at {pilot.compare_url}"
    seen = rendered_text(pilot.loss_url, "mlflow_ui_pilot_loss.png")  # legend and table name them
    assert seen >= {*CHILDREN, "loss"}, f"no loss curves at {pilot.loss_url}"
