"""The rules a plan is checked by, one function each: parallel degrees, the global batch, the
ranges of config values, the loss's chunks, `--stop-after`, the compile backend, the model's
positions. `resolve_plan` applies them all to the config every rank will build, so a value is
checked the same whether it came from one of our flags or from a torchtitan override. Each
refusal is a `LaunchError` of one sentence naming the fix.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from qwentitan.launch.base.errors import LaunchError
from qwentitan.launch.base.target import Topology

__all__ = [
    "NEURON_COMPILE_BACKEND",
    "ParallelDegrees",
    "check_compile_with_nki",
    "check_loss_chunks",
    "check_ranges",
    "check_stop_after",
    "compile_backend",
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
    """A compiled Neuron run whose model launches NKI kernels is refused: torch-neuronx runs an
    NKI kernel inside `torch.compile` only when it is registered with `nki_op` ("How to work
    with NKI kernels from torch-neuronx", Neuron SDK 2.33), and qwentitan's custom ops call
    their `@nki.jit` kernels plainly, which TorchNeuron documents for eager mode, the mode AWS's
    MoE kernels example runs. Called by `plan_from_overrides` beside `compile_backend`."""
    spec = getattr(config, "model_spec", None)
    if topology.device_type != "neuron" or not config.compile.enable or spec is None:
        return
    from qwentitan.modeling.kernel_path import rules_in

    nki_ops = sorted({rule.op for rule in rules_in(spec.model) if rule.use_nki and rule.op})
    if nki_ops:
        raise LaunchError(
            f"--compile.enable with qwentitan's NKI kernels ({', '.join(nki_ops)}) is not "
            f"supported on {topology.name}: they are not registered with nki_op, so they run in eager mode "
            "only (as AWS's MoE kernels example runs); drop --compile.enable, or choose their "
            "reference twins (`-- --kernels rope=reference,experts=reference`)."
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
