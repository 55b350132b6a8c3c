"""One MLflow run per run folder: every start in it (a --resume, a requeue, a spot restart)
continues the same run, and no run whose start ended is left RUNNING."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import time
from pathlib import Path

import pytest
from mlflow import MlflowClient

from qwentitan.launch.tracking import MLflowLogger, end_abandoned_runs
from qwentitan.launch.tracking.spool import SPOOL_FOLDER, find_spools, load_spool
from qwentitan.launch.tracking.store import RUN_KEY_TAG, MlflowTarget, replay


@pytest.fixture
def uri(tmp_path, new_mlflow_store, monkeypatch):
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)  # the spool's store, not the shell's
    return new_mlflow_store(tmp_path)


def start(run_dir: Path, uri: str) -> MLflowLogger:
    return MLflowLogger.Config(tracking_uri=uri, recipe="tiny_dense", path="native").build(
        run_dir=run_dir, config_dict={"training": {"steps": 8}}, world_size=1
    )


def train(logger: MLflowLogger, steps: range) -> None:
    for step in steps:
        logger.log({"loss_metrics/global_avg_loss": 10.0 / step, "grad_norm": 1.0}, step)


def runs(uri: str):
    client = MlflowClient(uri)
    experiment = client.get_experiment_by_name("qwentitan-tiny")
    return client, client.search_runs([experiment.experiment_id]) if experiment else []


def wait_for(condition, timeout_s: float = 60.0):
    deadline = time.monotonic() + timeout_s
    while not (value := condition()) and time.monotonic() < deadline:
        time.sleep(0.2)
    return value


def test_a_resumed_start_continues_the_folders_run_as_one_curve(tmp_path, uri):
    run_dir = tmp_path / "run"
    first = start(run_dir, uri)
    train(first, range(1, 5))
    first.set_tags({"stop.cause": "stop_after", "stop.reason": "--stop-after 4"})
    first.close()  # stopped with a checkpoint
    client, (run,) = runs(uri)
    assert run.info.status == "KILLED"

    second = start(run_dir, uri)  # --resume: a new process, the same folder
    assert second.run_key == first.run_key
    train(second, range(5, 9))
    # While it trains, the run is RUNNING again (MLflow takes metrics into an ended run).
    assert wait_for(lambda: client.get_run(run.info.run_id).info.status == "RUNNING")
    second.close()

    client, (run,) = runs(uri)  # still one run
    assert second.writer.run_id == first.writer.run_id == run.info.run_id
    assert run.info.status == "FINISHED"
    assert run.data.tags[RUN_KEY_TAG] == first.run_key
    history = client.get_metric_history(run.info.run_id, "loss")
    assert sorted(m.step for m in history) == list(range(1, 9))
    assert len(find_spools(run_dir)) == 2  # one spool per start, both of the folder's key
    assert {load_spool(s).records[0]["run_key"] for s in find_spools(run_dir)} == {first.run_key}


def test_a_start_that_fails_ends_its_run_failed(tmp_path, uri):
    logger = start(tmp_path / "run", uri)
    train(logger, range(1, 3))
    try:
        raise RuntimeError("a rank failed")
    except RuntimeError:
        logger.close()  # as torchtitan's train() closes the trainer before re-raising
    _, (run,) = runs(uri)
    assert run.info.status == "FAILED"
    with pytest.raises(ValueError, match="FINISHED"):
        start(tmp_path / "other", uri).close(status="DONE")


def test_a_folder_logged_before_its_key_file_keeps_its_first_spools_key(tmp_path, uri):
    first = start(tmp_path / "run", uri)
    first.close()
    (tmp_path / "run" / SPOOL_FOLDER / "run_key").unlink()  # as a folder written before
    assert start(tmp_path / "run", uri).run_key == first.run_key


def dead_pid() -> int:
    probe = subprocess.Popen(["true"])
    probe.wait()
    return probe.pid


def killed_spool(run_dir: Path, uri: str, *, stopped: bool) -> Path:
    """The spool a start killed with SIGKILL leaves: a run record naming a gone process, steps
    1-3, no `end`; its MLflow run was created and left RUNNING by the live writer."""
    path = run_dir / SPOOL_FOLDER / "20260101-000000-0123abcd.jsonl"
    path.parent.mkdir(parents=True)
    header = {"kind": "run", "seq": 0, "run_key": "f" * 32, "experiment": "qwentitan-tiny",
              "run_name": "tiny_dense-killed", "tracking_uri": uri, "start_ms": 1_700_000_000_000,
              "host": socket.gethostname(), "pid": dead_pid()}  # fmt: skip
    records = [header]
    for step in (1, 2, 3):
        records.append({"kind": "metrics", "seq": step, "step": step,
                        "time_ms": 1_700_000_000_000 + step, "values": {"loss": 1 / step}})  # fmt: skip
    if stopped:
        records.append({"kind": "tags", "seq": 4, "tags": {"stop.cause": "signal"}})
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    replay(MlflowTarget(uri), records[:3], run_dir)  # what the writer sent before the kill
    return path


@pytest.mark.parametrize(("stopped", "status"), [(False, "FAILED"), (True, "KILLED")])
def test_the_next_start_ends_a_run_its_killed_start_left_running(tmp_path, uri, stopped, status):
    run_dir = tmp_path / "run"
    path = killed_spool(run_dir, uri, stopped=stopped)
    client, (run,) = runs(uri)
    assert run.info.status == "RUNNING"

    lines = end_abandoned_runs(run_dir)
    assert lines == [
        f"an earlier start (tiny_dense-killed) ended without closing its MLflow run: MLflow run "
        f"{run.info.run_id} ended as {status} (1 points sent)"
    ]
    assert client.get_run(run.info.run_id).info.status == status
    assert sorted(m.step for m in client.get_metric_history(run.info.run_id, "loss")) == [1, 2, 3]
    assert load_spool(path).records[-1]["status"] == status  # the spool says so too
    assert end_abandoned_runs(run_dir) == []  # said once
    assert end_abandoned_runs(tmp_path / "never-logged") == []


def test_a_spool_whose_writer_still_runs_is_left_to_it(tmp_path, uri):
    logger = start(tmp_path / "run", uri)
    train(logger, range(1, 3))
    try:
        assert end_abandoned_runs(tmp_path / "run") == []
        assert all(r["kind"] != "end" for r in logger.spool.records())
    finally:
        logger.close()
    assert os.getpid() == load_spool(logger.spool.path).records[0]["pid"]


def test_an_unreachable_store_is_said_in_the_line_and_left_to_sync_mlflow(tmp_path, uri):
    run_dir = tmp_path / "run"
    killed_spool(run_dir, uri, stopped=False)
    (line,) = end_abandoned_runs(run_dir, tracking_uri="http://127.0.0.1:9/")
    assert line.startswith("an earlier start (tiny_dense-killed) ended without closing")
    assert "could not be reached" in line and f"qwentitan-launch sync-mlflow {run_dir}" in line
