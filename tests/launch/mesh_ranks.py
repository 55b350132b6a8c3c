"""One rank of `test_every_mesh`'s checks on a 2-rank gloo world (run by torchrun):

- initial weights: tiny-dense parallelized by torchtitan's own `parallelize_qwen3` under FSDP 2
  and TP 2, initialised the way torchtitan's Trainer does (meta build, parallelize, `to_empty`,
  `init_weights`), once with qwentitan's `whole_init` and once without; rank 0 saves the
  gathered weights of each to OUT/<layout>-<init>.pt;
- expert tokens: rows sent to the other rank in uneven splits by `GlooAllToAllTokenDispatcher`'s
  exchanges and back, with their gradient, and gloo's own list all-to-all refusing those splits;
  each rank saves what it saw to OUT/exchange-<rank>.pt."""

from __future__ import annotations

import sys
from pathlib import Path
from types import SimpleNamespace

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor
from torchtitan.config import CompileConfig, ParallelismConfig, TrainingConfig
from torchtitan.distributed import utils as dist_utils
from torchtitan.distributed.parallel_dims import ParallelDims

from qwentitan.launch.runtime.platforms import get_platform, use_platform
from qwentitan.launch.runtime.whole_init import whole_init
from qwentitan.modeling import model_spec
from qwentitan.modeling.gloo_dispatch import GlooAllToAllTokenDispatcher

SEED = 0


def initial_weights(
    parallelism: ParallelismConfig, dims: ParallelDims, ours: bool
) -> dict[str, torch.Tensor]:
    spec = model_spec("tiny-dense")
    spec.model.update_from_config(config=SimpleNamespace(parallelism=parallelism))
    with torch.device("meta"):
        model = spec.model.build()
    model = spec.parallelize_fn(
        model, parallel_dims=dims, training=TrainingConfig(), parallelism=parallelism,
        compile_config=CompileConfig(), ac_config=None, dump_folder="",
    )  # fmt: skip
    model.to_empty(device="cpu")
    torch.manual_seed(SEED)  # what torchtitan's set_determinism gives every rank
    model.init_weights(buffer_device=None)
    if ours:  # what qwentitan's Trainer then does on CPU
        whole_init([model], spec.model, SEED, torch.float32)
    return {
        name: p.full_tensor() if isinstance(p, DTensor) else p.detach()
        for name, p in model.named_parameters()
    }


def exchange_uneven() -> dict[str, object]:
    """Rank r holds 3 + 2r rows numbered by rank; it sends 1 + r of them to rank 0, the rest to
    rank 1, through the dispatcher's exchanges (dispatch there, combine back)."""
    rank = dist.get_rank()
    rows = torch.arange(3 + 2 * rank, dtype=torch.float32)[:, None] + 100 * rank
    rows = rows.expand(-1, 4).clone().requires_grad_()
    send = [1 + rank, 2 + rank]
    receive = [1 + r if rank == 0 else 2 + r for r in range(2)]
    dispatcher = GlooAllToAllTokenDispatcher.Config(num_experts=4, top_k=1).build()
    group = dist.group.WORLD
    arrived = dispatcher._dispatch_token_exchange(rows, group, receive, send)
    back = dispatcher._combine_token_exchange(arrived * 2, group, receive, send)
    back.sum().backward()
    try:  # what spmd_types' uneven all-to-all calls, and gloo refuses
        chunks = list(torch.split(rows.detach(), send))
        dist.all_to_all([torch.empty(n, 4) for n in receive], chunks)
        gloo_lists = "took uneven chunks"
    except RuntimeError as error:
        gloo_lists = str(error)
    return {
        "arrived": arrived.detach()[:, 0].tolist(),
        "back": back.detach()[:, 0].tolist(),
        "grad": rows.grad[:, 0].tolist(),
        "gloo_lists": gloo_lists,
    }


def main(out: Path) -> None:
    dist.init_process_group("gloo")
    use_platform(get_platform("cpu"))
    for layout, tp in (("fsdp2", 1), ("tp2", 2)):
        parallelism = ParallelismConfig(data_parallel_shard_degree=-1, tensor_parallel_degree=tp)
        dims = ParallelDims.from_config(parallelism, dist.get_world_size())
        dist_utils.set_spmd_backend(parallelism.spmd_backend)
        for ours in (True, False):
            weights = initial_weights(parallelism, dims, ours)
            if dist.get_rank() == 0:
                init = "qwentitan" if ours else "torchtitan"
                torch.save(weights, out / f"{layout}-{init}.pt")
    torch.save(exchange_uneven(), out / f"exchange-{dist.get_rank()}.pt")
    dist.destroy_process_group()


if __name__ == "__main__":
    main(Path(sys.argv[1]))
