"""One node of a planned run: a `Target` with its LNC and ranks per node chosen.

The machine facts themselves live in `target` (one `Target` per kind); `INSTANCES` and
`Instance` are the names this module has always offered for that table.
"""

from __future__ import annotations

from dataclasses import dataclass

from qwentitan.launch.base.target import GIB, TARGETS, Target, get_target

__all__ = ["GIB", "INSTANCES", "Instance", "Topology", "get_topology"]

Instance = Target
INSTANCES = TARGETS


@dataclass(frozen=True, slots=True)
class Topology:
    """A Target with its LNC and ranks per node resolved: what one node of a run looks like."""

    target: Target
    lnc: int
    ranks_per_node: int
    memory_per_rank_bytes: int

    @property
    def instance(self) -> Target:
        return self.target

    @property
    def name(self) -> str:
        return self.target.name

    @property
    def device_type(self) -> str:
        return self.target.device_type

    @property
    def backend(self) -> str:
        return self.target.backend

    @property
    def physical_cores(self) -> int:
        return self.target.physical_cores

    @property
    def seq_len_multiple(self) -> int:
        return self.target.seq_len_multiple(self.lnc)

    def to_dict(self) -> dict[str, object]:
        return {
            "instance": self.name,
            "description": self.target.description,
            "device_type": self.device_type,
            "backend": self.backend,
            "lnc": self.lnc,
            "ranks_per_node": self.ranks_per_node,
            "memory_per_rank_gib": round(self.memory_per_rank_bytes / GIB, 2),
            "peak_tflops_per_rank": _tera(self.target.peak_flops(self.lnc)),
            "usd_per_hour": self.target.price_per_hour,
            "efa": self.target.efa,
        }


def _tera(flops: float | None) -> float | None:
    return None if flops is None else round(flops / 1e12, 1)


def get_topology(
    name: str, *, lnc: int | None = None, ranks_per_node: int | None = None
) -> Topology:
    """Resolve a Target's name (plus LNC for Trainium, ranks per node) to a checked Topology."""
    target = get_target(name)
    lnc = target.check_lnc(lnc)
    ranks = target.default_ranks(lnc) if ranks_per_node is None else ranks_per_node
    target.check_ranks(ranks, lnc)
    return Topology(target, lnc, ranks, target.memory_per_rank(lnc, ranks))
