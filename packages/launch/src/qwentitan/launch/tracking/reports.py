"""Reports other steps write into a run folder, to be attached to the run's MLflow record.

Preflight, the launch plan and checkpoint verification each call `attach_report` with the run
folder (torchtitan's dump_folder). The report lands in RUN_DIR/reports/<name>.json; a run
logging in this process uploads it at once, a run starting later picks it up at its end, and
`sync-mlflow` attaches whatever appeared after the run finished.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from qwentitan.launch.base.errors import LaunchError
from qwentitan.launch.tracking.logger import REPORTS_FOLDER, active_loggers, write_text_atomically

# Names the rest of qwentitan uses, so the MLflow artifact tree reads the same for every run.
LAUNCH_PLAN = "launch_plan"
PREFLIGHT = "preflight"
CHECKPOINT_VERIFICATION = "checkpoint_verification"
FIRST_STEP = "first_step"  # the first step's time (compile included) and the CPU fallbacks
SUMMARY = "summary"  # the figures that end `train` on the console (summary_logger.py)


def attach_report(
    run_dir: str | os.PathLike[str], name: str, report: Mapping[str, Any] | str | os.PathLike[str]
) -> Path:
    """Store `report` (a dict, saved as JSON, or an existing file, copied) as RUN_DIR/reports/<name>."""
    if not name or "/" in name or name.startswith("."):
        raise LaunchError(
            f"Report name {name!r} must be a plain file name such as 'preflight'; drop the slashes."
        )
    folder = Path(run_dir) / REPORTS_FOLDER
    if isinstance(report, Mapping):
        target = folder / (name if name.endswith(".json") else f"{name}.json")
        write_text_atomically(target, json.dumps(report, indent=2, default=str))
    else:
        source = Path(report)
        if not source.is_file():
            raise LaunchError(
                f"Report file {source} does not exist; write it first or pass the report as a dict."
            )
        target = folder / (name + source.suffix if not Path(name).suffix else name)
        write_text_atomically(target, source.read_text(encoding="utf-8"))
    for logger in active_loggers():
        if logger.run_dir == Path(run_dir).resolve():
            logger.attach(target)
    return target
