"""Environment variables that give configuration its defaults: the one module that reads them.

Each setting is a Config field (MLflow's on `MLflowLogger.Config`, the model folders on the trn2
recipes' `hf_assets_path`), set on the command line with torchtitan's own overrides, e.g.
`--metrics.mlflow.tracking_uri URI`; a variable below only fills in the default when a recipe
builds its config, so the resolved config (logged to MLflow) holds the value actually used.
Facts of the machine (platform, LNC, world size) are not configuration and are read elsewhere.

This module imports nothing of qwentitan but its error class, so every layer may use it.
"""

from __future__ import annotations

import os
from pathlib import Path

from qwentitan.launch.base.errors import LaunchError

MLFLOW_SWITCH = "QWENTITAN_MLFLOW"
TRACKING_URI = "MLFLOW_TRACKING_URI"  # MLflow's own variable, so its other tools agree
EXPERIMENT = ("QWENTITAN_MLFLOW_EXPERIMENT", "MLFLOW_EXPERIMENT_NAME")
RUN_NAME = "QWENTITAN_MLFLOW_RUN_NAME"
PARENT_RUN_ID = "QWENTITAN_MLFLOW_PARENT_RUN_ID"
PRICE = "QWENTITAN_PRICE_PER_HOUR"
INSTANCE_TYPE = "QWENTITAN_INSTANCE_TYPE"
# trn2 recipe model folders: variable -> default (relative to the working directory)
MODEL_FOLDERS = {
    "QWENTITAN_QWEN3_4B_DIR": "./assets/hf/Qwen3-4B-Instruct-2507",
    "QWENTITAN_QWEN3_30B_A3B_DIR": "./assets/hf/Qwen3-30B-A3B",
}
_DEFAULT_STORE = "mlflow.db"
_OFF = ("0", "off", "false", "no")


def _value(name: str) -> str | None:
    return os.environ.get(name) or None  # set but empty counts as unset


def mlflow_enabled() -> bool:
    """False when `$QWENTITAN_MLFLOW` is 0/off/false/no (tests, quick local runs)."""
    return (_value(MLFLOW_SWITCH) or "on").lower() not in _OFF


def configured_tracking_uri() -> str | None:
    """`$MLFLOW_TRACKING_URI`, or None when unset."""
    return _value(TRACKING_URI)


def tracking_uri() -> str:
    """`$MLFLOW_TRACKING_URI`, else `mlflow.db` in the working directory, made absolute so a
    later `cd` (or a child process) still finds the same store."""
    return configured_tracking_uri() or f"sqlite:///{Path.cwd() / _DEFAULT_STORE}"


def experiment() -> str | None:
    """`$QWENTITAN_MLFLOW_EXPERIMENT`, else `$MLFLOW_EXPERIMENT_NAME`, else None."""
    return next((found for name in EXPERIMENT if (found := _value(name))), None)


def run_name() -> str | None:
    return _value(RUN_NAME)


def parent_run_id() -> str | None:
    return _value(PARENT_RUN_ID)


def instance_type() -> str | None:
    """`$QWENTITAN_INSTANCE_TYPE` (e.g. trn2.48xlarge where DMI does not say), or None."""
    return _value(INSTANCE_TYPE)


def price_per_hour() -> float | None:
    """`$QWENTITAN_PRICE_PER_HOUR` as a number, None when unset; a one-sentence error otherwise."""
    text = _value(PRICE)
    if text is None:
        return None
    try:
        return float(text)
    except ValueError:
        raise LaunchError(
            f"${PRICE}={text!r} is not a number; set it to the instance's hourly price in USD, "
            "e.g. 44.70, or unset it."
        ) from None


def model_folder(variable: str) -> str:
    """The folder named by `variable` (one of MODEL_FOLDERS), else its default; absolute, as
    torchtitan requires for `checkpoint.initial_load_path`."""
    folder = _value(variable) or MODEL_FOLDERS[variable]
    return str(Path(folder).expanduser().resolve())
