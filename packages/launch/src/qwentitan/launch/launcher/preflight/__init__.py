"""`qwentitan-launch preflight`: check everything that can go wrong before the expensive run.

Checks, in order: installed versions against the tested matrix, device count against ranks,
LNC consistency, the sequence-length rule, the weights folder (keys and shapes against the
flavor), an HF -> DCP -> HF round trip of those weights, each custom op of the recipe launched
once by the route it takes on this host (its route and largest difference from a reference), the
model's parameter init ops (no `trunc_normal_` on a neuron plan), an initialisation check (loss
with the loaded weights far below a random initialisation's), and free disk for the planned checkpoints. Checks that need the target device
are skipped, and named as skipped, on any other host.
"""

from qwentitan.launch.launcher.preflight.report import CheckResult, PreflightReport
from qwentitan.launch.launcher.preflight.run import run_preflight

__all__ = ["CheckResult", "PreflightReport", "run_preflight"]
