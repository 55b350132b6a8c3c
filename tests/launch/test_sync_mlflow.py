"""`qwentitan-launch sync-mlflow`: an unreachable store is one sentence with bounded waits; a
damaged spool is replayed around its damaged lines, reported, and never leaves a run RUNNING."""

from __future__ import annotations

import os
import socket
import threading
from pathlib import Path

import pytest
from mlflow import MlflowClient

from qwentitan.launch.launcher import cli
from qwentitan.launch.tracking import store
from qwentitan.launch.tracking.spool import SPOOL_FOLDER, SpoolWriter, load_spool

HTTP_VARIABLES = (
    "MLFLOW_HTTP_REQUEST_TIMEOUT",
    "MLFLOW_HTTP_REQUEST_MAX_RETRIES",
    "MLFLOW_HTTP_REQUEST_BACKOFF_FACTOR",
)


@pytest.fixture(autouse=True)
def mlflow_defaults(monkeypatch):
    """MLflow's own HTTP defaults, whatever the shell running the tests has set."""
    for name in (*HTTP_VARIABLES, "MLFLOW_TRACKING_URI"):
        monkeypatch.delenv(name, raising=False)


def write_spool(run_dir: Path, uri: str, *, end: bool = True) -> tuple[Path, SpoolWriter]:
    spool = SpoolWriter(run_dir / SPOOL_FOLDER / "20260101-000000-abcdef01.jsonl")
    spool.write(
        "run",
        run_key="abcdef0123456789",
        experiment="qwentitan-test",
        run_name="sync-test",
        parent_run_id=None,
        tracking_uri=uri,
        start_ms=1_700_000_000_000,
    )
    spool.write("params", params={"training.steps": "3"})
    for step in (1, 2, 3):
        spool.write(
            "metrics", step=step, time_ms=1_700_000_000_000 + step, values={"loss": 1 / step}
        )
    if end:
        spool.write("end", status="FINISHED", end_ms=1_700_000_009_000)
    spool.close()
    return spool.path, spool


def run_of(uri: str, experiment: str = "qwentitan-test"):
    client = MlflowClient(tracking_uri=uri)
    (run,) = client.search_runs([client.get_experiment_by_name(experiment).experiment_id])
    return client, run


def ours(err: str) -> str:
    """Our lines of stderr (MLflow logs its own, e.g. when it creates a sqlite store)."""
    return "\n".join(line for line in err.splitlines() if line.startswith("qwentitan-launch"))


def closed_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]  # closed again when the block ends: nothing listens


def test_an_unreachable_store_is_one_sentence_with_bounded_waits(tmp_path, capsys, monkeypatch):
    uri = f"http://127.0.0.1:{closed_port()}"
    path, _ = write_spool(tmp_path / "run", uri)
    before = path.read_bytes()
    seen: list[dict[str, str | None]] = []
    open_run = store.MlflowTarget.open_run

    caller = threading.get_ident()

    def spy(self, header, **options):
        # Only sync-mlflow's own calls: a writer thread left by another test may still retry.
        if threading.get_ident() == caller:
            seen.append({name: os.environ.get(name) for name in HTTP_VARIABLES})
        return open_run(self, header, **options)

    monkeypatch.setattr(store.MlflowTarget, "open_run", spy)
    assert cli.main(["sync-mlflow", str(tmp_path / "run")]) == 2
    out, err = capsys.readouterr()
    line = err.strip()
    assert "\n" not in line and "Traceback" not in out + err
    assert line == (
        f"qwentitan-launch sync-mlflow: MLflow at {uri} cannot be used (connection refused; "
        "each request waits at most 10 s, retried twice); start the tracking server or pass "
        "--tracking-uri, then run sync-mlflow again (the spool is kept)."
    )
    # The requests ran under training's bounds (MLflow's defaults: 120 s, 7 retries, factor 2)...
    assert seen == [dict(zip(HTTP_VARIABLES, ("10", "2", "1"), strict=True))]
    # ...which are not left behind in this process, and the spool is untouched.
    assert all(name not in os.environ for name in HTTP_VARIABLES)
    assert path.read_bytes() == before


def test_a_users_own_http_settings_win(tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "0")
    uri = f"http://127.0.0.1:{closed_port()}"
    write_spool(tmp_path / "run", uri)
    assert cli.main(["sync-mlflow", str(tmp_path / "run")]) == 2
    assert "cannot be used (connection refused" in capsys.readouterr().err
    assert os.environ["MLFLOW_HTTP_REQUEST_MAX_RETRIES"] == "0"


def test_damaged_lines_are_skipped_reported_and_the_run_ends(tmp_path, capsys, new_mlflow_store):
    uri = new_mlflow_store(tmp_path)
    path, _ = write_spool(tmp_path / "run", uri)
    lines = path.read_bytes().split(b"\n")
    lines[2] = b'{"kind": "metrics", "seq": 2, "step": 1, "time_ms": 1, "val'  # torn mid-file
    lines[3] = b'{"kind": "metrics", "seq": 3, "step": 2, "time_ms": 1}'  # no values
    path.write_bytes(b"\n".join(lines))
    damaged = path.read_bytes()

    assert cli.main(["sync-mlflow", str(tmp_path / "run")]) == 2
    out, err = capsys.readouterr()
    client, run = run_of(uri)
    assert run.info.status == "FINISHED"  # the end record survived
    assert [m.step for m in client.get_metric_history(run.info.run_id, "loss")] == [3]
    assert run.data.params == {"training.steps": "3"}
    assert out.strip() == (
        f"run {run.info.run_id}: 1 metric points added, 0 already there; 1 params and "
        "0 artifacts added; run ended FINISHED"
    )
    assert ours(err) == (
        f"qwentitan-launch sync-mlflow: skipped damaged spool line(s) 3, 4 of run "
        f"{run.info.run_id} (not JSON, a value MLflow cannot hold, a file outside the run "
        "folder, or torn); what they held is not in MLflow, everything else is."
    )
    assert path.read_bytes() == damaged  # input is never modified
    assert load_spool(path).damaged_lines == (3, 4)


def test_a_spool_without_an_end_leaves_its_run_failed_not_running(
    tmp_path, capsys, new_mlflow_store
):
    uri = new_mlflow_store(tmp_path)
    path, _ = write_spool(tmp_path / "run", uri, end=False)
    with path.open("ab") as spool:
        spool.write(b'{"kind": "metrics", "seq": 5, "st')  # the process died mid-write
    assert cli.main(["sync-mlflow", str(path)]) == 2  # a torn last line is said, not dropped
    out, err = capsys.readouterr()
    client, run = run_of(uri)
    assert run.info.status == "FAILED"
    assert ours(err).startswith("qwentitan-launch sync-mlflow: skipped damaged spool line(s) 6 ")
    assert [m.step for m in client.get_metric_history(run.info.run_id, "loss")] == [1, 2, 3]
    assert out.strip().endswith(
        "3 metric points added, 0 already there; 1 params and 0 artifacts added; run ended FAILED"
    )
    assert cli.main(["sync-mlflow", str(path)]) == 2  # twice: nothing added, still FAILED
    assert "0 metric points added, 3 already there" in capsys.readouterr().out
    assert run_of(uri)[1].info.status == "FAILED"


def test_a_damaged_first_line_is_refused_in_one_sentence(tmp_path, capsys):
    path, _ = write_spool(tmp_path / "run", f"sqlite:///{tmp_path / 'unused.db'}")
    path.write_bytes(b"\x00garbage\n" + path.read_bytes().split(b"\n", 1)[1])
    assert cli.main(["sync-mlflow", str(tmp_path / "run")]) == 2
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and err.startswith(
        f"qwentitan-launch sync-mlflow: {path} does not start with a run record"
    )
    assert not (tmp_path / "unused.db").exists()


def test_only_files_inside_the_run_folder_are_uploaded_and_bad_values_are_the_spools(
    tmp_path, capsys, new_mlflow_store
):
    uri = new_mlflow_store(tmp_path)
    run_dir = tmp_path / "run"
    path, _ = write_spool(run_dir, uri)
    (run_dir / "reports").mkdir()
    (run_dir / "reports" / "summary.json").write_text("{}")
    (run_dir / "reports" / "escape.json").symlink_to(tmp_path / "mlflow.db")
    bad = [
        '{"kind":"artifact","seq":9,"file":"/etc/passwd","artifact_path":"reports"}',
        '{"kind":"artifact","seq":10,"file":"../../../../etc/hostname","artifact_path":"r"}',
        '{"kind":"artifact","seq":11,"file":"reports/summary.json","artifact_path":"../../x"}',
        '{"kind":"metrics","seq":12,"step":4,"time_ms":1,"values":{"loss":"str"}}',
        '{"kind":"metrics","seq":13,"step":1e23,"time_ms":1,"values":{"loss":1.0}}',
        '{"kind":"artifact","seq":14,"file":"reports/escape.json","artifact_path":"reports"}',
    ]
    with path.open("a") as spool:
        spool.write("\n".join(bad) + "\n")
    assert cli.main(["sync-mlflow", str(run_dir)]) == 2
    out, err = capsys.readouterr()
    assert "Traceback" not in out + err
    client, run = run_of(uri)
    assert ours(err).startswith(
        f"qwentitan-launch sync-mlflow: skipped damaged spool line(s) 7, 8, 9, 10, 11 of run "
        f"{run.info.run_id} ("
    )
    uploaded = [a.path for a in client.list_artifacts(run.info.run_id, "reports")]
    assert uploaded == ["reports/summary.json"]  # the link out of the run folder is not
    assert [m.step for m in client.get_metric_history(run.info.run_id, "loss")] == [1, 2, 3]


def test_two_syncs_at_once_into_a_new_sqlite_store(tmp_path):
    import subprocess
    import sys

    uri = f"sqlite:///{tmp_path / 'new.db'}"
    runs = []
    for name in ("a", "b"):
        path, _ = write_spool(tmp_path / name, uri)
        path.write_text(path.read_text().replace("abcdef0123456789", f"key-{name}"))
        runs.append(tmp_path / name)
    syncs = [
        subprocess.Popen(
            [sys.executable, "-m", "qwentitan.launch.launcher.cli", "sync-mlflow", str(run)],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for run in runs
    ]
    for sync in syncs:
        _out, err = sync.communicate(timeout=300)
        assert sync.returncode == 0 and "Traceback" not in err, err
    client = MlflowClient(tracking_uri=uri)
    experiment = client.get_experiment_by_name("qwentitan-test").experiment_id
    assert len(client.search_runs([experiment])) == 2


def test_a_line_python_cannot_read_or_too_long_is_damaged_not_a_traceback(
    tmp_path, capsys, monkeypatch, new_mlflow_store
):
    from qwentitan.launch.tracking import spool as spool_module

    monkeypatch.setattr(spool_module, "MAX_LINE_BYTES", 1 << 20, raising=False)
    uri = new_mlflow_store(tmp_path)
    path, _ = write_spool(tmp_path / "run", uri)
    lines = path.read_bytes().split(b"\n")
    lines[2] = b"[" * 200_000  # nested past Python's recursion limit
    lines[3] = b'{"kind": "metrics", "seq": 3, "pad": "' + b"x" * (2 << 20) + b'"}'  # 2 MiB
    path.write_bytes(b"\n".join(lines))
    assert cli.main(["sync-mlflow", str(tmp_path / "run")]) == 2
    out, err = capsys.readouterr()
    assert "Traceback" not in out + err
    assert ours(err).startswith("qwentitan-launch sync-mlflow: skipped damaged spool line(s) 3, 4 ")
    assert "1 metric points added" in out


def test_a_fifo_or_device_in_the_spool_folder_is_one_sentence(tmp_path, capsys, no_hang):
    fifo = tmp_path / "run" / SPOOL_FOLDER / "20260101-000001-fifo0001.jsonl"
    fifo.parent.mkdir(parents=True)
    os.mkfifo(fifo)
    for target in (tmp_path / "run", fifo):
        assert cli.main(["sync-mlflow", str(target)]) == 2
        out, err = capsys.readouterr()
        assert "Traceback" not in out + err
        assert ours(err) == (
            f"qwentitan-launch sync-mlflow: {fifo} is a FIFO (named pipe), not a regular file; "
            f"sync-mlflow reads spool files only, move it out of {SPOOL_FOLDER}/ and run "
            "sync-mlflow again."
        )
    fifo.unlink()
    fifo.symlink_to("/dev/zero")
    assert cli.main(["sync-mlflow", str(tmp_path / "run")]) == 2
    assert "is a character device, not a regular file" in ours(capsys.readouterr().err)
