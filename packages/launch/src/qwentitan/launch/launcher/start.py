"""What `train` and `run` check on this host before they start a planned run, and the start.

After the plan (its own checks) come the host's: its devices, the local data and tokenizer
the plan's config names, the checkpoints already in the run folder against the request's
`resume`, and the free disk the planned checkpoints need. Each refusal is one sentence, before
any rank starts. `launch` then runs the plan's torchrun line under the signal-forwarding
supervisor (`launcher.supervisor.supervise`).
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import TYPE_CHECKING

from qwentitan.launch.base.errors import LaunchError
from qwentitan.launch.launcher import run_folder
from qwentitan.launch.launcher.plan import LaunchPlan

if TYPE_CHECKING:
    from qwentitan.launch.runtime.data import DataSource

__all__ = ["check_before_start", "check_host", "check_inputs", "check_local_dataset", "launch"]


def check_host(plan: LaunchPlan) -> None:
    """Refuse to launch where the planned devices are not, after the plan has been printed."""
    from qwentitan.launch.runtime.platforms import get_platform

    device = plan.topology.device_type
    if device == "cpu":
        return
    count = get_platform(device).max_ranks
    if device == "neuron" and count == 0:
        raise LaunchError(
            f"This host has no Neuron devices (torch-neuronx is not loaded), so the "
            f"{plan.topology.name} plan above cannot run here; launch it on a "
            f"{plan.topology.name}, or only print it (`plan`, or `run --dry-run`)."
        )
    if count < plan.ranks_per_node:
        unit = "Neuron cores" if device == "neuron" else "CUDA devices"
        raise LaunchError(
            f"This host shows {count} {unit} but the plan needs {plan.ranks_per_node} per node; "
            f"check {{lnc}} / NEURON_LOGICAL_NC_CONFIG or pass {{ranks_per_node}} {count}.",
            field="ranks_per_node",
        )


def check_inputs(plan: LaunchPlan) -> None:
    """The plan's tokenizer folder and local dataset, as every rank will read them."""
    from qwentitan.launch.runtime.data import OFFLINE, check_tokenizer_folder, resolve_dataset

    check_tokenizer_folder(plan.config.hf_assets_path)
    dataset = getattr(plan.config.dataloader, "dataset", None)
    if dataset not in (None, OFFLINE):
        check_local_dataset(plan, resolve_dataset(dataset))


def check_local_dataset(plan: LaunchPlan, source: DataSource) -> int:
    """Every line of a dataset's files as the plan's ranks will read them, and enough documents
    for its slices: `train`, `run` and preflight's dataset check all refuse here, naming the
    file, line and byte. Its number of documents."""
    from qwentitan.launch.runtime.data import check_dataset

    return check_dataset(
        source,
        holdout_every=getattr(plan.config.dataloader, "holdout_every", 20),
        validating=bool(plan.config.validator.enable),
    )


def check_before_start(plan: LaunchPlan, *, folder_given: bool) -> None:
    """Everything this host must hold for the plan: devices, inputs, checkpoints, disk."""
    check_host(plan)
    check_inputs(plan)
    run_folder.check_checkpoints(plan, folder_given=folder_given)
    run_folder.check_free_disk(plan)


def launch(plan: LaunchPlan, *, stopped_exit: int = 0) -> int:
    """This node's torchrun agent for the plan, every signal forwarded to its ranks; its exit
    code, or `stopped_exit` when the ranks stopped on a signal (`supervise`), a `--stop-by`
    deadline or a spot notice (their stop report, RUN_DIR/reports/stop.json)."""
    from qwentitan.launch.launcher import supervisor

    started = time.time()
    code = supervisor.supervise(plan.launch_argv(), plan.rank_env(), stopped_exit=stopped_exit)
    return stopped_exit if code == 0 and _stopped_on_notice(plan, started) else code


def _stopped_on_notice(plan: LaunchPlan, since: float) -> bool:
    """Whether the ranks of this launch reported a stop on a deadline or a spot notice."""
    from qwentitan.launch.tracking.store import REPORTS_FOLDER, STOP

    path = Path(plan.run_folder) / REPORTS_FOLDER / f"{STOP}.json"
    try:
        if path.stat().st_mtime < since:
            return False  # an earlier run's, in a folder continued with --resume
        return json.loads(path.read_text(encoding="utf-8")).get("cause") in ("deadline", "spot")
    except (OSError, ValueError, AttributeError):
        return False
