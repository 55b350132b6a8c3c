"""`PausableValidator`: torchtitan's `Validator`, which skips a validation when a stop is pending.

A recipe sets `validator=PausableValidator.Config(...)` (torchtitan's fields). The Trainer tells
it how to ask whether the run is stopping (`pause_when`): a signal, a spot notice or the
`--stop-by` budget on any rank. A validation then skipped lets the checkpoint at the step
boundary right after it come first.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, fields

from torch import nn
from torchtitan.components.validate import Validator
from torchtitan.tools.logging import logger

__all__ = ["PausableValidator", "pausable"]


class PausableValidator(Validator):
    """torchtitan's validator, paused while a stop is pending."""

    @dataclass(kw_only=True, slots=True)
    class Config(Validator.Config):
        pass  # torchtitan's fields; its own class, so that `build()` makes this validator

    stopping: Callable[[], bool] | None = None

    def pause_when(self, stopping: Callable[[], bool]) -> None:
        """Skip each validation for which `stopping()` (a collective: every rank calls it) is
        True."""
        self.stopping = stopping

    def validate(self, model_parts: list[nn.Module], step: int) -> None:
        if self.stopping is not None and self.stopping():
            logger.info(f"Validation of step {step} skipped: a stop signal is pending.")
            return
        super().validate(model_parts, step)


def pausable(config: Validator.Config) -> PausableValidator.Config:
    """`config` (torchtitan's own recipe's, say) as a `PausableValidator.Config`."""
    return PausableValidator.Config(
        **{f.name: getattr(config, f.name) for f in fields(config) if f.init}
    )
