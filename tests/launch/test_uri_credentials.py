"""A tracking URI's user and password reach the MLflow client and nothing else: not the
console, the spool, resolved_config.json, reports/summary.json, the run's params or tags, nor
sync-mlflow's message."""

from __future__ import annotations

import base64
import json
import logging
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest
from mlflow import MlflowClient  # noqa: F401  (imported here, not in the writer thread)

from qwentitan.launch.launcher.cli import main as launch_main
from qwentitan.launch.tracking import MLflowLogger, SummaryLogger, format_summary, store

SECRET = "s3cr3t-pw"


class RefusingServer:
    """An MLflow address that records each request's Authorization header and answers 401."""

    def __init__(self) -> None:
        seen = self.authorizations = []

        class Handler(BaseHTTPRequestHandler):
            def _refuse(self) -> None:
                seen.append(self.headers.get("Authorization"))
                body = b'{"error_code": "UNAUTHENTICATED", "message": "who are you"}'
                self.send_response(401)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            do_GET = do_POST = _refuse

            def log_message(self, *args) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.uri = f"http://alice:{SECRET}@127.0.0.1:{self.server.server_port}/"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


@pytest.fixture
def server():
    s = RefusingServer()
    yield s
    s.close()


def test_without_credentials_takes_out_user_and_password_only():
    assert store.without_credentials("http://u:pw@host:5000/x?y=a@b") == "http://host:5000/x?y=a@b"
    assert store.without_credentials("https://u:p@ss@host/") == "https://host/"  # a raw @ in it
    assert store.without_credentials("API request to http://u:pw@h/api failed") == (
        "API request to http://h/api failed"
    )
    for kept in ("sqlite:////tmp/a@b/mlflow.db", "file:///x", "http://host/p@x", "databricks"):
        assert store.without_credentials(kept) == kept
    assert store.scrubbed({"a": ["http://u:pw@h/", 3]}) == {"a": ["http://h/", 3]}


def test_credentials_reach_the_client_and_nothing_that_shows_or_stores(
    tmp_path, server, monkeypatch, caplog, capsys
):
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    run_dir = tmp_path / "run"
    caplog.set_level(logging.INFO)
    logger = MLflowLogger.Config(
        tracking_uri=server.uri, recipe="tiny_dense", path="native", close_timeout_s=30.0
    ).build(
        run_dir=run_dir,
        config_dict={"metrics": {"mlflow": {"tracking_uri": server.uri}}, "training": {"s": 1}},
        tags={"platform": "cpu", "from": server.uri},
        world_size=1,
    )
    summary = SummaryLogger(run_dir, world_size=1, mlflow=logger)
    for step in (1, 2):
        logger.log({"loss_metrics/global_avg_loss": 1.0 / step}, step)
        summary.log({}, step)
    summary.close()
    logger.close()

    # The client got the credentials: MLflow sends them as HTTP basic authentication.
    basic = "Basic " + base64.b64encode(f"alice:{SECRET}".encode()).decode()
    assert basic in server.authorizations
    shown = server.uri.replace(f"alice:{SECRET}@", "")
    spool = logger.spool.path.read_text()
    assert json.loads(spool.splitlines()[0])["tracking_uri"] == shown
    report = json.loads((run_dir / "reports" / "summary.json").read_text())
    assert report["mlflow"]["tracking_uri"] == shown
    stored = {
        "spool": spool,
        "resolved config": (logger.spool.path.with_suffix("") / "resolved_config.json").read_text(),
        "summary.json": json.dumps(report),
        "log": caplog.text,
        "Summary block": format_summary(
            report | {"mlflow": {"run_id": "r", "tracking_uri": server.uri}}, None
        ),
    }
    assert "127.0.0.1" in stored["log"]  # the warning names the address, without the secret
    for where, text in stored.items():
        assert SECRET not in text and "alice" not in text, where

    # sync-mlflow to the same address: one sentence that names it without the secret.
    assert launch_main(["sync-mlflow", str(run_dir), "--tracking-uri", server.uri]) == 2
    err = capsys.readouterr().err
    assert f"MLflow at {shown} cannot be used (" in err, err
    assert SECRET not in err and "Traceback" not in err
