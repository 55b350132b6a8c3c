"""torchtitan's Trainer, made to run on the platform it finds (CPU included): the thin glue.

Each training step is torchtitan's `Trainer.train()` loop, unchanged; this module adds only what
torchtitan 0.3.0 lacks, one place each: the machine kind and kernel choices as config fields
(`Trainer.Config.target` / `.lnc` / `.kernels`, from which the config builds its model), the
platform's device module (`use_platform`), SUM reductions for gloo (`force_sum_reduction`), the
step boundary where a run stops early with a checkpoint (`Trainer.at_step_boundary`: `--stop-after`,
a signal, the `--stop-by` budget, a spot notice, each said in RUN_DIR/reports/stop.json), loads
only of a checked `.metadata` (`checked_loads`), saves that fail in one sentence and leave no
partial step (`guard_saves`), and the first step timed apart with, on Neuron, the ops
TorchNeuron ran on the CPU (`Trainer.train_step`, RUN_DIR/reports/first_step.json), and a rank's
end without torchtitan's 2 s closing sleep (on one node) and before the native teardown that can
abort it (`rank_exit`). Importing it quiets the console lines a user cannot act on
(`console.quiet_console`).
"""

from __future__ import annotations

import contextlib
import logging
import shutil
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Annotated, Any

import torch
import tyro
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.fsdp import FSDPModule
from torchtitan import trainer as torchtitan_trainer
from torchtitan.protocols.model_spec import ModelSpec
from torchtitan.tools import filesystem
from torchtitan.tools.logging import logger

from qwentitan.kernels import KernelChoices
from qwentitan.kernels.env import kernel_choices_text
from qwentitan.launch.base import env_defaults
from qwentitan.launch.base.target import Target, get_target
from qwentitan.launch.runtime.console import quiet_console
from qwentitan.launch.runtime.neuron_runtime import report_fallback_ops
from qwentitan.launch.runtime.platforms import Platform, get_platform, host_target
from qwentitan.launch.runtime.preemption import (
    DEADLINE,
    SPOT_NOTICE,
    PreemptionWatch,
    cause_kind,
)
from qwentitan.launch.runtime.rank_exit import (
    leave_cleanly_after_training,
    without_the_closing_sleep,
)
from qwentitan.launch.runtime.spot import SpotWatcher, describe_notice, start_watching
from qwentitan.launch.runtime.stop_clock import StopClock, state_bytes
from qwentitan.launch.runtime.whole_init import whole_init
from qwentitan.launch.tracking.logger import FIRST_STEP, attach_report
from qwentitan.launch.tracking.store import STOP

__all__ = [
    "Trainer",
    "checked_loads",
    "force_sum_reduction",
    "guard_saves",
    "timed_saves",
    "use_platform",
]

# Before torchtitan builds a rank's config and Trainer (the recipe module imports this one).
quiet_console()

# A recipe's model for a Target and kernel choices (`Trainer.Config.model_for`).
ModelFor = Callable[[Target, KernelChoices], ModelSpec]

# Exit code of a rank whose checkpoint could not be written: a fault of the environment.
SAVE_FAILED_EXIT = 2
# Less free space than this after a failed save: the disk filled up (whatever the error says).
FULL_DISK_BYTES = 2**20


def use_platform(platform: Platform) -> None:
    """Make every torchtitan module use `platform`'s device type and device module.

    torchtitan binds `device_type, device_module = get_device_info()` once, in
    `torchtitan.tools.utils`, and modules such as `components.metrics`, `distributed.utils` and
    `distributed.parallel_dims` import those two names by value. On a host without an
    accelerator that value is ("cuda", torch.cuda), so each loaded module holding the stale
    pair is rebound here. Besides `rank_exit.without_the_closing_sleep`, the only place
    qwentitan touches torchtitan's globals.
    """
    from torchtitan.tools import utils

    stale = {"device_type": utils.device_type, "device_module": utils.device_module}
    fresh = {"device_type": platform.device_type, "device_module": platform.device_module}
    for name, module in list(sys.modules.items()):
        if name.startswith("torchtitan") and module is not None:
            namespace = vars(module)
            for key, value in stale.items():
                if key in namespace and namespace[key] is value:
                    namespace[key] = fresh[key]


def force_sum_reduction(model_parts: list[torch.nn.Module]) -> int:
    """Make FSDP2 reduce gradients with SUM (then scale), since gloo has no PREMUL_SUM.

    Returns how many FSDP modules were switched. Harmless on NCCL (one extra scaling kernel),
    so it is applied wherever the backend is gloo.
    """
    switched = 0
    for part in model_parts:
        for module in part.modules():
            if isinstance(module, FSDPModule):
                module.set_force_sum_reduction_for_comms(True)
                switched += 1
    return switched


def save_failure(step_folder: Path | str, error: BaseException) -> str:
    """One sentence for a failed save of `step_folder` (call before removing the folder; a URL
    on S3 has no disk to be full)."""
    causes = [error]
    if isinstance(error, CheckpointException):
        causes = [failure for failure, _trace in error.failures.values()] or causes
    cause = next((c for c in causes if isinstance(c, OSError)), causes[0])
    remote = filesystem.is_remote(step_folder)
    free = None if remote else shutil.disk_usage(_existing(Path(step_folder))).free
    parent = str(step_folder).rsplit("/", 1)[0] if remote else Path(step_folder).parent
    if isinstance(cause, OSError) and cause.strerror:
        reason = cause.strerror
    elif free is not None and free < FULL_DISK_BYTES:
        # torch.save's zip writer turns a short write (ENOSPC) into "unexpected pos" errors.
        reason = f"the disk is full, {free} bytes left"
    else:
        reason = f"{type(cause).__name__}: {str(cause).splitlines()[0] if str(cause) else ''}"
    return (
        f"Saving the checkpoint {step_folder} failed ({reason}); its partial folder was removed, "
        f"so --resume continues from the previous checkpoint: free space in {parent} "
        "or choose another run folder, then resume."
    )


def _existing(path: Path) -> Path:
    while not path.exists():
        path = path.parent
    return path


def checked_loads(dcp_load: Callable[..., Any]) -> Callable[..., Any]:
    """torchtitan's `CheckpointManager.dcp_load`, run only on a DCP folder whose `.metadata`
    qwentitan.checkpoint's `SafeFileSystemReader` has read (an allow-list unpickler): torch's
    own reader, which torchtitan's load uses, unpickles it with `pickle.load`, which runs any
    code the file names. The launcher checks the same file before the ranks start; this covers
    loads it does not see (`--checkpoint.initial_load_path`, a file changed since). A refused
    file ends the rank in one sentence (exit 2)."""

    def checked(state_dict: Any, checkpoint_id: str, from_hf: bool, *args: Any, **kwargs: Any):
        if not from_hf:  # an HF folder is safetensors, which hold no code
            from qwentitan.checkpoint import CheckpointError, safe_reader_for

            try:
                safe_reader_for(checkpoint_id).read_metadata()  # local, or remote (s3://) by fsspec
            except CheckpointError as error:
                logger.error(f"Not loading the checkpoint {checkpoint_id}: {error}")
                raise SystemExit(2) from None  # a fault of the input, said in one sentence
        return dcp_load(state_dict, checkpoint_id, from_hf, *args, **kwargs)

    return checked


def guard_saves(save: Callable[..., Any], folder: str | Path) -> Callable[..., Any]:
    """`save(step, ...)` that, when it fails, removes `folder/step-N` and exits the rank
    (code SAVE_FAILED_EXIT) with one sentence instead of a traceback per rank."""

    def guarded(step: int, *args: Any, **kwargs: Any) -> Any:
        try:
            return save(step, *args, **kwargs)
        except (Exception, CheckpointException) as error:
            step_folder = filesystem.join(str(folder), f"step-{step}")  # a path, or a URL
            # DCP raises on every rank after all of them stopped writing; one removes the folder.
            if not torch.distributed.is_initialized() or torch.distributed.get_rank() == 0:
                message = save_failure(step_folder, error)
                with contextlib.suppress(OSError):
                    filesystem.rmtree(step_folder)
                logger.error(message)
            raise SystemExit(SAVE_FAILED_EXIT) from None

    return guarded


def timed_saves(save: Callable[..., Any], on_saved: Callable[[float], None]) -> Callable[..., Any]:
    """`save(step, ...)` that reports the seconds of each save that wrote a checkpoint (the
    `--stop-by` budget; with an async checkpoint mode that is the staging time only)."""

    def timed(step: int, *args: Any, **kwargs: Any) -> Any:
        start = time.perf_counter()
        wrote = save(step, *args, **kwargs)
        if wrote:
            on_saved(time.perf_counter() - start)
        return wrote

    return timed


class Trainer(torchtitan_trainer.Trainer):
    """torchtitan's Trainer on the current platform, able to stop early and resume exactly."""

    @dataclass(kw_only=True, slots=True)
    class Config(torchtitan_trainer.Trainer.Config):
        target: str = ""
        """The machine kind the ranks train on, a Target name (cpu, cuda, trn2.48xlarge, ...);
        "" means this host's (`platforms.host_target`)."""
        lnc: int | None = None
        """Logical NeuronCore size on Trainium, as the plan resolved it (None: the Target's
        default)."""
        kernels: str = field(default_factory=kernel_choices_text)
        """Which implementation each custom kernel of the moe-kernels path runs, as
        comma-separated kernel=choice pairs (`experts=reference`; `qwentitan.kernels.
        KernelChoices`); default `$QWENTITAN_KERNELS`, else NKI RoPE and experts."""
        stop_after: int | None = None
        """Stop after this step with a full checkpoint, before `training.steps` (a planned
        interruption: a later run with the same folder resumes from it)."""
        stop_by: str = ""
        """Stop at a step boundary with a checkpoint written before this UTC time (ISO 8601;
        `runtime.stop_clock` budgets it); "" runs to `training.steps`."""
        model_for: Annotated[ModelFor | None, tyro.conf.Suppress] = None
        """How the recipe builds its model for a Target and kernel choices (set by the recipe,
        like `model_spec`)."""
        placed_for: Annotated[tuple[str, str] | None, tyro.conf.Suppress] = None
        """The (target, kernels) `model_spec` was built for."""

        def __post_init__(self) -> None:
            # Runs again each time torchtitan's parser applies the command line (its fields
            # arrive as the recipe's config had them), so `--target` reaches the model and the
            # CUDA-graph switch in the one config the ranks and the plan build. The model is
            # built once per placement: only a changed target or kernel choice rebuilds it.
            target = self.placed_target()
            placement = (target.name, self.kernels)
            if self.model_for is not None and placement != self.placed_for:
                choices = KernelChoices.parse(self.kernels, source="kernels")
                self.model_spec = self.model_for(target, choices)
                self.placed_for = placement
            # CUDA graphs exist on CUDA only; torchtitan validates them (and refuses EP) else.
            # Set both ways: the recipe's own build (for this host) must not decide for --target.
            self.training.disable_cuda_graphs = target.device_type != "cuda"
            torchtitan_trainer.Trainer.Config.__post_init__(self)

        def placed_target(self) -> Target:
            return get_target(self.target or host_target())

        def placed_lnc(self, target: Target) -> int:
            """`lnc` as the plan resolved it; no fallback of the rank's own."""
            return target.check_lnc(self.lnc)

        def to_dict(self) -> dict[str, Any]:
            config = torchtitan_trainer.Trainer.Config.to_dict(self)
            config.pop("model_for", None)  # a function: the model itself is under model_spec
            config.pop("placed_for", None)
            return config

    config: Config
    target: Target
    platform: Platform
    preemption: PreemptionWatch
    clock: StopClock | None = None
    spot: SpotWatcher | None = None
    first_step_done: bool = False

    def __init__(self, config: Config) -> None:
        self.target = config.placed_target()
        lnc = config.placed_lnc(self.target)
        self.platform = get_platform(self.target.device_type, lnc=lnc)
        use_platform(self.platform)
        # Installed before the model is built: a preemption during start-up is then honoured at
        # the first step boundary instead of killing the rank without a checkpoint.
        self.preemption = PreemptionWatch().install()
        if env_defaults.local_rank() == 0:  # one watcher per node; the all-reduce tells the rest
            self.spot = start_watching(self._on_spot_notice)
        if self.target.device_type == "cpu":  # DTensor cannot split a random init there
            whole_init(config)
        super().__init__(config)
        # On a full disk torchtitan's structured logger (a file in the run folder) fails too, and
        # Python's logging would print a traceback per record; the failed save's sentence says why.
        logging.raiseExceptions = False
        if self.checkpointer.enable:
            # The manager is built from the recipe's own config (any checkpointer class), so its
            # save is wrapped here rather than subclassed in every recipe.
            self.checkpointer.save = timed_saves(
                guard_saves(self.checkpointer.save, self.checkpointer.folder), self._saved
            )
            self.checkpointer.dcp_load = checked_loads(self.checkpointer.dcp_load)
        if config.stop_by:
            self.clock = self._start_clock(config.stop_by)
        validator = getattr(self, "validator", None)
        if validator is not None and getattr(validator, "validate", None) is not None:
            validator.validate = self._unless_stopping(validator.validate)
        if self.target.backend == "gloo":
            force_sum_reduction(self.model_parts)
        peak = self.target.peak_flops(lnc)  # the one place a rank decides its peak
        if peak is not None:
            self.metrics_processor.gpu_peak_flops = peak
            logger.info(f"MFU against {peak:.3e} peak FLOP/s per rank.")
        else:
            # No published peak here (CPU): torchtitan's only switch that drops MFU from the
            # console and the loggers is `has_quantization`, so MFU reads "N/A", never a guess.
            self.metrics_processor.has_quantization = True
            logger.info(f"MFU: n/a on {self.platform.name} (no published peak FLOP/s).")

    def _start_clock(self, stop_by: str) -> StopClock:
        params = (p for part in self.model_parts for p in part.parameters())
        clock = StopClock.until(stop_by, state_bytes(params))
        logger.info(
            f"Stopping by {stop_by}: at each step boundary, one more step + a save (until one is "
            f"timed, ~{clock.save_s:.1f} s from this rank's state size) + {clock.margin_s:g} s "
            "must fit before it."
        )
        return clock

    def _saved(self, seconds: float) -> None:
        if self.clock is not None:
            self.clock.saved(seconds)
            logger.info(f"The save took {seconds:.2f} s: the --stop-by budget now counts that.")

    def _on_spot_notice(self, text: str) -> None:
        """From the watcher's thread: only the flag a signal would set, and one line."""
        self.preemption.request(SPOT_NOTICE)
        logger.warning(f"Spot interruption notice ({describe_notice(text)}): saving and stopping.")

    def _unless_stopping(self, validate: Callable[..., Any]) -> Callable[..., Any]:
        """`validate` skipped when a stop is pending on any rank (a signal, a spot notice, the
        `--stop-by` budget), so the checkpoint at the step boundary right after it comes first."""

        def guarded(model_parts: Any, step: int, *args: Any, **kwargs: Any) -> Any:
            self._check_clock()  # a validation that would cross --stop-by's budget is skipped
            if self.preemption.stop_requested(self.device) is None:
                return validate(model_parts, step, *args, **kwargs)
            logger.info(f"Validation of step {step} skipped: a stop signal is pending.")
            return None

        return guarded

    def train_step(self, data_iterator) -> None:
        if self.first_step_done:
            return super().train_step(data_iterator)
        # The longest silence of a run otherwise: the first step builds and compiles everything.
        logger.info(
            f"Step {self.step} is the first: it compiles and warms up, so it takes longest."
        )
        start = time.perf_counter()
        super().train_step(data_iterator)
        self.platform.device_module.synchronize()
        seconds = time.perf_counter() - start
        self.first_step_done = True
        logger.info(f"First step {self.step}: {seconds:.1f} s (compilation included).")
        fallback = None
        if self.platform.device_type == "neuron":
            fallback = report_fallback_ops(getattr(self.metrics_processor, "mlflow", None))
        if not torch.distributed.is_initialized() or torch.distributed.get_rank() == 0:
            report = {"step": self.step, "seconds": round(seconds, 3), "fallback_ops": fallback}
            attach_report(self.config.dump_folder, FIRST_STEP, report)

    def train(self) -> None:
        with without_the_closing_sleep():
            super().train()
        leave_cleanly_after_training()

    def stop_reason(self) -> str | None:
        """Why training should stop at this step boundary, or None to go on.

        Besides `--stop-after`: a signal (SIGTERM / SIGUSR1 / SIGINT) received by any rank,
        agreed across ranks by `PreemptionWatch` so that all stop at the same step.
        """
        stop_after = self.config.stop_after
        if stop_after is not None and self.step >= stop_after:
            return f"--stop-after {stop_after} reached"
        self._check_clock()
        return self.preemption.stop_requested(self.device)

    def _check_clock(self) -> None:
        """Ask for a stop when one more step and a save no longer fit before `--stop-by`."""
        if self.clock is not None and self.clock.due():
            self.preemption.request(DEADLINE)

    def at_step_boundary(self) -> bool:
        """Run between two steps (after checkpoint and validation); False ends training."""
        if self.clock is not None:
            self.clock.boundary()
        if self.step >= self.config.training.steps:
            return False
        reason = self.stop_reason() if self.step > 0 else None
        if reason is None:
            return True
        interval_saved = self.step % self.config.checkpoint.interval == 0
        if self.config.checkpoint.enable and not interval_saved:
            # `last_step=True` saves now, whatever the interval; the full state (model,
            # optimizer, lr schedule, data position, step) is kept, since this is not the end.
            model_only = self.checkpointer.last_save_model_only
            self.checkpointer.last_save_model_only = False
            try:
                self.checkpointer.save(self.step, last_step=True)
            finally:
                self.checkpointer.last_save_model_only = model_only
        logger.info(f"Stopping after step {self.step}: {reason}.")
        self._report_stop(reason)
        return False

    def _report_stop(self, reason: str) -> None:
        """RUN_DIR/reports/stop.json (the launcher reads it for its exit code), the summary's
        line and MLflow's tags: why this run stopped before its last step."""
        agreed = self.preemption.agreed
        report: dict[str, Any] = {
            "step": self.step,
            "reason": reason,
            "cause": "stop_after" if agreed is None else cause_kind(agreed),
        }
        if self.clock is not None:
            report["budget"] = self.clock.decision or self.clock.figures()
        if self.spot is not None and self.spot.notice is not None:
            report["spot_notice"] = self.spot.notice
        record = getattr(self.metrics_processor, "record_stop", None)
        if record is not None:
            record(report)
        if not torch.distributed.is_initialized() or torch.distributed.get_rank() == 0:
            attach_report(self.config.dump_folder, STOP, report)

    def should_continue_training(self) -> bool:
        return self.at_step_boundary()
