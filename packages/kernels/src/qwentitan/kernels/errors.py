"""The one exception a user of qwentitan.kernels can cause."""

from __future__ import annotations


class KernelError(ValueError):
    """A kernel input, configuration or replacement rule that cannot work; the message names the fix."""
