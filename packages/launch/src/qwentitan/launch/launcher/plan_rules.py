"""The rules a plan is checked by, one function each: parallel degrees, the global batch, the
ranges of config values, the loss's chunks, `--stop-after`, the compile backend, the model's
positions, the layouts a model cannot train (`check_layout`). `resolve_plan` applies them all
to the config every rank will build, so a value is checked the same whether it came from one of
our flags or from a torchtitan override. Each
refusal is a `LaunchError` of one sentence naming the fix.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace
from typing import Any

from qwentitan.launch.base.errors import LaunchError
from qwentitan.launch.base.target import Topology

__all__ = [
    "NEURON_COMPILE_BACKEND",
    "ParallelDegrees",
    "check_compile_with_nki",
    "check_layout",
    "check_loss_chunks",
    "check_ranges",
    "check_stop_after",
    "compile_backend",
    "console_rank",
    "global_batch_size",
    "max_positions",
    "resolve_degrees",
]

# torch.compile's backend on Neuron (TorchNeuron registers it); torchtitan's default is inductor.
NEURON_COMPILE_BACKEND = "neuron"


@dataclass(frozen=True, slots=True)
class ParallelDegrees:
    """torchtitan's parallelism degrees, all resolved (no -1 left)."""

    data_parallel_shard: int
    data_parallel_replicate: int = 1
    tensor_parallel: int = 1
    context_parallel: int = 1
    pipeline_parallel: int = 1
    expert_parallel: int = 1

    def product(self) -> int:
        return (
            self.data_parallel_shard
            * self.data_parallel_replicate
            * self.tensor_parallel
            * self.context_parallel
            * self.pipeline_parallel
        )


def max_positions(model: Any) -> int | None:
    """The longest sequence the model's RoPE table holds (native: `max_seq_len`; hf: the
    flavor's); None when the model config says neither."""
    flavor = getattr(model, "flavor", None)
    if flavor is not None:
        return flavor.max_position_embeddings
    return getattr(model, "max_seq_len", None)


# Config values the run request range-checks, checked the same way when they come as
# torchtitan overrides: (path, lowest, the request field that sets it).
_RANGES = (
    ("training.steps", 1, "steps"),
    ("training.seq_len", 1, "seq_len"),
    ("training.local_batch_size", 1, "local_batch_size"),
    ("checkpoint.interval", 1, "checkpoint_interval"),
    ("validator.freq", 1, "validate_every"),
    ("parallelism.data_parallel_replicate_degree", 1, "dp_replicate"),
    ("stop_after", 1, "stop_after"),
)


def check_ranges(config: Any) -> None:
    for path, low, field in _RANGES:
        value: Any = config
        for name in path.split("."):
            value = getattr(value, name, None)
        if isinstance(value, int) and not isinstance(value, bool) and value < low:
            override = "--" + path.replace("_", "-")
            ours = f" (or {{{field}}})" if field != path else ""
            raise LaunchError(
                f"{override} {value} is out of range; pass a whole number of {low} or more "
                f"with {override}{ours}.",
                field=field,
            )
    batch = config.training.global_batch_size
    if batch < 1 and batch != -1:
        raise LaunchError(
            f"--training.global-batch-size {batch} is out of range; pass a whole number of 1 or "
            "more with {global_batch_size} (or -1: one local batch per data-parallel rank).",
            field="global_batch_size",
        )


def check_loss_chunks(config: Any, seq_len: int, context_parallel: int) -> None:
    """torchtitan's ChunkedLossWrapper splits each rank's sequence into `num_chunks` equal parts
    and asserts they are equal deep in the first step; refused here instead."""
    chunks = getattr(config.loss, "num_chunks", None)
    if not chunks:
        return
    local = seq_len // context_parallel
    if local % chunks:
        fits = -(-seq_len // (chunks * context_parallel)) * chunks * context_parallel
        raise LaunchError(
            f"{{seq_len}} {seq_len} does not split into the loss's {chunks} chunks "
            f"(ChunkedLossWrapper, --loss.num-chunks) on each of {context_parallel} "
            f"context-parallel rank(s); pass {{seq_len}} {fits} or another multiple of "
            f"{chunks * context_parallel}.",
            field="seq_len",
        )


def check_stop_after(config: Any, resume: str) -> None:
    """`stop_after` must fall after the step the run resumes from and before its last step."""
    stop_after = getattr(config, "stop_after", None)
    if stop_after is None:
        return
    steps = config.training.steps
    if stop_after >= steps:
        raise LaunchError(
            f"{{stop_after}} {stop_after} is not before the last step {steps}; pass "
            f"{{stop_after}} {steps - 1} or less, or raise {{steps}}.",
            field="stop_after",
        )
    if resume == "fresh" or not config.checkpoint.enable:
        return
    from qwentitan.launch.launcher.resume import saved_steps

    folder = Path(config.dump_folder) / config.checkpoint.folder
    saved = saved_steps(folder)
    if saved and stop_after <= saved[-1]:
        raise LaunchError(
            f"{{stop_after}} {stop_after} is not after step {saved[-1]}, where the run resumes "
            f"from {folder}; pass {{stop_after}} {saved[-1] + 1} or more.",
            field="stop_after",
        )


def compile_backend(config: Any, topology: Topology, overrides: list[str]) -> str | None:
    """The compile backend the plan must add: `neuron` for a compiled Neuron run (torchtitan's
    default, inductor, does not target Neuron); None when nothing is to be added."""
    if topology.device_type != "neuron" or not config.compile.enable:
        return None
    if config.compile.backend == NEURON_COMPILE_BACKEND:
        return None
    named = any(word.split("=")[0] in ("--compile.backend",) for word in overrides)
    if named or config.compile.backend != "inductor":
        raise LaunchError(
            f"Compile backend {config.compile.backend!r} does not target {topology.name}; pass "
            f"--compile.backend {NEURON_COMPILE_BACKEND} or leave it out."
        )
    return NEURON_COMPILE_BACKEND


def check_compile_with_nki(config: Any, topology: Topology) -> None:
    """A compiled Neuron run whose model launches NKI kernels needs `nki_op`: "How to work with
    NKI kernels from torch-neuronx" (Neuron SDK 2.33) documents it (SDK 2.33 and later) as the
    registration of NKI kernels in PyTorch custom ops, eager and inside
    `torch.compile(backend="neuron")`, and qwentitan's ops register their NKI implementations
    through it where this host's torch-neuronx has it (`qwentitan.kernels.neuron_dispatch`).
    Without it (or without torch-neuronx here) such a run is refused. Called by
    `plan_from_overrides` beside `compile_backend`."""
    spec = getattr(config, "model_spec", None)
    if topology.device_type != "neuron" or not config.compile.enable or spec is None:
        return
    from qwentitan.modeling.kernel_path import rules_in

    nki_ops = sorted({rule.op for rule in rules_in(spec.model) if rule.use_nki and rule.op})
    if nki_ops:
        from qwentitan.kernels import nki_loader

        if nki_loader.has_nki_op():
            return
        raise LaunchError(
            f"--compile.enable with qwentitan's NKI kernels ({', '.join(nki_ops)}) on "
            f"{topology.name} needs torch-neuronx's nki_op (Neuron SDK 2.33 or later), which "
            "this host lacks (its torch-neuronx has none, or it has no torch-neuronx), so they "
            "run in eager mode only; plan on the Neuron host with SDK 2.33+, drop --compile.enable, "
            "or choose their reference twins (`-- --kernels rope=reference,experts=reference`)."
        )


def global_batch_size(
    recipe_batch: int, *, local: int, batch_ranks: int, nodes: int, pinned: bool
) -> int:
    """Samples per optimizer step: pinned by the request, else it follows the world size.

    A recipe's global batch is what one node takes (it is written for one instance), so N nodes
    take N times it with the same gradient accumulation; a recipe without one takes one local
    batch per data-parallel rank (torchtitan's default).
    """
    micro = local * batch_ranks
    if pinned:
        batch, source = recipe_batch, "{global_batch_size}"
    elif recipe_batch > 0:
        batch = recipe_batch * nodes
        source = f"the recipe's {recipe_batch} per node x {nodes} node{'s' * (nodes > 1)}"
    else:
        return micro
    if batch % micro:
        fits = max(micro, round(batch / micro) * micro)
        raise LaunchError(
            f"Global batch {batch} is not a multiple of local batch {local} x {batch_ranks} "
            f"data-parallel ranks = {micro} ({source}); pass {{global_batch_size}} {fits} "
            f"(or another multiple of {micro}).",
            field="global_batch_size",
        )
    return batch


def resolve_degrees(parallelism: Any, world: int, topology: Topology) -> ParallelDegrees:
    tp = parallelism.tensor_parallel_degree
    cp = parallelism.context_parallel_degree
    pp = parallelism.pipeline_parallel_degree
    rep = parallelism.data_parallel_replicate_degree
    shard = parallelism.data_parallel_shard_degree
    ep = parallelism.expert_parallel_degree
    for name, value in (("{tp}", tp), ("{ep}", ep), ("context parallel", cp), ("{pp}", pp)):
        if value < 1:
            field = name.strip("{}") if name.startswith("{") else None
            raise LaunchError(
                f"Parallel degree {name} must be at least 1, not {value}.", field=field
            )
    others = tp * cp * pp * rep
    where = f"{world} ranks ({topology.name}, LNC {topology.lnc})"
    if shard == -1:
        if world % others:
            raise LaunchError(
                f"TP {tp} x CP {cp} x PP {pp} x DP-replicate {rep} = {others} does not divide the "
                f"world size of {where}; choose {{tp}} dividing {world}.",
                field="tp",
            )
        shard = world // others
    degrees = ParallelDegrees(shard, rep, tp, cp, pp, ep)
    _check_expert_ranks(degrees, world)
    if degrees.product() != world:
        raise LaunchError(
            f"FSDP {shard} x TP {tp} x CP {cp} x PP {pp} x DP-replicate {rep} = "
            f"{degrees.product()} is not the world size of {where}; "
            f"drop {{fsdp}} to let it fill the remaining ranks, or make the product {world}.",
            field="fsdp",
        )
    dense = shard * cp * tp
    if dense % ep:
        raise LaunchError(
            f"Expert parallelism {ep} does not divide FSDP x CP x TP = {dense} on {where}; "
            f"choose {{ep}} dividing {dense}.",
            field="ep",
        )
    return degrees


def _check_expert_ranks(degrees: ParallelDegrees, world: int) -> None:
    """`--fsdp 2 --ep 2` on 4 ranks: EP is carved out of FSDP x CP x TP, it adds no ranks."""
    product, ep = degrees.product(), degrees.expert_parallel
    if ep > 1 and product != world and product * ep == world:
        fsdp = degrees.data_parallel_shard * ep
        raise LaunchError(
            f"Expert parallelism borrows its ranks from FSDP x CP x TP instead of adding its own, "
            f"so FSDP {degrees.data_parallel_shard} x EP {ep} covers {product} ranks, not "
            f"{world}; pass {{fsdp}} {fsdp} {{ep}} {ep} to shard the experts {ep} ways within "
            f"FSDP {fsdp}.",
            field="ep",
        )


# How a sentence names each degree's setting: a request field, or (CP, which the request does
# not hold) torchtitan's own override.
_SETTINGS = {
    "TP": "{tp}",
    "PP": "{pp}",
    "EP": "{ep}",
    "CP": "--parallelism.context-parallel-degree",
}


def check_layout(config: Any, degrees: ParallelDegrees, topology: Topology, recipe: str) -> None:
    """Refuse before any rank starts a layout the recipe's model cannot train (torchtitan and
    qwentitan.modeling would refuse it only inside every rank, with a traceback)."""
    check_hf_layout(config, degrees, recipe)
    check_context_parallel(config, degrees, topology)
    check_pipeline_tying(config, degrees, recipe)


def check_hf_layout(config: Any, degrees: ParallelDegrees, recipe: str) -> None:
    """The hf path (transformers' model) shards with FSDP and HSDP only."""
    asked = {
        "TP": degrees.tensor_parallel,
        "CP": degrees.context_parallel,
        "PP": degrees.pipeline_parallel,
        "EP": degrees.expert_parallel,
    }
    bad = {name: value for name, value in asked.items() if value > 1}
    if not bad:
        return
    from qwentitan.modeling.hf_path import HFQwen3Model  # transformers: only when asked

    if not isinstance(config.model_spec.model, HFQwen3Model.Config):
        return
    layout = " x ".join(f"{name} {value}" for name, value in bad.items())
    settings = " and ".join(f"{_SETTINGS[name]} 1" for name in bad)
    raise LaunchError(
        f"Recipe {recipe!r} trains transformers' own model (the hf path), which shards with "
        f"FSDP only, not {layout}; pass {settings}, or train a native-path recipe "
        "(torchtitan's model, e.g. tiny_dense) for that layout.",
        field=next((name.lower() for name in bad if name != "CP"), None),
    )


def check_context_parallel(config: Any, degrees: ParallelDegrees, topology: Topology) -> None:
    """CP needs FlexAttention under torchtitan 0.3.0's multi-axis backends, and no CPU runs it."""
    cp = degrees.context_parallel
    if cp == 1:
        return
    if topology.device_type == "cpu":
        raise LaunchError(
            f"Context parallelism {cp} does not train on CPU (torchtitan runs it with "
            "FlexAttention, which has no CPU backward, or SDPA, whose CPU flash kernel has no "
            f"DTensor rule); pass {_SETTINGS['CP']} 1 here."
        )
    attention = getattr(
        getattr(config.model_spec.model, "first_attention", None), "inner_attention", None
    )
    backend = config.parallelism.spmd_backend
    if backend != "partial_dtensor" and "FlexAttention" not in type(attention).__qualname__:
        raise LaunchError(
            f"Context parallelism {cp} runs only with FlexAttention under torchtitan's "
            f"{backend!r} backend, and this model's attention on {topology.name} is "
            f"{type(attention).__qualname__.split('.')[0]}; pass {_SETTINGS['CP']} 1."
        )


def check_pipeline_tying(config: Any, degrees: ParallelDegrees, recipe: str) -> None:
    """A tied embedding and output head would sit in the first and the last pipeline stage."""
    pp = degrees.pipeline_parallel
    if pp > 1 and getattr(config.model_spec.model, "enable_weight_tying", False):
        raise LaunchError(
            f"Recipe {recipe!r} ties its input embedding to its output head, which pipeline "
            f"parallelism {pp} would put in different stages; pass {{pp}} 1, or pick a recipe "
            "with untied embeddings (e.g. tiny_moe).",
            field="pp",
        )


def console_rank(degrees: ParallelDegrees, pp_schedule: str, ranks_per_node: int) -> int:
    """The local rank whose lines the console shows (torchrun's `--local-ranks-filter`):
    torchtitan's metrics rank, on its node. Under PP that is the first rank of the last stage,
    the only one that has the loss (the first stage logs -1); else rank 0."""
    from torchtitan.components.metrics import _get_metrics_rank

    pp = degrees.pipeline_parallel
    dims = SimpleNamespace(pp_enabled=pp > 1, pp=pp, world_size=degrees.product())
    return _get_metrics_rank(parallel_dims=dims, pp_schedule=pp_schedule) % ranks_per_node
