"""A launch plan: everything about a run that can be decided before any process starts.

`resolve_plan(recipe, instance=..., nodes=...)` loads the recipe exactly as the trainer will
(torchtitan's ConfigManager with `--module qwentitan.launch.recipes --config <recipe>` plus the
same override flags), checks the topology against it (parallel degrees, LNC, the Neuron
sequence-length rule, memory per rank) and writes down the environment and the torchrun
command line. Every refusal is a `LaunchError` whose message names the flag to change.
"""

from __future__ import annotations

import contextlib
import io
import shlex
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from qwentitan.launch.base.errors import LaunchError
from qwentitan.launch.base.target import GIB, get_target
from qwentitan.launch.base.topology import Topology, get_topology
from qwentitan.launch.launcher.memory import (
    USABLE_FRACTION,
    MemoryEstimate,
    ModelShape,
    estimate_memory,
)
from qwentitan.launch.launcher.topology_env import plan_env

if TYPE_CHECKING:
    import torch

RECIPES_MODULE = "qwentitan.launch.recipes"
# torchtitan's own entry point on every rank; the recipe's Trainer.Config builds our Trainer.
TRAIN_ENTRY = "torchtitan.train"
DEFAULT_COMPILE_CACHE = "~/.cache/qwentitan/neuron-compile-cache"
AC_MODES = ("none", "selective", "full")
# What the ranks do with the checkpoints already in the run folder (torchtitan itself always
# loads the newest one it finds; the launcher checks the folder against this before starting):
# "fresh" - start at step 1: a folder that already holds checkpoints is refused, never emptied;
# "latest" - continue the newest checkpoint, which must exist and be whole;
# "auto" - "latest" when there is one, else "fresh" (a requeued scheduler job).
RESUME_MODES = ("fresh", "latest", "auto")


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


@dataclass(slots=True)
class LaunchPlan:
    """A resolved run: topology, degrees, batch, environment, command and memory estimate."""

    recipe: str
    topology: Topology
    nodes: int
    degrees: ParallelDegrees
    seq_len: int
    local_batch: int
    global_batch: int
    steps: int
    activation_checkpoint: str
    overrides: list[str]
    env: dict[str, str]
    memory: MemoryEstimate
    config: Any = field(repr=False)  # the recipe's torchtitan Trainer.Config, overrides applied
    model_shape: ModelShape | None = None
    rdzv_endpoint: str = "localhost:0"
    node_rank: int = 0
    max_restarts: int = 0
    resume: str = "auto"  # one of RESUME_MODES

    @property
    def world_size(self) -> int:
        return self.nodes * self.topology.ranks_per_node

    @property
    def ranks_per_node(self) -> int:
        return self.topology.ranks_per_node

    @property
    def lnc(self) -> int:
        return self.topology.lnc

    def trainer_args(self) -> list[str]:
        """What the training entry point receives on every rank."""
        return ["--module", RECIPES_MODULE, "--config", self.recipe, *self.overrides]

    def torchrun_args(self, *, python: str = "torchrun") -> list[str]:
        """The torchrun command for this node (c10d rendezvous, one process per rank)."""
        args = [
            python,
            f"--nnodes={self.nodes}",
            f"--nproc-per-node={self.ranks_per_node}",
            "--rdzv-backend=c10d",
            f"--rdzv-endpoint={self.rdzv_endpoint}",
            f"--max-restarts={self.max_restarts}",
        ]
        if self.nodes > 1:
            # c10d assigns ranks in join order (torchrun ignores --node-rank with it); the id
            # keeps two jobs on one endpoint apart.
            args.append(f"--rdzv-id=qwentitan-{self.recipe}")
        args += ["--local-ranks-filter=0", "--role=rank", "--tee=3", "-m", TRAIN_ENTRY]
        return args + self.trainer_args()

    def launch_argv(self) -> list[str]:
        """What `train` and `run` execute: `torchrun_args()` through this Python's torchrun
        (`qwentitan.launch.launcher.agent`: torchrun's own parser and run, a failed rank in one line)."""
        return [sys.executable, "-m", "qwentitan.launch.launcher.agent", *self.torchrun_args()[1:]]

    def command(self) -> str:
        return shlex.join(self.torchrun_args())

    @property
    def run_folder(self) -> Path:
        """torchtitan's dump folder: checkpoints, logs and reports of this run."""
        return Path(self.config.dump_folder)

    @property
    def checkpoint_folder(self) -> Path:
        return self.run_folder / self.config.checkpoint.folder

    def to_dict(self) -> dict[str, Any]:
        cfg = self.config
        spec = cfg.model_spec
        multiple = self.topology.seq_len_multiple
        return {
            "recipe": self.recipe,
            "topology": self.topology.to_dict(),
            "nodes": self.nodes,
            "ranks_per_node": self.ranks_per_node,
            "world_size": self.world_size,
            "lnc": self.lnc,
            "parallelism": {
                "fsdp": self.degrees.data_parallel_shard,
                "dp_replicate": self.degrees.data_parallel_replicate,
                "tp": self.degrees.tensor_parallel,
                "cp": self.degrees.context_parallel,
                "pp": self.degrees.pipeline_parallel,
                "ep": self.degrees.expert_parallel,
            },
            "seq_len": self.seq_len,
            "seq_len_rule": {
                "multiple_of": multiple,
                "rule": f"128 x LNC {self.lnc}"
                if self.topology.device_type == "neuron"
                else "none",
                "ok": self.seq_len % multiple == 0,
            },
            "local_batch": self.local_batch,
            "global_batch": self.global_batch,
            "gradient_accumulation_steps": self.global_batch
            // (self.local_batch * self._batch_ranks()),
            "steps": self.steps,
            "resume": self.resume,
            "activation_checkpoint": self.activation_checkpoint,
            "model": {
                "name": getattr(spec, "name", None),
                "flavor": getattr(spec, "flavor", None),
                "params": self.model_shape.params if self.model_shape else None,
            },
            "config": {
                "hf_assets_path": cfg.hf_assets_path,
                "dump_folder": cfg.dump_folder,
                "dataset": getattr(cfg.dataloader, "dataset", None),
                "training_dtype": cfg.training.dtype,
                "checkpoint_enabled": getattr(cfg.checkpoint, "enable", None),
                "checkpoint_folder": getattr(cfg.checkpoint, "folder", None),
                "checkpoint_interval": getattr(cfg.checkpoint, "interval", None),
                "initial_load_in_hf": getattr(cfg.checkpoint, "initial_load_in_hf", None),
                "last_save_in_hf": getattr(cfg.checkpoint, "last_save_in_hf", None),
                "compile": cfg.compile.enable,
            },
            "env": self.env,
            "torchrun": self.torchrun_args(),
            "memory_per_rank": self.memory.to_dict(),
        }

    def _batch_ranks(self) -> int:
        return self.degrees.data_parallel_shard * self.degrees.data_parallel_replicate


def recipe_names() -> list[str]:
    """Our recipe registry's names; for another registry module (tests plan torchtitan's own
    qwen3 registry), its public functions."""
    import importlib

    from qwentitan.launch import recipes

    if recipes.__name__ == RECIPES_MODULE:
        return recipes.recipe_names()
    module = importlib.import_module(RECIPES_MODULE)
    names = [n for n in dir(module) if not n.startswith("_") and callable(getattr(module, n))]
    return sorted(n for n in names if n[0].islower())


def default_instance(recipe: str) -> str:
    """trn2 recipes target a trn2.48xlarge; the others this host (cuda if it has GPUs, else cpu)."""
    from qwentitan.launch.recipes import recipe_info, recipe_names

    if recipe in recipe_names() and (instance := recipe_info(recipe).instance):
        return instance
    import torch

    return "cuda" if torch.cuda.is_available() else "cpu"


def load_config(recipe: str, overrides: list[str]) -> Any:
    """Build the recipe's Trainer.Config through torchtitan's own parser, as the trainer does."""
    from torchtitan.config import ConfigManager

    if recipe not in recipe_names():
        raise LaunchError(
            f"Unknown recipe {recipe!r}; choose one of {', '.join(recipe_names())} with --recipe."
        )
    args = ["--module", RECIPES_MODULE, "--config", recipe, *overrides]
    quiet = io.StringIO()
    try:
        with contextlib.redirect_stdout(quiet), contextlib.redirect_stderr(quiet):
            return ConfigManager().parse_args(args)
    except SystemExit as exit_:
        reason = _tyro_message(quiet.getvalue()) or "check the flag names and values"
        raise LaunchError(
            f"torchtitan refused recipe {recipe!r} with {shlex.join(overrides) or 'no overrides'}: "
            f"{reason}"
        ) from exit_
    except ValueError as error:
        raise LaunchError(f"Recipe {recipe!r} is invalid with these settings: {error}") from error


def _tyro_message(text: str) -> str:
    """The sentence of tyro's error, boxed (a terminal) or plain (a pipe), with its first
    "Perhaps you meant" suggestion; "" when there is none."""
    lines = [line.strip().strip("│╭╮╰╯").strip() for line in text.splitlines()]
    blocks: list[list[str]] = [[]]
    for inner in [line for line in lines if line][1:]:  # the first line is the title
        if len(inner) > 3 and set(inner) <= set("─- "):
            blocks.append([])  # a rule between sections
        else:
            blocks[-1].append(inner)
    sections = [" ".join(block) for block in blocks if block]
    if not sections:
        return ""
    message = sections[0].removeprefix("Error parsing Config: ")
    for section in sections[1:]:
        if section.startswith("Perhaps you meant:"):
            message += f"; perhaps you meant {section.split()[3]}"
            break
    return message


def meta_model(config: Any) -> torch.nn.Module:
    """The recipe's model built on the meta device: shapes and dtypes, no memory."""
    import torch

    with torch.device("meta"):
        return config.model_spec.model.build()


def model_shape(config: Any) -> ModelShape:
    """The shape of the recipe's model, read from its meta-device build."""
    return ModelShape.of(meta_model(config))


def resolve_plan(
    recipe: str,
    *,
    instance: str | None = None,
    nodes: int = 1,
    lnc: int | None = None,
    ranks_per_node: int | None = None,
    fsdp: int | None = None,
    tp: int | None = None,
    ep: int | None = None,
    seq_len: int | None = None,
    local_batch: int | None = None,
    global_batch: int | None = None,
    activation_checkpoint: str | None = None,
    steps: int | None = None,
    dump_folder: str | None = None,
    checkpoint_interval: int | None = None,
    extra_overrides: list[str] | None = None,
    compile_cache: str = DEFAULT_COMPILE_CACHE,
    rdzv_endpoint: str | None = None,
    node_rank: int = 0,
    max_restarts: int = 0,
    resume: str = "auto",
) -> LaunchPlan:
    """Resolve (recipe, instance, nodes) and the optional knobs into a checked LaunchPlan."""
    instance = instance or default_instance(recipe)
    get_target(instance)  # before anything slower, so an unknown name is the first problem
    if nodes < 1:
        raise LaunchError(f"--nodes must be at least 1, not {nodes}.")
    topology = get_topology(instance, lnc=lnc, ranks_per_node=ranks_per_node)
    world = nodes * topology.ranks_per_node
    if resume not in RESUME_MODES:
        raise LaunchError(
            f"Unknown resume mode {resume!r}; pass --resume with one of {', '.join(RESUME_MODES)}."
        )
    if activation_checkpoint is not None and activation_checkpoint not in AC_MODES:
        raise LaunchError(
            f"Unknown activation checkpointing mode {activation_checkpoint!r}; "
            f"pass --ac with one of {', '.join(AC_MODES)}."
        )

    overrides: list[str] = []
    for flag, value in (
        ("--training.seq-len", seq_len),
        ("--training.local-batch-size", local_batch),
        ("--training.steps", steps),
        ("--parallelism.data-parallel-shard-degree", fsdp),
        ("--parallelism.tensor-parallel-degree", tp),
        ("--parallelism.expert-parallel-degree", ep),
        ("--dump-folder", dump_folder),
        ("--checkpoint.interval", checkpoint_interval),
    ):
        if value is not None:
            overrides += [flag, str(value)]
    if topology.device_type != "cuda":
        # CUDA graphs exist on CUDA only; torchtitan validates them (and refuses EP) otherwise.
        overrides.append("--training.disable-cuda-graphs")
    overrides += list(extra_overrides or [])
    # A tyro subcommand, so always the last word on the trainer's command line.
    ac_choice = [f"activation-checkpoint:{activation_checkpoint}"] if activation_checkpoint else []

    config = load_config(recipe, overrides + ac_choice)
    degrees = _resolve_degrees(config.parallelism, world, topology)
    topology.target.check_seq_len(config.training.seq_len, topology.lnc)
    shape = model_shape(config)
    if degrees.expert_parallel > 1 and not shape.experts:
        raise LaunchError(
            f"Recipe {recipe!r} has no experts, so expert parallelism {degrees.expert_parallel} "
            "has nothing to shard; drop --ep."
        )
    ac = _ac_mode(config.activation_checkpoint)
    batch_ranks = degrees.data_parallel_shard * degrees.data_parallel_replicate
    local = config.training.local_batch_size
    recipe_batch = config.training.global_batch_size
    resolved_batch = _global_batch(
        recipe_batch if global_batch is None else global_batch,
        local=local,
        batch_ranks=batch_ranks,
        nodes=nodes,
        pinned=global_batch is not None,
    )
    if global_batch is not None or (recipe_batch > 0 and resolved_batch != recipe_batch):
        # Pinned or scaled with the nodes: the ranks load the recipe too, so they are told.
        overrides += ["--training.global-batch-size", str(resolved_batch)]
        config.training.global_batch_size = resolved_batch
    # torchtitan casts to the mixed-precision dtype only through fully_shard, which it applies
    # when more than one rank shards (dp_shard x cp > 1); otherwise everything is the training dtype.
    fsdp = degrees.data_parallel_shard * degrees.context_parallel > 1
    training_bytes = 4 if config.training.dtype == "float32" else 2
    compute_bytes = (
        2 if fsdp and config.training.mixed_precision_param == "bfloat16" else training_bytes
    )
    memory = estimate_memory(
        shape,
        seq_len=config.training.seq_len,
        local_batch=local,
        activation_checkpoint=ac,
        available=topology.memory_per_rank_bytes,
        dense_shards=degrees.data_parallel_shard
        * degrees.context_parallel
        * degrees.tensor_parallel,
        expert_shards=degrees.data_parallel_shard
        * degrees.context_parallel
        * degrees.tensor_parallel,
        tensor_parallel=degrees.tensor_parallel,
        training_dtype_bytes=training_bytes,
        compute_dtype_bytes=compute_bytes,
        loss_chunks=getattr(config.loss, "num_chunks", 1),
        fsdp=fsdp,
    )
    plan = LaunchPlan(
        recipe=recipe,
        topology=topology,
        nodes=nodes,
        degrees=degrees,
        seq_len=config.training.seq_len,
        local_batch=local,
        global_batch=resolved_batch,
        steps=config.training.steps,
        activation_checkpoint=ac,
        overrides=overrides + ac_choice,
        env=plan_env(topology, nodes=nodes, compile_cache=compile_cache),
        memory=memory,
        config=config,
        model_shape=shape,
        rdzv_endpoint=rdzv_endpoint or "localhost:0",
        node_rank=node_rank,
        max_restarts=max_restarts,
        resume=resume,
    )
    if not memory.fits:
        raise LaunchError(_memory_refusal(plan))
    return plan


def _global_batch(
    recipe_batch: int, *, local: int, batch_ranks: int, nodes: int, pinned: bool
) -> int:
    """Samples per optimizer step: pinned by --global-batch-size, else it follows the world size.

    A recipe's global batch is what one node takes (it is written for one instance), so N nodes
    take N times it with the same gradient accumulation; a recipe without one takes one local
    batch per data-parallel rank (torchtitan's default).
    """
    micro = local * batch_ranks
    if pinned:
        batch, source = recipe_batch, "--global-batch-size"
    elif recipe_batch > 0:
        batch = recipe_batch * nodes
        source = f"the recipe's {recipe_batch} per node x {nodes} node{'s' * (nodes > 1)}"
    else:
        return micro
    if batch % micro:
        fits = max(micro, round(batch / micro) * micro)
        raise LaunchError(
            f"Global batch {batch} is not a multiple of local batch {local} x {batch_ranks} "
            f"data-parallel ranks = {micro} ({source}); pass --global-batch-size {fits} "
            f"(or another multiple of {micro})."
        )
    return batch


def _resolve_degrees(parallelism: Any, world: int, topology: Topology) -> ParallelDegrees:
    tp = parallelism.tensor_parallel_degree
    cp = parallelism.context_parallel_degree
    pp = parallelism.pipeline_parallel_degree
    rep = parallelism.data_parallel_replicate_degree
    shard = parallelism.data_parallel_shard_degree
    ep = parallelism.expert_parallel_degree
    for name, value in (
        ("--tp", tp),
        ("--ep", ep),
        ("context parallel", cp),
        ("pipeline parallel", pp),
    ):
        if value < 1:
            raise LaunchError(f"Parallel degree {name} must be at least 1, not {value}.")
    others = tp * cp * pp * rep
    where = f"{world} ranks ({topology.name}, LNC {topology.lnc})"
    if shard == -1:
        if world % others:
            raise LaunchError(
                f"TP {tp} x CP {cp} x PP {pp} x DP-replicate {rep} = {others} does not divide the "
                f"world size of {where}; choose --tp dividing {world}."
            )
        shard = world // others
    degrees = ParallelDegrees(shard, rep, tp, cp, pp, ep)
    if degrees.product() != world:
        raise LaunchError(
            f"FSDP {shard} x TP {tp} x CP {cp} x PP {pp} x DP-replicate {rep} = "
            f"{degrees.product()} is not the world size of {where}; "
            f"drop --fsdp to let it fill the remaining ranks, or make the product {world}."
        )
    dense = shard * cp * tp
    if dense % ep:
        raise LaunchError(
            f"Expert parallelism {ep} does not divide FSDP x CP x TP = {dense} on {where}; "
            f"choose --ep dividing {dense}."
        )
    return degrees


def _ac_mode(ac_config: Any) -> str:
    if ac_config is None:
        return "none"
    name = type(ac_config).__qualname__.split(".")[0]
    return {"FullAC": "full", "SelectiveAC": "selective", "MemoryBudgetAC": "selective"}.get(
        name, "selective"
    )


def _memory_refusal(plan: LaunchPlan) -> str:
    m = plan.memory
    need = m.total / GIB
    have = m.available / GIB
    where = f"a {plan.topology.name} rank"
    if plan.topology.device_type == "neuron":
        where += f" at LNC {plan.lnc}"
    if m.activations + m.logits >= m.sharded_state + m.unsharded_transient:
        if plan.activation_checkpoint != "full":
            knob = "turn on full activation checkpointing with --ac full"
        elif plan.local_batch > 1:
            knob = f"lower --local-batch-size below {plan.local_batch}"
        else:
            knob = f"lower --seq-len below {plan.seq_len} or raise --tp"
    else:
        knob = f"shard the weights over more ranks with --nodes {plan.nodes * 2} or raise --tp"
    return (
        f"Recipe {plan.recipe!r} needs about {need:.1f} GiB per rank but {where} has "
        f"{have:.1f} GiB ({USABLE_FRACTION:.0%} usable); {knob}."
    )
