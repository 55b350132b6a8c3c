"""MLflow tracking without a trainer: the logger, its spool, the writer thread, sync-mlflow."""

from __future__ import annotations

import json
import logging
import math
import socket
import threading
import time
from pathlib import Path

import pytest
from mlflow import MlflowClient
from mlflow.utils.validation import validate_param_and_metric_name

from qwentitan.launch.base.errors import LaunchError
from qwentitan.launch.base.target import TARGETS
from qwentitan.launch.launcher.cli import main as launch_main
from qwentitan.launch.tracking import (
    MLflowLogger,
    attach_report,
    cost_per_million_tokens,
)
from qwentitan.launch.tracking.spool import load_spool, read_spool
from qwentitan.launch.tracking.summary import flatten_config, hourly_price, metric_name

# The keys torchtitan 0.3.0's MetricsProcessor.log / log_validation and Trainer.train_step emit.
TORCHTITAN_KEYS = [
    "loss_metrics/global_avg_loss",
    "loss_metrics/global_max_loss",
    "grad_norm",
    "throughput(tps)",
    "tflops",
    "time_metrics/end_to_end(s)",
    "time_metrics/data_loading(s)",
    "time_metrics/data_loading(%)",
    "memory/max_active(GiB)",
    "memory/max_active(%)",
    "memory/max_reserved(GiB)",
    "memory/max_reserved(%)",
    "memory/num_alloc_retries",
    "memory/num_ooms",
    "mfu(%)",
    "n_tokens_seen",
    "lr",
    "validation_metrics/loss",
    "validation_metrics/memory/max_reserved(GiB)",
]
STEPS = 6


def step_metrics(step: int) -> dict[str, float]:
    metrics = {key: float(step) for key in TORCHTITAN_KEYS if not key.startswith("validation")}
    metrics["loss_metrics/global_avg_loss"] = 10.0 / step
    metrics["throughput(tps)"] = 1000.0 + step
    metrics["time_metrics/end_to_end(s)"] = 5.0 if step == 1 else 0.5
    metrics["mfu(%)"] = math.nan  # what TrackedMetrics produces on a platform with no peak
    return metrics


def train_with(logger: MLflowLogger, steps: int = STEPS) -> None:
    for step in range(1, steps + 1):
        logger.log(step_metrics(step), step)


def make_logger(run_dir: Path, uri: str, **config) -> MLflowLogger:
    return MLflowLogger.Config(
        tracking_uri=uri, recipe="tiny_dense", path="native", **config
    ).build(
        run_dir=run_dir,
        config_dict={"training": {"steps": STEPS, "seq_len": 64}, "model_spec": {"flavor": "t"}},
        tags={"platform": "cpu", "flavor": "t"},
        world_size=2,
    )


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


@pytest.fixture(scope="module")
def sqlite_uri(tmp_path_factory, new_mlflow_store) -> str:
    return new_mlflow_store(tmp_path_factory.mktemp("store"))


def test_every_torchtitan_metric_gets_a_valid_distinct_mlflow_name():
    names = [metric_name(key) for key in TORCHTITAN_KEYS]
    assert all(validate_param_and_metric_name(name) for name in names), names
    assert len(set(names)) == len(names)
    assert metric_name("loss_metrics/global_avg_loss") == "loss"
    assert metric_name("mfu(%)") == "mfu_percent"


def test_config_is_flattened_into_params():
    flat = flatten_config({"training": {"steps": 3, "lr": {"warmup": 2}}, "empty": {}, "x": None})
    assert flat == {"training.steps": "3", "training.lr.warmup": "2", "empty": "{}", "x": "None"}


class _Init:
    """An object configured by instance, as a recipe may hold one."""


def test_functions_classes_and_objects_are_params_two_runs_can_compare(tmp_path, sqlite_uri):
    import functools

    import torch

    config = {
        "init": torch.nn.init.normal_,
        "cls": torch.nn.Linear,
        "partial": functools.partial(torch.nn.init.trunc_normal_, std=0.02),
        "object": _Init(),
    }
    flat = flatten_config({"model": config})
    assert flat["model.init"] == "torch.nn.init.normal_"
    assert flat["model.cls"] == "torch.nn.modules.linear.Linear"
    assert flat["model.partial"] == "functools.partial(torch.nn.init.trunc_normal_, std=0.02)"
    assert flat["model.object"] == f"<{__name__}._Init object>"
    assert not any(" at 0x" in value for value in flat.values())
    logger = MLflowLogger.Config(tracking_uri=sqlite_uri, recipe="tiny_dense").build(
        run_dir=tmp_path / "run", config_dict={"model": config}
    )
    logger.close()
    written = (logger.spool.path.with_suffix("") / "resolved_config.json").read_text()
    assert json.loads(written)["model"]["init"] == "torch.nn.init.normal_"
    assert " at 0x" not in written
    params = MlflowClient(sqlite_uri).get_run(logger.writer.run_id).data.params
    assert params["model.init"] == "torch.nn.init.normal_"


def test_one_run_with_one_point_per_step_summary_params_tags_and_config(tmp_path, sqlite_uri):
    logger = make_logger(tmp_path / "run", sqlite_uri)
    train_with(logger)
    logger.close()

    client = MlflowClient(sqlite_uri)
    experiment = client.get_experiment_by_name("qwentitan-tiny")
    (run,) = client.search_runs(
        [experiment.experiment_id],
        filter_string=f"tags.recipe = 'tiny_dense' and attributes.run_id = '{logger.writer.run_id}'",
    )
    assert run.info.status == "FINISHED"
    for key in ("loss", "grad_norm", "tokens_per_second", "step_time_s", "memory/max_reserved_gib"):
        history = client.get_metric_history(run.info.run_id, key)
        assert sorted(m.step for m in history) == list(range(1, STEPS + 1)), key
    assert "mfu_percent" not in run.data.metrics  # no peak known: no MFU rather than a wrong one
    metrics = run.data.metrics
    assert metrics["summary/first_loss"] == 10.0
    assert metrics["summary/final_loss"] == pytest.approx(10.0 / STEPS)
    assert metrics["summary/warmup_time_s"] == 5.0
    assert metrics["summary/sustained_step_time_s"] == 0.5
    # median of steps 2..6 of (1000 + step) per device, times 2 ranks
    assert metrics["summary/sustained_tokens_per_second"] == 2 * 1004.0
    assert run.data.params["training.steps"] == str(STEPS)
    tags = run.data.tags
    assert tags["recipe"] == "tiny_dense" and tags["path"] == "native"
    assert tags["platform"] == "cpu" and tags["world_size"] == "2"
    assert tags["version.torchtitan"] == "0.3.0" and tags["version.qwentitan-launch"]
    assert tags["version.torch-neuronx"] == "absent"
    artifacts = [a.path for a in client.list_artifacts(run.info.run_id, "config")]
    assert artifacts == ["config/resolved_config.json"]


def test_cost_per_million_tokens_from_catalogue_config_or_nothing():
    assert hourly_price("trn2.48xlarge")[0] > 0
    assert hourly_price("local") is None
    assert hourly_price("local", configured=72.0) == (72.0, "config")
    assert hourly_price("trn2.48xlarge", configured=72.0) == (72.0, "config")
    for refused in ({"price_per_hour": 0.0}, {"request_timeout_s": 0}, {"close_timeout_s": -1}):
        with pytest.raises(LaunchError, match=r"give a positive number with --metrics\.mlflow\."):
            MLflowLogger.Config(**refused)
    # 36 USD/h at 10,000 tokens/s: 36 / 36e6 tokens * 1e6 = 1 USD per million tokens
    assert cost_per_million_tokens(36.0, 10_000.0) == pytest.approx(1.0)
    assert cost_per_million_tokens(36.0, 10_000.0, instances=2) == pytest.approx(2.0)


def test_priced_run_logs_cost_and_unpriced_run_does_not(tmp_path, sqlite_uri):
    priced = make_logger(tmp_path / "priced", sqlite_uri, price_per_hour=36.0)
    catalogued = make_logger(tmp_path / "trn2", sqlite_uri, instance_type="trn2.48xlarge")
    unpriced = make_logger(tmp_path / "unpriced", sqlite_uri, instance_type="local")
    for logger in (priced, catalogued, unpriced):
        train_with(logger)
        logger.close()
    client = MlflowClient(sqlite_uri)
    cost = client.get_run(priced.writer.run_id).data.metrics["summary/cost_usd_per_million_tokens"]
    assert cost == pytest.approx(36.0 / (2 * 1004.0 * 3600) * 1e6)
    trn2 = client.get_run(catalogued.writer.run_id).data
    assert trn2.tags["instance_type"] == "trn2.48xlarge"
    assert trn2.tags["cost.price_source"].startswith("catalogue ")
    assert trn2.metrics["summary/cost_usd_per_million_tokens"] == pytest.approx(
        TARGETS["trn2.48xlarge"].price_per_hour / (2 * 1004.0 * 3600) * 1e6
    )
    assert (
        "summary/cost_usd_per_million_tokens"
        not in client.get_run(unpriced.writer.run_id).data.metrics
    )


def test_reports_attach_to_a_live_run(tmp_path, sqlite_uri):
    run_dir = tmp_path / "run"
    logger = make_logger(run_dir, sqlite_uri)
    train_with(logger, 2)
    attach_report(run_dir, "preflight", {"ok": True, "checks": ["versions"]})
    logger.close()
    client = MlflowClient(sqlite_uri)
    (report,) = client.list_artifacts(logger.writer.run_id, "reports")
    assert report.path == "reports/preflight.json"
    with pytest.raises(LaunchError, match="plain file name"):
        attach_report(run_dir, "../escape", {})


class HungServer:
    """Accepts connections and never answers: the slowest tracking server there is."""

    def __init__(self) -> None:
        self.socket = socket.create_server(("127.0.0.1", 0))
        self.uri = f"http://127.0.0.1:{self.socket.getsockname()[1]}"
        self.accepted: list[socket.socket] = []
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                self.accepted.append(self.socket.accept()[0])
            except OSError:
                return

    def close(self) -> None:
        for connection in self.accepted:
            connection.close()
        self.socket.close()


def test_a_hung_server_never_holds_up_a_training_step(tmp_path, monkeypatch):
    monkeypatch.setenv("MLFLOW_HTTP_REQUEST_TIMEOUT", "600")  # longer than this test may run
    server = HungServer()
    try:
        logger = make_logger(tmp_path / "run", server.uri, close_timeout_s=1.0)
        deadline = time.monotonic() + 60
        while not server.accepted and time.monotonic() < deadline:
            time.sleep(0.05)
        assert server.accepted, "the writer thread never tried the server"

        def train_and_close() -> None:
            train_with(logger)  # would hang for 600 s per request if log() waited on MLflow
            logger.close()  # bounded by close_timeout_s

        # A regression fails here instead of hanging the suite: the steps and the close run in
        # a daemon thread given a minute (they need well under a second when nothing waits).
        worker = threading.Thread(target=train_and_close, daemon=True)
        worker.start()
        worker.join(timeout=60)
        assert not worker.is_alive(), "a training step or close() waited on the hung server"
        assert logger.writer.run_id is None  # the server never answered anything
        steps = [r["step"] for r in read_spool(logger.spool.path) if r["kind"] == "metrics"]
        assert steps[:STEPS] == list(range(1, STEPS + 1))
    finally:
        server.close()


def test_sync_mlflow_names_a_missing_folder_in_one_sentence(tmp_path, capsys):
    assert launch_main(["sync-mlflow", str(tmp_path / "nowhere")]) == 2
    error = capsys.readouterr().err
    assert "does not exist" in error and "Traceback" not in error


def test_a_torn_last_line_and_a_damaged_middle_are_reported(tmp_path):
    spool = tmp_path / "s.jsonl"
    run = {"kind": "run", "seq": 0, "run_key": "k", "experiment": "e"}
    lines = [json.dumps(run), json.dumps({"kind": "end", "seq": 1, "status": "FINISHED"})]
    spool.write_text(lines[0] + "\n" + lines[1] + "\n" + '{"kind": "metr')
    assert [r["kind"] for r in read_spool(spool)] == ["run", "end"]
    assert load_spool(spool).damaged_lines == (3,)
    spool.write_text(lines[0] + "\n{oops\n" + lines[1] + "\n")
    assert [r["kind"] for r in read_spool(spool)] == ["run", "end"]
    assert load_spool(spool).damaged_lines == (2,)
    spool.write_text("{oops\n" + lines[1] + "\n")
    with pytest.raises(LaunchError, match="does not start with a run record"):
        read_spool(spool)


def test_recipes_get_tracking_per_step_and_an_off_switch(monkeypatch):
    from qwentitan.launch.tracking import TrackedMetrics, tracked_metrics

    monkeypatch.delenv("QWENTITAN_MLFLOW", raising=False)
    monkeypatch.delenv("QWENTITAN_MLFLOW_EXPERIMENT", raising=False)
    monkeypatch.delenv("MLFLOW_EXPERIMENT_NAME", raising=False)
    config = tracked_metrics("tiny_moe", "native")
    assert isinstance(config, TrackedMetrics.Config) and config.log_freq == 1
    assert config.mlflow.enable and config.mlflow.recipe == "tiny_moe"
    # one experiment per recipe family, written into the config itself
    assert config.mlflow.experiment == tracked_metrics("tiny_dense", "native").mlflow.experiment
    assert config.mlflow.experiment == "qwentitan-tiny"
    monkeypatch.setenv("QWENTITAN_MLFLOW", "off")
    assert not tracked_metrics("tiny_moe", "native").mlflow.enable
    monkeypatch.setenv("QWENTITAN_MLFLOW_EXPERIMENT", "mine")
    assert tracked_metrics("tiny_moe", "native").mlflow.experiment == "mine"


def test_a_full_spool_disk_costs_one_warning_and_the_spool_never_a_step(
    tmp_path, sqlite_uri, small_tmpfs, caplog
):
    with small_tmpfs(tmp_path / "disk", "8k") as disk:
        logger = make_logger(disk / "run", sqlite_uri)
        train_with(logger, steps=40)  # about 1 kB a step: the spool fills within a few
        logger.close()
    warnings = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]
    spool_warnings = [w for w in warnings if "MLflow spool" in w]
    assert (
        len(spool_warnings) == 1
        and "cannot be written (No space left on device)" in (spool_warnings[0])
    )
    client = MlflowClient(sqlite_uri)
    run = client.get_run(logger.writer.run_id)
    assert run.info.status == "FINISHED"  # MLflow still got every record
    steps = sorted(m.step for m in client.get_metric_history(run.info.run_id, "loss"))
    assert steps == list(range(1, 41))


def test_an_unwritable_spool_folder_costs_one_warning(tmp_path, sqlite_uri, caplog):
    (tmp_path / "run").mkdir()
    (tmp_path / "run" / "mlflow_spool").write_text("a file where the spool folder goes")
    logger = make_logger(tmp_path / "run", sqlite_uri)
    train_with(logger, steps=3)
    logger.close()
    assert sum("MLflow spool" in r.getMessage() for r in caplog.records) == 1
    run = MlflowClient(sqlite_uri).get_run(logger.writer.run_id)
    assert run.info.status == "FINISHED"
