"""A launch plan: everything about a run that can be decided before any process starts.

A run is one torchtitan `Trainer.Config` plus the launch facts (machine kind, LNC, ranks, nodes,
environment). `resolve_plan(recipe, instance=..., nodes=...)` turns the launcher's flags into
torchtitan overrides (the machine kind too: `--target`, `--lnc`), loads the recipe exactly as
every rank will (torchtitan's ConfigManager with `--module qwentitan.launch.recipes --config
<recipe>` plus those overrides: "CLI args > config_registry defaults") and owns every check:
ranges, parallel degrees, LNC, the sequence rules, the compile backend, the shell's Neuron
settings, the step to stop after, memory per rank. `train`, `plan`, `run`, `slurm` and
`preflight` only ask it. Every refusal is a `LaunchError` whose one sentence names the fix.
"""

from __future__ import annotations

import contextlib
import io
import shlex
import sys
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from qwentitan.launch.base import env_defaults
from qwentitan.launch.base.errors import LaunchError
from qwentitan.launch.base.target import GIB, Topology, get_target, get_topology
from qwentitan.launch.launcher import environment
from qwentitan.launch.launcher.memory import (
    USABLE_FRACTION,
    MemoryEstimate,
    ModelShape,
    estimate_memory,
    meta_model,
)
from qwentitan.launch.launcher.plan_rules import (
    ParallelDegrees,
    check_layout,
    check_loss_chunks,
    check_ranges,
    check_stop_after,
    compile_backend,
    console_rank,
    global_batch_size,
    max_positions,
    resolve_degrees,
)

RECIPES_MODULE = "qwentitan.launch.recipes"
# torchtitan's own entry point on every rank; the recipe's Trainer.Config builds our Trainer.
TRAIN_ENTRY = "torchtitan.train"
DEFAULT_COMPILE_CACHE = environment.DEFAULT_COMPILE_CACHE
AC_MODES = ("none", "selective", "full")
# What the ranks do with the checkpoints already in the run folder (torchtitan itself always
# loads the newest one it finds; the launcher checks the folder against this before starting):
# "fresh" - start at step 1: a folder that already holds checkpoints is refused, never emptied;
# "latest" - continue the newest checkpoint, which must exist and be whole;
# "auto" - "latest" when there is one, else "fresh" (a requeued scheduler job).
RESUME_MODES = ("fresh", "latest", "auto")


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
    max_restarts: int = 0
    resume: str = "auto"  # one of RESUME_MODES
    env_sources: dict[str, str] = field(default_factory=dict)
    """Where each value of `env` came from: flag, environment, default or plan."""

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
        shown = console_rank(
            self.degrees, self.config.parallelism.pipeline_parallel_schedule, self.ranks_per_node
        )
        args += [f"--local-ranks-filter={shown}", "--role=rank", "--tee=3", "-m", TRAIN_ENTRY]
        return args + self.trainer_args()

    def launch_argv(self) -> list[str]:
        """What `train` and `run` execute: `torchrun_args()` through this Python's torchrun
        (`qwentitan.launch.launcher.agent`: torchrun's own parser and run, a failed rank in one line)."""
        return [sys.executable, "-m", "qwentitan.launch.launcher.agent", *self.torchrun_args()[1:]]

    def command(self) -> str:
        return shlex.join(self.torchrun_args())

    def rank_env(self, shell: Mapping[str, str] | None = None) -> dict[str, str]:
        """The environment torchrun hands every rank on this host: the shell, the plan on top."""
        return environment.rank_env(
            self.env,
            device_type=self.topology.device_type,
            ranks_per_node=self.ranks_per_node,
            shell=shell,
        )

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
                "rule": "NKI attention" if self.topology.device_type == "neuron" else "none",
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
                "compile_backend": cfg.compile.backend if cfg.compile.enable else None,
            },
            "env": self.env,
            "env_sources": self.env_sources,
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
    ranks_flag: str = "--ranks-per-node",
    fsdp: int | None = None,
    tp: int | None = None,
    ep: int | None = None,
    seq_len: int | None = None,
    local_batch: int | None = None,
    global_batch: int | None = None,
    activation_checkpoint: str | None = None,
    steps: int | None = None,
    stop_after: int | None = None,
    dump_folder: str | None = None,
    checkpoint_interval: int | None = None,
    extra_overrides: list[str] | None = None,
    compile_cache: str | None = None,
    rdzv_endpoint: str | None = None,
    max_restarts: int = 0,
    resume: str = "auto",
    shell: Mapping[str, str] | None = None,
) -> LaunchPlan:
    """Resolve (recipe, instance, nodes), the optional knobs and torchtitan overrides into a
    checked LaunchPlan. `shell`: the environment the launch starts from (default: this one)."""
    instance = instance or default_instance(recipe)
    target = get_target(instance)  # before anything slower, so an unknown name is the first problem
    if nodes < 1:
        raise LaunchError(f"--nodes must be at least 1, not {nodes}.")
    shell = env_defaults.shell() if shell is None else shell
    lnc_source = environment.FLAG
    if lnc is None and target.device_type == "neuron":
        lnc = environment.shell_lnc(shell)  # an exported LNC is honoured unless --lnc says else
        lnc_source = environment.DEFAULT if lnc is None else environment.ENVIRONMENT
    topology = get_topology(instance, lnc=lnc, ranks_per_node=ranks_per_node, ranks_flag=ranks_flag)
    if resume not in RESUME_MODES:
        raise LaunchError(
            f"Unknown resume mode {resume!r}; pass --resume with one of {', '.join(RESUME_MODES)}."
        )
    if activation_checkpoint is not None and activation_checkpoint not in AC_MODES:
        raise LaunchError(
            f"Unknown activation checkpointing mode {activation_checkpoint!r}; "
            f"pass --ac with one of {', '.join(AC_MODES)}."
        )

    overrides = placement_overrides(topology)
    for flag, value in (
        ("--training.seq-len", seq_len),
        ("--training.local-batch-size", local_batch),
        ("--training.steps", steps),
        ("--stop-after", stop_after),
        ("--parallelism.data-parallel-shard-degree", fsdp),
        ("--parallelism.tensor-parallel-degree", tp),
        ("--parallelism.expert-parallel-degree", ep),
        ("--dump-folder", dump_folder),
        ("--checkpoint.interval", checkpoint_interval),
    ):
        if value is not None:
            overrides += [flag, str(value)]
    overrides += list(extra_overrides or [])
    # A tyro subcommand, so always the last word on the trainer's command line.
    if activation_checkpoint:
        overrides.append(f"activation-checkpoint:{activation_checkpoint}")
    return plan_from_overrides(
        recipe,
        topology,
        overrides,
        nodes=nodes,
        global_batch=global_batch,
        compile_cache=compile_cache,
        lnc_source=lnc_source,
        shell=shell,
        rdzv_endpoint=rdzv_endpoint,
        max_restarts=max_restarts,
        resume=resume,
    )


def placement_overrides(topology: Topology) -> list[str]:
    """The machine kind as config (our recipes' `Trainer.Config.target` / `.lnc`): every rank
    builds its model for it. Another registry's config (torchtitan's own, which tests plan) has
    no such fields; it only has CUDA graphs turned off where they cannot exist."""
    if not _our_recipes():
        return [] if topology.device_type == "cuda" else ["--training.disable-cuda-graphs"]
    words = ["--target", topology.name]
    return [*words, "--lnc", str(topology.lnc)] if topology.device_type == "neuron" else words


def _our_recipes() -> bool:
    from qwentitan.launch import recipes

    return recipes.__name__ == RECIPES_MODULE


def plan_from_overrides(
    recipe: str,
    topology: Topology,
    overrides: list[str],
    *,
    nodes: int,
    global_batch: int | None = None,
    compile_cache: str | None = None,
    lnc_source: str = environment.DEFAULT,
    shell: Mapping[str, str],
    env: tuple[dict[str, str], dict[str, str]] | None = None,
    rdzv_endpoint: str | None = None,
    max_restarts: int = 0,
    resume: str = "auto",
) -> LaunchPlan:
    """The plan of `recipe` with exactly these trainer overrides: the config every rank builds,
    checked. `env`: the ranks' variables and their sources as already planned (a plan file)."""
    environment.check_shell(topology, shell)  # on every node too: its shell reaches its ranks
    overrides = list(overrides)
    config = load_config(recipe, overrides)
    world = nodes * topology.ranks_per_node
    check_ranges(config)
    degrees = resolve_degrees(config.parallelism, world, topology)
    check_layout(config, degrees, topology, recipe)
    seq_len = config.training.seq_len
    topology.target.check_seq_len(seq_len, topology.lnc, max_positions(config.model_spec.model))
    check_loss_chunks(config, seq_len, degrees.context_parallel)
    check_stop_after(config, resume)
    backend = compile_backend(config, topology, overrides)
    if backend is not None:
        _set_override(overrides, "--compile.backend", backend)
        config.compile.backend = backend
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
    resolved_batch = global_batch_size(
        recipe_batch if global_batch is None else global_batch,
        local=local,
        batch_ranks=batch_ranks,
        nodes=nodes,
        pinned=global_batch is not None,
    )
    if global_batch is not None or (recipe_batch > 0 and resolved_batch != recipe_batch):
        # Pinned or scaled with the nodes: the ranks load the recipe too, so they are told.
        _set_override(overrides, "--training.global-batch-size", str(resolved_batch))
        config.training.global_batch_size = resolved_batch
    if env is None:
        mlflow = getattr(config.metrics, "mlflow", None)
        env = environment.plan_env(
            topology,
            nodes=nodes,
            shell=shell,
            compile_cache=compile_cache,
            lnc_source=lnc_source,
            mlflow_timeout_s=mlflow.request_timeout_s if mlflow and mlflow.enable else None,
        )
    plan = LaunchPlan(
        recipe=recipe,
        topology=topology,
        nodes=nodes,
        degrees=degrees,
        seq_len=seq_len,
        local_batch=local,
        global_batch=resolved_batch,
        steps=config.training.steps,
        activation_checkpoint=ac,
        overrides=_subcommand_last(overrides),
        env=env[0],
        env_sources=env[1],
        memory=_memory(config, shape, degrees, topology, ac),
        config=config,
        model_shape=shape,
        rdzv_endpoint=rdzv_endpoint or "localhost:0",
        max_restarts=max_restarts,
        resume=resume,
    )
    if not plan.memory.fits:
        raise LaunchError(_memory_refusal(plan))
    return plan


def _set_override(overrides: list[str], flag: str, value: str) -> None:
    """Set `flag VALUE` in `overrides`: in place where the flag is already, else at the end."""
    if flag in overrides[:-1]:
        overrides[overrides.index(flag) + 1] = value
    else:
        overrides += [flag, value]


def _subcommand_last(overrides: list[str]) -> list[str]:
    """tyro reads a subcommand (`activation-checkpoint:full`) as the end of the flags before it."""
    chosen = [word for word in overrides if word.startswith("activation-checkpoint:")]
    return [word for word in overrides if word not in chosen] + chosen[-1:]


def _memory(
    config: Any, shape: ModelShape, degrees: ParallelDegrees, topology: Topology, ac: str
) -> MemoryEstimate:
    # torchtitan casts to the mixed-precision dtype only through fully_shard, which it applies
    # when more than one rank shards (dp_shard x cp > 1); otherwise everything is the training dtype.
    fsdp = degrees.data_parallel_shard * degrees.context_parallel > 1
    training_bytes = 4 if config.training.dtype == "float32" else 2
    compute_bytes = (
        2 if fsdp and config.training.mixed_precision_param == "bfloat16" else training_bytes
    )
    shards = degrees.data_parallel_shard * degrees.context_parallel * degrees.tensor_parallel
    return estimate_memory(
        shape,
        seq_len=config.training.seq_len,
        local_batch=config.training.local_batch_size,
        activation_checkpoint=ac,
        available=topology.memory_per_rank_bytes,
        dense_shards=shards,
        expert_shards=shards,
        tensor_parallel=degrees.tensor_parallel,
        training_dtype_bytes=training_bytes,
        compute_dtype_bytes=compute_bytes,
        loss_chunks=getattr(config.loss, "num_chunks", 1),
        fsdp=fsdp,
    )


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
