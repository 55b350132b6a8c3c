"""Environment variables: the one module of qwentitan.launch that reads them, at the edge.

Each setting is a Config field (MLflow's on `MLflowLogger.Config`, the model folders on the trn2
recipes' `hf_assets_path`, the machine kind on `Trainer.Config.target`), set on the command line
with torchtitan's own overrides, e.g. `--metrics.mlflow.tracking_uri URI`; a variable below only
fills in a default (or, for the Neuron runtime's own variables, is checked against the plan), so
the resolved config (logged to MLflow) holds the value actually used. The environment the ranks'
processes start with (`launcher.environment.rank_env`) is built from `shell()` below. This
module only reads: this process's own `os.environ` is written in one place, `scoped_env`, for
the length of one block.

This module imports nothing of qwentitan but its error class, so every layer may use it.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
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
    "QWENTITAN_QWEN3_8B_DIR": "./assets/hf/Qwen3-8B",
}
# The Neuron runtime's and TorchNeuron's own variables, which the plan checks or honours.
LNC_ENV = "NEURON_LOGICAL_NC_CONFIG"
VISIBLE_CORES = "NEURON_RT_VISIBLE_CORES"
COMPILER_FLAGS = "NEURON_CC_FLAGS"
COMPILE_CACHE = "TORCH_NEURONX_NEFF_CACHE_DIR"
# The c10d rendezvous id of this job, over the plan's (the sbatch script sets the SLURM job's).
RDZV_ID = "QWENTITAN_RDZV_ID"
MLFLOW_RUN_ID = "MLFLOW_RUN_ID"  # MLflow's own: the run a preflight report attaches to
CACHE = "QWENTITAN_CACHE"
# Whether the ranks' console lines keep torchtitan's colours: the launcher sets it from its own
# stdout (a rank's stdout is torchrun's pipe even when the user's is a terminal).
COLOUR = "QWENTITAN_COLOR"
DEFAULT_STORE = "mlflow.db"
_OFF = ("0", "off", "false", "no")


def _value(name: str) -> str | None:
    return os.environ.get(name) or None  # set but empty counts as unset


def colour() -> bool:
    """Colour on the console: `QWENTITAN_COLOR`, else this process's stdout is a terminal;
    never with `NO_COLOR` set (no-color.org)."""
    import sys

    if _value("NO_COLOR"):
        return False
    value = _value(COLOUR)
    return value.lower() not in _OFF if value else sys.stdout.isatty()


def metadata_endpoint(default: str) -> str | None:
    """The EC2 instance metadata service, as the AWS SDKs read it: None when
    `AWS_EC2_METADATA_DISABLED=true`, else `AWS_EC2_METADATA_SERVICE_ENDPOINT` or `default`."""
    if (_value("AWS_EC2_METADATA_DISABLED") or "").strip().lower() == "true":
        return None
    return (_value("AWS_EC2_METADATA_SERVICE_ENDPOINT") or default).rstrip("/")


def mlflow_enabled() -> bool:
    """False when `$QWENTITAN_MLFLOW` is 0/off/false/no (tests, quick local runs)."""
    return (_value(MLFLOW_SWITCH) or "on").lower() not in _OFF


def configured_tracking_uri() -> str | None:
    """`$MLFLOW_TRACKING_URI`, or None when unset."""
    return _value(TRACKING_URI)


def tracking_uri() -> str:
    """`$MLFLOW_TRACKING_URI`, else `mlflow.db` in the working directory, made absolute so a
    later `cd` (or a child process) still finds the same store."""
    return configured_tracking_uri() or f"sqlite:///{Path.cwd() / DEFAULT_STORE}"


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


def shell() -> dict[str, str]:
    """A copy of this process's environment: what the ranks' own environment starts from."""
    return dict(os.environ)


def configured_lnc(env: Mapping[str, str] | None = None) -> int | None:
    """`NEURON_LOGICAL_NC_CONFIG` in `env` (default: this process's environment); None if unset."""
    raw = (os.environ if env is None else env).get(LNC_ENV)
    if raw is None or raw == "":
        return None
    if not raw.strip().isdigit() or int(raw) < 1:
        raise LaunchError(f"{LNC_ENV} is {raw!r}; set it to 1 or 2, or unset it.")
    return int(raw)


def visible_cores() -> str | None:
    """`$NEURON_RT_VISIBLE_CORES` (a core, a list or a range), or None when unset."""
    return _value(VISIBLE_CORES)


def compiler_flags() -> str:
    """`$NEURON_CC_FLAGS`, "" when unset."""
    return _value(COMPILER_FLAGS) or ""


def mlflow_run_id() -> str | None:
    return _value(MLFLOW_RUN_ID)


def cache_root() -> Path:
    """Built data assets: `$QWENTITAN_CACHE`, else `$XDG_CACHE_HOME/qwentitan`, else
    `~/.cache/qwentitan`."""
    if found := _value(CACHE):
        return Path(found)
    return Path(_value("XDG_CACHE_HOME") or Path.home() / ".cache") / "qwentitan"


def local_world_size() -> int | None:
    """torchrun's `$LOCAL_WORLD_SIZE` (ranks on this node), or None outside torchrun."""
    found = _value("LOCAL_WORLD_SIZE")
    return int(found) if found and found.isdigit() else None


def world_size() -> int | None:
    """torchrun's `$WORLD_SIZE` (ranks on every node), or None outside torchrun."""
    found = _value("WORLD_SIZE")
    return int(found) if found and found.isdigit() else None


def local_rank() -> int:
    """torchrun's `$LOCAL_RANK` (this rank's place on its node), 0 outside torchrun."""
    found = _value("LOCAL_RANK")
    return int(found) if found and found.isdigit() else 0


def hub_offline_set() -> bool:
    """Whether `$HF_HUB_OFFLINE` asks huggingface_hub to stay off the network."""
    return (_value("HF_HUB_OFFLINE") or "").lower() in ("1", "true", "yes", "on")


def verbose() -> bool:
    """`--verbose` of `train` / `run`, which sets QWENTITAN_VERBOSE for the command and its
    torchrun agent: every line of the ranks on the console."""
    return (_value("QWENTITAN_VERBOSE") or "0") != "0"


def s3_endpoint() -> str | None:
    """The S3 endpoint the AWS SDKs use (`AWS_ENDPOINT_URL_S3`, else `AWS_ENDPOINT_URL`)."""
    return _value("AWS_ENDPOINT_URL_S3") or _value("AWS_ENDPOINT_URL")


def lock_dir() -> str | None:
    """Where the host-wide locks of remote run folders live (`QWENTITAN_LOCK_DIR`)."""
    return _value("QWENTITAN_LOCK_DIR")
