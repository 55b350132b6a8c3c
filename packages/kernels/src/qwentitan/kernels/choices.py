"""The per-kernel switch: which implementation each replaceable module of a model uses.

Three choices per kernel (`rope`, `attention`, `experts`):
- `nki`: the `qwentitan::` op, an NKI kernel on a `neuron` device and the reference twin
  elsewhere;
- `reference`: the same op with its reference twin on every device, the fallback when one NKI
  kernel fails on a paid run (the twin runs as plain PyTorch ops on the neuron device);
- `torchtitan`: the module is not replaced.
Defaults: NKI for RoPE and the experts; torchtitan's own attention, whose SDPA call TorchNeuron
already sends to NKI flash kernels (packages/kernels/README.md, "Attention on neuron").
The environment variable QWENTITAN_KERNELS overrides the defaults, e.g.
`QWENTITAN_KERNELS=experts=reference,attention=nki`; a caller that carries the choice itself
(qwentitan.launch's `Trainer.Config.kernels`) parses the same text with `KernelChoices.parse`.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping

from qwentitan.kernels.env import KERNEL_CHOICES_ENV, kernel_choices_text
from qwentitan.kernels.errors import KernelError

CHOICES = ("nki", "reference", "torchtitan")


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class KernelChoices:
    """One of `nki`, `reference`, `torchtitan` per replaceable kernel."""

    rope: str = "nki"
    attention: str = "torchtitan"
    experts: str = "nki"

    def __post_init__(self) -> None:
        for kernel, choice in self.items():
            if choice not in CHOICES:
                raise KernelError(
                    f"kernel choice {kernel}={choice!r} is not one of {', '.join(CHOICES)}; "
                    f"fix it in {KERNEL_CHOICES_ENV} or the KernelChoices you pass."
                )

    def items(self) -> list[tuple[str, str]]:
        return [(f.name, getattr(self, f.name)) for f in dataclasses.fields(self)]

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None) -> KernelChoices:
        """The defaults with `QWENTITAN_KERNELS` (comma-separated kernel=choice) applied."""
        return cls.parse(kernel_choices_text(environ))

    @classmethod
    def parse(cls, raw: str, source: str = KERNEL_CHOICES_ENV) -> KernelChoices:
        """The defaults with `raw` (comma-separated kernel=choice pairs, as `QWENTITAN_KERNELS`
        takes them) applied; a refusal names `source`, where the text came from."""
        kernels = [f.name for f in dataclasses.fields(cls)]
        chosen: dict[str, str] = {}
        for item in filter(None, (part.strip() for part in raw.split(","))):
            kernel, sep, choice = item.partition("=")
            if not sep or kernel.strip() not in kernels or choice.strip() not in CHOICES:
                raise KernelError(
                    f"{source}={raw!r} has {item!r}; write comma-separated "
                    f"kernel=choice pairs with kernel in {', '.join(kernels)} and choice in "
                    f"{', '.join(CHOICES)}, e.g. experts=reference."
                )
            chosen[kernel.strip()] = choice.strip()
        return cls(**chosen)
