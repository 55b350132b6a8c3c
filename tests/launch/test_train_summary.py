"""The block that ends every `train`, and the console lines a user cannot act on kept out."""

from __future__ import annotations

import json
import logging
import re
import warnings

import pytest

from qwentitan.launch.runtime.console import quiet_console
from qwentitan.launch.tracking.processor import SummaryLogger
from qwentitan.launch.tracking.summary import RunSummary, format_summary

# The lines issues 17 and 33 name, as torch, torchtitan 0.3.0 and MLflow print them; a real
# `train` is checked against them (and its Summary block) in test_resume.py, on the two-rank run
# whose checkpoints the resume tests share.
NOISE = (
    "Peak flops undefined",
    "Error running lspci",
    "initial_load_model_only=True has no effect",
    "Peak FLOPS used for computing MFU",
    "TORCH_NCCL_ASYNC_ERROR_HANDLING",
    "model.safetensors.index.json not found",
    "Creating initial MLflow database tables",
    "Sleeping 2 seconds",
    "Destroying the purge thread",
    "\x1b[",  # colour: the log is a file, not a terminal
)

_REPORT = {
    "first_step": 1,
    "last_step": 3,
    "first_loss": 11.94773,
    "final_loss": 9.5,
    "last_validation_loss": 9.75,
    "last_validation_step": 2,
    "warmup_time_s": 7.14,
    "sustained_tokens_per_second": 1234.4,
    "sustained_tokens_per_second_per_device": 617.2,
    "ranks": 2,
    "run_dir": "/runs/a",
}


def summary_rows(block: str) -> dict[str, str]:
    lines = block.splitlines()
    assert lines[0] == "Summary"
    return dict(re.split(r"\s{2,}", line.strip(), maxsplit=1) for line in lines[1:])


def test_block_names_every_figure_and_how_to_open_the_mlflow_run():
    mlflow = {"run_id": "abc123", "tracking_uri": "sqlite:///runs/mlflow.db"}
    block = format_summary({**_REPORT, "mlflow": mlflow}, "/runs/a/checkpoint")
    rows = summary_rows(block)
    assert rows["loss"] == "11.9477 -> 9.5000 (step 1 -> 3)"
    assert rows["validation loss"] == "9.7500 (step 2)"
    assert rows["tokens/s"] == (
        "1234 in total = 617 per rank x 2 (a step line's tps is per rank); sustained: the "
        "median of the steps after the first"
    )
    assert rows["warm-up"].startswith("7.1 s")
    assert rows["checkpoints"] == "/runs/a/checkpoint"
    assert rows["MLflow run"] == "abc123 in sqlite:///runs/mlflow.db"
    assert rows["open it"] == (
        "uv run mlflow ui --backend-store-uri sqlite:///runs/mlflow.db  then "
        "http://127.0.0.1:5000/#/runs/abc123"
    )


def test_block_links_the_runs_metric_charts_and_the_experiments_runs_to_compare():
    mlflow = {"run_id": "abc123", "experiment_id": "7", "tracking_uri": "sqlite:///runs/mlflow.db"}
    ended = ["an earlier start (tiny_dense-1) ended without closing its MLflow run: ..."]
    rows = summary_rows(format_summary({**_REPORT, "mlflow": mlflow}, None, ended))
    assert rows["serve the UI"] == "uv run mlflow ui --backend-store-uri sqlite:///runs/mlflow.db"
    # loss and validation loss on one plot, in the model-training view (not the GenAI overview)
    assert rows["loss curve"] == (
        "http://127.0.0.1:5000/#/metric/loss?runs=%5B%22abc123%22%5D&metric=%22loss%22"
        "&experiments=%5B%227%22%5D&plot_metric_keys=%5B%22loss%22%2C%22validation%2Floss%22%5D"
        "&plot_layout=%7B%7D&x_axis=step&y_axis_scale=linear&line_smoothness=1&show_point=true"
        "&deselected_curves=%5B%5D&last_linear_y_axis_range=%5B%5D&workflowType=machine_learning"
    )
    # every chart of the run: its model-metrics tab
    assert rows["all charts"] == (
        "http://127.0.0.1:5000/#/experiments/7/runs/abc123/model-metrics"
        "?workflowType=machine_learning"
    )
    assert rows["compare runs"] == (
        "http://127.0.0.1:5000/#/experiments/7/runs?workflowType=machine_learning"
        "&compareRunsMode=CHART"
    )
    assert rows["earlier start"] == ended[0]
    served = {**mlflow, "tracking_uri": "https://user:pw@mlflow.example.com/"}
    rows = summary_rows(format_summary({**_REPORT, "mlflow": served}, None))
    assert "serve the UI" not in rows  # a tracking server serves its own UI
    assert rows["all charts"].startswith("https://mlflow.example.com/#/experiments/7/runs/abc123/")
    assert "pw" not in format_summary({**_REPORT, "mlflow": served}, None)


def test_the_pilot_and_train_share_one_url_builder():
    from qwentitan.launch.tracking.links import compare_url, loss_url, runs_url

    assert compare_url("sqlite:///m.db", "3", ["a", "b"]) == (
        "http://127.0.0.1:5000/#/compare-runs?runs=%5B%22a%22%2C%22b%22%5D"
        "&experiments=%5B%223%22%5D&workflowType=machine_learning"
    )
    assert loss_url("http://h:5000/", "3", ["a"]).startswith("http://h:5000/#/metric/loss?runs=")
    assert runs_url("http://h:5000", "3").endswith("compareRunsMode=CHART")


def test_block_says_mlflow_off_unconfirmed_and_missing_figures_plainly():
    off = format_summary({"first_step": 1, "last_step": 1, "first_loss": 2.0, "final_loss": 2.0,
                          "mlflow": None}, None)  # fmt: skip
    rows = summary_rows(off)
    assert rows["MLflow"] == "off" and rows["checkpoints"] == "off"
    assert rows["validation loss"] == "n/a" and rows["warm-up"] == "n/a"
    assert rows["tokens/s"] == "n/a (no step after the first)"
    unconfirmed = format_summary({**_REPORT, "mlflow": {"run_id": None, "tracking_uri": "x"}}, None)
    assert "qwentitan-launch sync-mlflow /runs/a" in unconfirmed


def test_summary_keeps_the_last_validation_loss():
    summary = RunSummary()
    summary.observe(1, {"loss": 3.0, "step_time_s": 2.0})
    summary.observe(2, {"validation/loss": 2.5})
    summary.observe(2, {"loss": 2.0, "step_time_s": 1.0})
    summary.observe(4, {"validation/loss": 1.5})
    assert summary.metrics()["summary/last_validation_loss"] == 1.5
    assert summary.last_validation_step == 4
    assert summary.final_loss == 2.0 and summary.last_step == 2


def test_summary_logger_writes_the_report_with_mlflow_off(tmp_path):
    logger = SummaryLogger(tmp_path, world_size=2, mlflow=None)
    for step in (1, 2, 3):
        logger.log({"loss_metrics/global_avg_loss": 10.0 / step, "throughput(tps)": 100.0 * step,
                    "time_metrics/end_to_end(s)": 1.0, "mfu(%)": float("nan")}, step)  # fmt: skip
    logger.log({"validation_metrics/loss": 4.0}, 3)
    logger.close()
    report = json.loads((tmp_path / "reports" / "summary.json").read_text())
    assert report["first_step"] == 1 and report["last_step"] == 3
    assert report["first_loss"] == 10.0 and report["final_loss"] == pytest.approx(10 / 3)
    assert report["last_validation_loss"] == 4.0 and report["last_validation_step"] == 3
    assert report["sustained_tokens_per_second"] == 2 * 250.0  # median of 200, 300; two ranks
    assert report["mlflow"] is None


def test_the_summary_warm_up_is_the_first_step_time_the_rank_said(tmp_path):
    """One warm-up figure: the rank's "First step 1: N s" (reports/first_step.json), not
    torchtitan's step-1 end-to-end time, which also counts the set-up before the step."""
    (tmp_path / "reports").mkdir()
    (tmp_path / "reports" / "first_step.json").write_text('{"step": 1, "seconds": 0.7}')
    logger = SummaryLogger(tmp_path, world_size=1, mlflow=None)
    for step in (1, 2):
        logger.log({"loss_metrics/global_avg_loss": 1.0, "time_metrics/end_to_end(s)": 9.0}, step)
    logger.close()
    report = json.loads((tmp_path / "reports" / "summary.json").read_text())
    assert report["warmup_time_s"] == 0.7 and report["ranks"] == 1


def test_summary_logger_says_in_one_line_when_the_run_folder_refuses_the_report(tmp_path, caplog):
    (tmp_path / "reports").write_text("a file where the folder should be")
    logger = SummaryLogger(tmp_path, world_size=1, mlflow=None)
    logger.log({"loss_metrics/global_avg_loss": 1.0}, 1)
    with caplog.at_level(logging.WARNING):
        logger.close()  # no exception: training is done, its figures are on the console
    (said,) = [r.getMessage() for r in caplog.records]
    assert said.startswith(f"The run summary could not be written to {tmp_path / 'reports'}")
    assert "\n" not in said


def test_quiet_console_drops_the_noise_and_nothing_else(caplog):
    quiet_console()
    quiet_console()  # a second call adds no second filter
    assert len(logging.getLogger().filters) == len(set(map(id, logging.getLogger().filters)))
    with caplog.at_level(logging.INFO):
        logging.getLogger().warning("Peak flops undefined for: cpu, fallback to A100")
        logging.getLogger().warning("Error running lspci: [Errno 2], fallback to use device_name")
        logging.getLogger().info("Saving the checkpoint.")
    assert [r.getMessage() for r in caplog.records] == ["Saving the checkpoint."]
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        quiet_console()
        warnings.warn("'set_vital' is deprecated", stacklevel=1)
        warnings.warn("In CPU autocast, but the target dtype is not supported.", stacklevel=1)
        # true on a CPU mesh, and said: qwentitan's initial weights do not rely on it
        warnings.warn("DTensor random operators may not have complete support on cpu", stacklevel=1)
        warnings.warn("something a user should see", stacklevel=1)
    assert [str(w.message) for w in seen] == [
        "DTensor random operators may not have complete support on cpu",
        "something a user should see",
    ]


@pytest.mark.parametrize(("setting", "coloured"), [("0", False), ("1", True)])
def test_quiet_console_colours_only_where_told_and_quiets_mlflows_store_setup(
    monkeypatch, caplog, setting, coloured
):
    monkeypatch.setenv("QWENTITAN_COLOR", setting)
    monkeypatch.delenv("NO_COLOR", raising=False)
    quiet_console()
    line = "\x1b[31mstep:  1  \x1b[32mloss: 11.9\x1b[39m"
    with caplog.at_level(logging.INFO):
        logging.getLogger().info(line)
        logging.getLogger("mlflow.store.db.utils").info(
            "Creating initial MLflow database tables..."
        )
        logging.getLogger("mlflow.store.db.utils").warning("a real problem")
    said = [r.getMessage() for r in caplog.records]
    assert said == [line if coloured else "step:  1  loss: 11.9", "a real problem"]
    monkeypatch.setenv("QWENTITAN_COLOR", "0")
    quiet_console()  # the other tests see plain text again


# What a two-rank `train` printed before the console left them to the run's log (issue 56),
# torchrun's `[rank0]:` first; the lines a user reads around them stay.
_LOG_ONLY = (
    "env           THP_MEM_ALLOC_ENABLE=1  (plan)",
    "[rank0]:/x/.venv/lib/python3.11/site-packages/torch/distributed/tensor/_random.py:76: "
    "UserWarning: DTensor random operators may not have complete support on cpu device mesh",
    "[rank0]:  if not is_rng_supported_mesh(device_mesh):",
    "[rank0]:[titan] 2026-12-07 01:47:32,260 - root - INFO - [GC] Initial GC collection took 0.00 "
    "seconds",
    "[rank0]:[titan] 2026-12-07 01:47:51,383 - root - INFO - Preparing "
    "qwentitan-validation-20-a41cc4e402cc1226 dataset from offline",
    "[rank0]:[titan] 2026-12-07 01:47:54,781 - root - INFO - Synchronizing and adjusting timeout "
    "for all ProcessGroups to 0:02:00",
    "[rank0]:/x/site-packages/torch/optim/lr_scheduler.py:209: UserWarning: The epoch parameter "
    "in `scheduler.step()` was not necessary and is being deprecated where possible.",
    "[rank0]:  warnings.warn(",
)
_KEPT = (
    "env           QWENTITAN_MLFLOW=on  (shell)",
    "[rank0]:[titan] 2026-12-07 01:47:51,380 - root - INFO - step:  1  loss: 11.94323",
    "[rank0]:[titan] 2026-12-07 01:47:54,780 - root - INFO - validate step:  1  loss: 11.8869",
    "[rank0]:[titan] 2026-12-07 01:48:02,247 - root - INFO - Saving the checkpoint.",
    "[rank0]:[titan] 2026-12-07 01:48:02,247 - root - INFO - Saving a full checkpoint at last "
    "step, step 3.",  # the last step: true
    "[rank0]:[titan] 2026-12-07 01:48:03,509 - root - INFO - Training completed",
    "[rank0]:Traceback (most recent call last):",
    '[rank0]:  File "x.py", line 1, in <module>',  # indented, but no warning's
    "[rank0]:/home/user/qwentitan/src/mine.py:3: UserWarning: our own warning",
)
_STOP = (
    "[rank0]:[titan] 2026-12-07 01:51:13,152 - root - INFO - Stopping after step 2: --stop-by "
    "deadline: no time for another step and a save; saving a checkpoint to resume from.",
    "[rank0]:[titan] 2026-12-07 01:51:13,152 - root - INFO - Saving a full checkpoint at last "
    "step, step 2.",
    "[rank0]:[titan] 2026-12-07 01:51:14,629 - root - INFO - Last step checkpoint completed in 1.48s",
    "[rank0]:[titan] 2026-12-07 01:51:14,629 - root - INFO - Training completed",
)


@pytest.mark.parametrize("verbose", [False, True])
def test_the_console_leaves_the_noise_to_the_log_unless_verbose(monkeypatch, verbose):
    import io

    from qwentitan.launch.runtime.console import VERBOSE, ConsoleFilter, for_console

    monkeypatch.setenv(VERBOSE, "1" if verbose else "")
    lines = [*_KEPT[:2], *_LOG_ONLY, *_KEPT[2:], *_STOP]
    out = io.StringIO()
    console = ConsoleFilter(out)
    for line in lines:
        console.write(line[:20])  # torchrun's tail writes whole lines; a print writes parts
        console.write(line[20:] + "\n")
    shown = out.getvalue().splitlines()
    plan_block = for_console("\n".join(lines[:3])).splitlines()
    if verbose:
        assert plan_block == lines[:3]  # the agent then wraps nothing: torchrun's own streams
        return
    assert shown == [*_KEPT, _STOP[0]]  # after a stop, nothing reads as a finished run
    assert plan_block == [lines[0], lines[1]]
