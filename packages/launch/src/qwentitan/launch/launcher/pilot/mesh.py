"""The mesh pilot's pairs: each layout of a tiny recipe against its baseline, every child from
its recipe's own seeded initialisation, on the same global batch (plain data, no torch).

`qwentitan-launch pilot --mesh` trains them: tiny_dense under 1 rank (the baseline), FSDP 2,
TP 2, FSDP 2 x TP 2 and HSDP 2 x 2; tiny_dense_untied under PP 2 against its own 1 rank (a tied
model cannot be split into pipeline stages); tiny_moe and tiny_moe_kernels under FSDP 2, EP 2
(FSDP 2 x EP 2 on 2 ranks) and FSDP 4 x EP 2, and tiny_moe under FSDP 2 x TP 2 (the CPU twin
of the trn2 MoE recipe `qwen3_30b_a3b_tp4_fsdp16`: torchtitan's grouped experts under tensor
parallelism), against tiny_moe under FSDP 2.
"""

from __future__ import annotations

from qwentitan.launch.launcher.pilot.compare import Layout, Pair

# Each child's placement; the request fields not named here are at their defaults (FSDP over
# the ranks the others leave).
LAYOUTS: dict[str, Layout] = {
    "1-rank": (("ranks_per_node", 1),),
    "fsdp2": (("ranks_per_node", 2), ("fsdp", 2)),
    "tp2": (("ranks_per_node", 2), ("tp", 2)),
    "fsdp2-tp2": (("ranks_per_node", 4), ("fsdp", 2), ("tp", 2)),
    "hsdp2x2": (("ranks_per_node", 4), ("dp_replicate", 2), ("fsdp", 2)),
    "pp2": (("ranks_per_node", 2), ("pp", 2)),
    "ep2": (("ranks_per_node", 2), ("ep", 2)),
    "fsdp4-ep2": (("ranks_per_node", 4), ("fsdp", 4), ("ep", 2)),
}
# The request fields a layout sets: the pilot's own request must leave them to it.
DEGREES = ("tp", "fsdp", "ep", "pp", "dp_replicate")
# Every child's global batch, whatever its data-parallel degree: 8 windows of local batch 2 are
# 4 microbatches on 1 rank and 1 on 4 data-parallel ranks.
MESH_GLOBAL_BATCH = 8
MESH_LOCAL_BATCH = 2
# Float32 end to end: a layout changes only the order of float32 sums (dense). The router's
# top-k may flip on a near-tie, and the kernel experts are another implementation (MoE).
DENSE_LIMIT = 1e-4
MOE_LIMIT = 1e-3
# The MoE under tensor parallelism: TP reorders the experts' sums, and the flips of top-k on
# near-ties it causes compound. Measured (2026-12-07, `pilot --pair tiny_moe.fsdp2-tp2`): 2.9e-4
# over 10 steps, 2.9e-3 at step 19 of 20, while FSDP 2 against 1 rank reached 1.7e-4.
MOE_TP_LIMIT = 5e-3


def _child(recipe: str, layout: str) -> str:
    return f"{recipe}.{layout}"


def _pair(baseline: tuple[str, str], other: tuple[str, str], limit: float) -> Pair:
    """`other` (recipe, layout) against `baseline`; named after `other`."""
    (left_recipe, left), (right_recipe, right) = baseline, other
    return Pair(
        _child(right_recipe, right),
        None,
        (_child(left_recipe, left), _child(right_recipe, right)),
        (left_recipe, right_recipe),
        limit,
        (LAYOUTS[left], LAYOUTS[right]),
        kind="layout",
    )


_DENSE = ("tiny_dense", "1-rank")
_UNTIED = ("tiny_dense_untied", "1-rank")
_MOE = ("tiny_moe", "fsdp2")

MESH: dict[str, Pair] = {
    pair.name: pair
    for pair in (
        *(_pair(_DENSE, ("tiny_dense", layout), DENSE_LIMIT)
          for layout in ("fsdp2", "tp2", "fsdp2-tp2", "hsdp2x2")),
        _pair(_UNTIED, ("tiny_dense_untied", "pp2"), DENSE_LIMIT),
        *(_pair(_MOE, (recipe, layout), MOE_LIMIT)
          for recipe in ("tiny_moe", "tiny_moe_kernels")
          for layout in ("fsdp2", "ep2", "fsdp4-ep2")
          if (recipe, layout) != _MOE),
        _pair(_MOE, ("tiny_moe", "fsdp2-tp2"), MOE_TP_LIMIT),
    )
}  # fmt: skip
