"""torchtitan's Trainer on the platform it finds (CPU included), able to stop early and resume.

Each training step is torchtitan 0.3.0's `Trainer.train()` loop, unchanged; what qwentitan adds
enters at its seams, the components a recipe's config names and the hooks the loop calls:

    while trainer.should_continue_training():   # at_step_boundary: stop here? (below)
        step += 1
        trainer.train_step(batches)             # forward, backward, clip, optimizer, lr;
                                                #   the first timed (reports/first_step.json)
        checkpointer.save(step)                 # GuardedCheckpointManager: timed; a failure is
                                                #   one sentence and leaves no partial step-N
        validator.validate(model_parts, step)   # PausableValidator: skipped if a stop is pending
    # metrics: TrackedMetrics (console, MLflow, summary; MFU only against a known peak)

`at_step_boundary` ends a run with a full checkpoint at `--stop-after`, or, agreed by every rank,
on a signal, a spot notice or a spent `--stop-by` budget, and says why in
RUN_DIR/reports/stop.json. Before the loop the Trainer takes its Target, LNC and kernel choices
from its config, moves torchtitan's device globals to the platform's (`platforms.use_platform`,
the one patch), gives CPU model parts the weights one rank would draw (`whole_init`) and makes
FSDP reduce with SUM over gloo; after it, a rank ends without torchtitan's closing sleep on one
node and before the native teardown that can abort it (`rank_exit`). Importing this module
quiets the console lines a user cannot act on (`console.quiet_console`).
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Annotated, Any

import torch
import tyro
from torch.distributed.fsdp import FSDPModule
from torchtitan import trainer as torchtitan_trainer
from torchtitan.config import TORCH_DTYPE_MAP
from torchtitan.protocols.model_spec import ModelSpec
from torchtitan.tools.logging import logger

from qwentitan.kernels import KernelChoices
from qwentitan.kernels.env import kernel_choices_text
from qwentitan.launch.base import env_defaults
from qwentitan.launch.base.target import Target, get_target
from qwentitan.launch.runtime.checkpointer import GuardedCheckpointManager
from qwentitan.launch.runtime.console import quiet_console
from qwentitan.launch.runtime.neuron_runtime import report_fallback_ops
from qwentitan.launch.runtime.peak_flops import peak_flops
from qwentitan.launch.runtime.platforms import Platform, get_platform, host_target, use_platform
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
from qwentitan.launch.runtime.validator import PausableValidator
from qwentitan.launch.runtime.whole_init import whole_init
from qwentitan.launch.tracking.logger import FIRST_STEP, HF_EXPORT, attach_report
from qwentitan.launch.tracking.store import STOP

__all__ = ["Trainer", "force_sum_reduction"]

# Before torchtitan builds a rank's config and Trainer (the recipe module imports this one).
quiet_console()

# A recipe's model for a Target and kernel choices (`Trainer.Config.model_for`).
ModelFor = Callable[[Target, KernelChoices], ModelSpec]


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
    checkpointer: GuardedCheckpointManager
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
        peak = peak_flops(self.target, lnc)  # the one place a rank decides its peak
        metrics = dataclasses.replace(config.metrics, peak_flops=peak)
        super().__init__(dataclasses.replace(config, metrics=metrics))
        if self.target.device_type == "cpu":  # DTensor cannot split a random init there
            dtype = TORCH_DTYPE_MAP[config.training.dtype]
            whole_init(self.model_parts, self.model_config, config.debug.seed, dtype)
        # On a full disk torchtitan's structured logger (a file in the run folder) fails too, and
        # Python's logging would print a traceback per record; the failed save's sentence says why.
        logging.raiseExceptions = False
        if config.checkpoint.enable and _rank() == 0:
            self.checkpointer.describe_export(
                config.model_spec.flavor, config.hf_assets_path, self._on_export
            )
        if config.stop_by:
            self.clock = self._start_clock(config.stop_by)
        if isinstance(getattr(self, "validator", None), PausableValidator):
            self.validator.pause_when(self._stopping)
        if self.target.backend == "gloo":
            force_sum_reduction(self.model_parts)
        if peak is not None:
            logger.info(f"MFU against {peak:.3e} peak FLOP/s per rank.")
        else:
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

    def _take_save_times(self) -> None:
        """Count the saves timed since the last call in the `--stop-by` budget."""
        times = self.checkpointer.save_seconds
        while times:
            seconds = times.pop(0)
            if self.clock is not None:
                self.clock.saved(seconds)
                logger.info(f"The save took {seconds:.2f} s: the --stop-by budget now counts that.")

    def _on_export(self, result: dict[str, Any]) -> None:
        """Rank 0: one line per export, the report the Summary reads and MLflow's tags."""
        if result["ok"]:
            logger.info(f"Exported step {result['step']} to {result['folder']} (verified).")
        else:
            logger.warning(
                f"Exporting step {result['step']} to Hugging Face failed ({result['error']}); "
                "training goes on."
            )
        attach_report(self.config.dump_folder, HF_EXPORT, result)
        mlflow = getattr(getattr(self, "metrics_processor", None), "mlflow", None)
        if mlflow is not None:
            state = "ok" if result["ok"] else "failed"
            mlflow.set_tags(
                {"hf_export.last": f"step {result['step']} {state}: {result['folder']}"}
            )
            if not result["ok"]:
                mlflow.set_tags({"hf_export.failed": f"step {result['step']}: {result['error']}"})

    def _on_spot_notice(self, text: str) -> None:
        """From the watcher's thread: only the flag a signal would set, and one line."""
        self.preemption.request(SPOT_NOTICE)
        logger.warning(f"Spot interruption notice ({describe_notice(text)}): saving and stopping.")

    def _stopping(self) -> bool:
        """Whether a stop is pending on any rank (a signal, a spot notice, the `--stop-by`
        budget, which a validation that would cross it trips): the validator's pause."""
        self._take_save_times()
        self._check_clock()
        return self.preemption.stop_requested(self.device) is not None

    def train_step(self, data_iterator) -> None:
        if self.first_step_done:
            return super().train_step(data_iterator)
        # The longest silence of a run otherwise: the first step builds and compiles everything.
        logger.info(
            f"Step {self.step} is the first: it compiles and warms up, so it takes longest. "
            f"A step line's memory is {self.platform.memory_measured}."
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
        self._take_save_times()  # before the boundary: a save's time is no step's
        if self.clock is not None:
            self.clock.boundary()
        if self.step >= self.config.training.steps:
            return False
        reason = self.stop_reason() if self.step > 0 else None
        if reason is None:
            return True
        interval_saved = self.step % self.config.checkpoint.interval == 0
        # Said before the save, whose lines (torchtitan's "at last step") the console then
        # leaves out (runtime.console): this is a stop, not the end of the run.
        saving = self.config.checkpoint.enable and not interval_saved
        logger.info(
            f"Stopping after step {self.step}: {reason}"
            + (
                "; saving a checkpoint to resume from."
                if saving and "checkpoint" not in reason
                else "."
            )
        )
        if saving:
            self.checkpointer.save_full(self.step)  # not the end: a later run resumes from it
            self._take_save_times()
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
        if agreed is not None:  # a signal, spot notice or deadline: no time to wait for exports
            self.checkpointer.abandon_exports_at_close()  # `--resume` exports what is left
        record = getattr(self.metrics_processor, "record_stop", None)
        if record is not None:
            record(report)
        if not torch.distributed.is_initialized() or torch.distributed.get_rank() == 0:
            attach_report(self.config.dump_folder, STOP, report)

    def should_continue_training(self) -> bool:
        return self.at_step_boundary()


def _rank() -> int:
    return torch.distributed.get_rank() if torch.distributed.is_initialized() else 0
