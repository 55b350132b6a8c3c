"""torchtitan's expert-parallel token exchange on gloo process groups (the CPU rehearsal).

torchtitan 0.3.0's `AllToAllTokenDispatcher` moves tokens between expert-parallel ranks with
spmd_types' uneven all-to-all, which calls `torch.distributed.all_to_all` on lists of chunks.
gloo's list all-to-all takes chunks of one size only ("ProcessGroupGloo::alltoall: invalid
tensor size at index 1"), so expert parallelism over gloo fails as soon as two ranks send each
other different numbers of tokens: it ran only while every rank's shard of the router was the
same draw, which routed each token to expert e and e + E/2 alike and made the chunks equal.
`GlooAllToAllTokenDispatcher` exchanges the same splits through `all_to_all_single` (gloo's
`alltoall_base`, which takes split sizes), differentiably; everything else is torchtitan's.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch
from torch.distributed._functional_collectives import all_to_all_single_autograd
from torchtitan.models.common.token_dispatcher import AllToAllTokenDispatcher

__all__ = ["GlooAllToAllTokenDispatcher", "with_gloo_token_dispatch"]


class GlooAllToAllTokenDispatcher(AllToAllTokenDispatcher):
    """`AllToAllTokenDispatcher` whose token exchanges take uneven splits on gloo."""

    @dataclasses.dataclass(kw_only=True, slots=True)
    class Config(AllToAllTokenDispatcher.Config):
        pass

    def _dispatch_token_exchange(
        self,
        routed_input_ND: torch.Tensor,
        pg: Any,
        output_splits: list[int],
        input_splits: list[int],
    ) -> torch.Tensor:
        return all_to_all_single_autograd(routed_input_ND, output_splits, input_splits, pg)

    def _combine_token_exchange(
        self,
        routed_output_RD: torch.Tensor,
        pg: Any,
        input_splits: list[int],
        output_splits: list[int],
    ) -> torch.Tensor:
        return all_to_all_single_autograd(routed_output_RD, input_splits, output_splits, pg)


def with_gloo_token_dispatch(model_config: Any) -> Any:
    """`model_config` (a torchtitan decoder config) with every MoE layer's all-to-all token
    dispatcher exchanging through `GlooAllToAllTokenDispatcher`; changed in place, returned."""
    for layer in model_config.layers:
        routed = getattr(getattr(layer, "moe", None), "routed_experts", None)
        dispatcher = getattr(routed, "token_dispatcher", None)
        if type(dispatcher) is AllToAllTokenDispatcher.Config:
            fields = {
                f.name: getattr(dispatcher, f.name)
                for f in dataclasses.fields(dispatcher)
                if f.init
            }
            routed.token_dispatcher = GlooAllToAllTokenDispatcher.Config(**fields)
    return model_config
