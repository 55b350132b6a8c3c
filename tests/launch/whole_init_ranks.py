"""One rank of `test_every_mesh`'s initial-weights check (run by torchrun, 2 ranks over gloo):
tiny-dense parallelized by torchtitan's own `parallelize_qwen3` under FSDP 2 and TP 2,
initialised the way torchtitan's Trainer does (meta build, parallelize, `to_empty`,
`init_weights`), once with qwentitan's `whole_init` and once without; rank 0 saves the gathered
weights of each to OUT/<layout>-<init>.pt."""

from __future__ import annotations

import sys
from pathlib import Path
from types import SimpleNamespace

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor
from torchtitan.config import CompileConfig, ParallelismConfig, TrainingConfig
from torchtitan.config.configs import DebugConfig
from torchtitan.distributed import utils as dist_utils
from torchtitan.distributed.parallel_dims import ParallelDims

from qwentitan.launch.runtime.platforms import get_platform
from qwentitan.launch.runtime.trainer import use_platform
from qwentitan.launch.runtime.whole_init import whole_init
from qwentitan.modeling import model_spec

SEED = 0


def initial_weights(
    parallelism: ParallelismConfig, dims: ParallelDims, ours: bool
) -> dict[str, torch.Tensor]:
    spec = model_spec("tiny-dense")
    spec.model.update_from_config(config=SimpleNamespace(parallelism=parallelism))
    if ours:
        config = SimpleNamespace(
            debug=DebugConfig(seed=SEED), model_spec=spec, training=TrainingConfig()
        )
        whole_init(config)
    with torch.device("meta"):
        model = spec.model.build()
    model = spec.parallelize_fn(
        model, parallel_dims=dims, training=TrainingConfig(), parallelism=parallelism,
        compile_config=CompileConfig(), ac_config=None, dump_folder="",
    )  # fmt: skip
    model.to_empty(device="cpu")
    torch.manual_seed(SEED)  # what torchtitan's set_determinism gives every rank
    model.init_weights(buffer_device=None)
    return {
        name: p.full_tensor() if isinstance(p, DTensor) else p.detach()
        for name, p in model.named_parameters()
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
    dist.destroy_process_group()


if __name__ == "__main__":
    main(Path(sys.argv[1]))
