"""The rules a plan is checked by, one function each: parallel degrees (torchtitan's own
`ParallelDims`, its refusal said in our words), the global batch, the ranges of config values,
the loss's chunks, `--stop-after`, the compile backend, the model's positions, the layouts a
model cannot train (`check_layout`). `check_plan` applies them all to the config every rank will
build, so a value is checked the same whether it came from one of our flags or from a
torchtitan override. Each refusal is a `LaunchError` of one sentence naming the fix.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

from qwentitan.launch.base.errors import LaunchError
from qwentitan.launch.base.target import Topology

if TYPE_CHECKING:
    from torchtitan.distributed.parallel_dims import ParallelDims

__all__ = [
    "NEURON_COMPILE_BACKEND",
    "check_compile",
    "check_global_batch",
    "check_layout",
    "check_loss_chunks",
    "check_pipeline_microbatches",
    "check_ranges",
    "check_stop_after",
    "max_positions",
    "parallel_dims",
    "scaled_global_batch",
]

# torch.compile's backend on Neuron (TorchNeuron registers it); torchtitan's default is inductor.
NEURON_COMPILE_BACKEND = "neuron"


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


# torch's single-stage schedules that need a microbatch per stage (`Schedule1F1B.__init__`).
_MICROBATCH_PER_STAGE = ("1f1b",)
# More microbatches per optimizer step than this is a typo, not a plan (each is a forward and a
# backward on every rank: `--global-batch-size 1000000000000` would never finish its first step).
MAX_ACCUMULATION = 65536


def check_pipeline_microbatches(config: Any, pp: int) -> None:
    """torchtitan splits each local batch into microbatches of `pipeline_parallel_microbatch_size`
    for the pipeline schedule, which every rank then refuses with a traceback when they do not
    divide it or (1F1B) are fewer than the stages."""
    if pp < 2:
        return
    local = config.training.local_batch_size
    size = config.parallelism.pipeline_parallel_microbatch_size
    schedule = config.parallelism.pipeline_parallel_schedule
    if size < 1 or local % size:
        raise LaunchError(
            f"{{local_batch_size}} {local} does not split into pipeline microbatches of "
            f"{size} (--parallelism.pipeline-parallel-microbatch-size); pass {{local_batch_size}} "
            f"{max(size, 1) * pp} or another multiple of {max(size, 1)}.",
            field="local_batch_size",
        )
    if schedule.lower() in _MICROBATCH_PER_STAGE and local // size < pp:
        raise LaunchError(
            f"Pipeline parallelism {pp} with the {schedule} schedule needs at least {pp} "
            f"microbatches per local batch, and {{local_batch_size}} {local} holds {local // size} "
            f"of size {size}; pass {{local_batch_size}} {size * pp} or more, or a smaller {{pp}}.",
            field="local_batch_size",
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


def check_compile(config: Any, topology: Topology) -> None:
    """A compiled Neuron run needs the `neuron` backend (the plan's placement overrides name it:
    torchtitan's default, inductor, does not target Neuron) and no NKI kernels in its model."""
    if topology.device_type != "neuron" or not config.compile.enable:
        return
    if config.compile.backend != NEURON_COMPILE_BACKEND:
        raise LaunchError(
            f"Compile backend {config.compile.backend!r} does not target {topology.name}; pass "
            f"--compile.backend {NEURON_COMPILE_BACKEND} or leave it out."
        )
    check_compile_with_nki(config, topology)


def check_compile_with_nki(config: Any, topology: Topology) -> None:
    """A compiled Neuron run whose model launches NKI kernels needs `nki_op`: "How to work with
    NKI kernels from torch-neuronx" (Neuron SDK 2.33) documents it (SDK 2.33 and later) as the
    registration of NKI kernels in PyTorch custom ops, eager and inside
    `torch.compile(backend="neuron")`, and qwentitan's ops register their NKI implementations
    through it where this host's torch-neuronx has it (`qwentitan.kernels.neuron_dispatch`).
    Without it (or without torch-neuronx here) such a run is refused."""
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


def scaled_global_batch(recipe_batch: int, nodes: int) -> int | None:
    """The global batch N nodes take of a recipe written for one instance: N times its own, with
    the same gradient accumulation; None where nothing scales (one node, or a recipe without one,
    which takes one local batch per data-parallel rank, torchtitan's default)."""
    return recipe_batch * nodes if nodes > 1 and recipe_batch > 0 else None


def check_global_batch(
    batch: int, *, local: int, batch_ranks: int, source: str = "{global_batch_size}"
) -> None:
    """Samples per optimizer step must be whole local batches on every data-parallel rank;
    `source` says where `batch` came from."""
    micro = local * batch_ranks
    if batch > micro * MAX_ACCUMULATION:
        raise LaunchError(
            f"Global batch {batch} would take {batch // micro} microbatches per optimizer step "
            f"on each of {batch_ranks} data-parallel rank(s) (local batch {local}), more "
            f"than {MAX_ACCUMULATION}; pass {{global_batch_size}} {micro * MAX_ACCUMULATION} or "
            "less.",
            field="global_batch_size",
        )
    if batch > 0 and batch % micro:
        fits = max(micro, round(batch / micro) * micro)
        raise LaunchError(
            f"Global batch {batch} is not a multiple of local batch {local} x {batch_ranks} "
            f"data-parallel ranks = {micro} ({source}); pass {{global_batch_size}} {fits} "
            f"(or another multiple of {micro}).",
            field="global_batch_size",
        )


def parallel_dims(parallelism: Any, world: int, topology: Topology) -> ParallelDims:
    """torchtitan's own `ParallelDims` of the config on `world` ranks, which every rank builds
    too: its validation is the check, its refusal (an assertion) said here in one sentence."""
    from torchtitan.distributed.parallel_dims import ParallelDims

    try:
        dims = ParallelDims.from_config(parallelism, world)
    except AssertionError:
        raise _degrees_refusal(parallelism, world, topology) from None
    dense = dims.dp_shard * dims.cp * dims.tp
    if dense % dims.ep:  # torchtitan finds this only when it builds the expert mesh
        raise LaunchError(
            f"Expert parallelism {dims.ep} does not divide FSDP x CP x TP = {dense} on "
            f"{_where(world, topology)}; choose {{ep}} dividing {dense}.",
            field="ep",
        )
    return dims


def _where(world: int, topology: Topology) -> str:
    return f"{world} ranks ({topology.name}, LNC {topology.lnc})"


def _degrees_refusal(p: Any, world: int, topology: Topology) -> LaunchError:
    """What torchtitan's ParallelDims refused, named by the flags that set it."""
    tp, cp, pp = p.tensor_parallel_degree, p.context_parallel_degree, p.pipeline_parallel_degree
    rep, shard, ep = (
        p.data_parallel_replicate_degree,
        p.data_parallel_shard_degree,
        p.expert_parallel_degree,
    )
    for name, value in (("{tp}", tp), ("{ep}", ep), ("context parallel", cp), ("{pp}", pp)):
        if value < 1:
            field = name.strip("{}") if name.startswith("{") else None
            return LaunchError(
                f"Parallel degree {name} must be at least 1, not {value}.", field=field
            )
    others = tp * cp * pp * rep
    where = _where(world, topology)
    if shard == -1:
        # Name the settings that were raised (`--dp-replicate 3` alone: that one), not always TP.
        raised = [(flag, field) for flag, field, value in (
            ("{tp}", "tp", tp), (_SETTINGS["CP"], None, cp), ("{pp}", "pp", pp),
            ("{dp_replicate}", "dp_replicate", rep)) if value > 1] or [("{tp}", "tp")]  # fmt: skip
        flags = " and ".join(flag for flag, _ in raised)
        fix = f"{flags} dividing" if len(raised) == 1 else f"{flags} whose product divides"
        return LaunchError(
            f"TP {tp} x CP {cp} x PP {pp} x DP-replicate {rep} = {others} does not divide the "
            f"world size of {where}; choose {fix} {world}.",
            field=next((field for _, field in raised if field), "tp"),
        )
    product = shard * others
    if ep > 1 and product * ep == world:
        # `--fsdp 2 --ep 2` on 4 ranks: EP is carved out of FSDP x CP x TP, it adds no ranks.
        return LaunchError(
            f"Expert parallelism borrows its ranks from FSDP x CP x TP instead of adding its own, "
            f"so FSDP {shard} x EP {ep} covers {product} ranks, not {world}; pass {{fsdp}} "
            f"{shard * ep} {{ep}} {ep} to shard the experts {ep} ways within FSDP {shard * ep}.",
            field="ep",
        )
    return LaunchError(
        f"FSDP {shard} x TP {tp} x CP {cp} x PP {pp} x DP-replicate {rep} = {product} is not the "
        f"world size of {where}; drop {{fsdp}} to let it fill the remaining ranks, or make the "
        f"product {world}.",
        field="fsdp",
    )


# How a sentence names each degree's setting: a request field, or (CP, which the request does
# not hold) torchtitan's own override.
_SETTINGS = {
    "TP": "{tp}",
    "PP": "{pp}",
    "EP": "{ep}",
    "CP": "--parallelism.context-parallel-degree",
}


def check_layout(config: Any, dims: ParallelDims, topology: Topology, recipe: str) -> None:
    """Refuse before any rank starts a layout the recipe's model cannot train (torchtitan and
    qwentitan.modeling would refuse it only inside every rank, with a traceback)."""
    check_hf_layout(config, dims, recipe)
    check_context_parallel(config, dims, topology)
    check_pipeline_tying(config, dims, recipe)


def check_hf_layout(config: Any, dims: ParallelDims, recipe: str) -> None:
    """The hf path (transformers' model) shards with FSDP and HSDP only."""
    asked = {"TP": dims.tp, "CP": dims.cp, "PP": dims.pp, "EP": dims.ep}
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


def check_context_parallel(config: Any, dims: ParallelDims, topology: Topology) -> None:
    """CP needs FlexAttention under torchtitan 0.3.0's multi-axis backends, and no CPU runs it."""
    cp = dims.cp
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


def check_pipeline_tying(config: Any, dims: ParallelDims, recipe: str) -> None:
    """A tied embedding and output head would sit in the first and the last pipeline stage."""
    pp = dims.pp
    if pp > 1 and getattr(config.model_spec.model, "enable_weight_tying", False):
        raise LaunchError(
            f"Recipe {recipe!r} ties its input embedding to its output head, which pipeline "
            f"parallelism {pp} would put in different stages; pass {{pp}} 1, or pick a recipe "
            "with untied embeddings (e.g. tiny_moe).",
            field="pp",
        )
