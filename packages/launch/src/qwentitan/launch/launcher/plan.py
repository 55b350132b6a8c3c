"""A launch plan: everything about a run that can be decided before any process starts.

A run is one torchtitan `Trainer.Config` plus the launch facts (machine kind, LNC, ranks, nodes,
environment). `resolve_plan(request)` turns a `RunRequest` into torchtitan overrides (the machine
kind too: `--target`, `--lnc`), loads the recipe exactly as every rank will (`load_config`) and
owns every check: ranges, parallel degrees, LNC, the sequence rules, the compile backend, the
shell's Neuron settings, the step to stop after, memory per rank. `train`, `plan`, `run`,
`slurm` and `preflight` only ask it. Every refusal is a `LaunchError` whose one sentence names
the fix (and the request field it is about).
"""

from __future__ import annotations

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
    estimate_for,
    meta_model,
)
from qwentitan.launch.launcher.plan_rules import (
    ParallelDegrees,
    check_compile_with_nki,
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
from qwentitan.launch.launcher.recipe_config import RECIPES_MODULE, load_config, recipe_names
from qwentitan.launch.launcher.request import AC_MODES, RESUME_MODES, RunRequest
from qwentitan.launch.runtime.rank_exit import TRAIN_ENTRY

__all__ = [
    "AC_MODES",
    "RECIPES_MODULE",
    "RESUME_MODES",
    "LaunchPlan",
    "RunRequest",
    "default_instance",
    "load_config",
    "recipe_names",
    "resolve_plan",
]

DEFAULT_COMPILE_CACHE = environment.DEFAULT_COMPILE_CACHE


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
    def note(self) -> str | None:
        """What to know before the ranks start (more CPU ranks than cores), or None."""
        return self.topology.note

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
        folder = self.config.checkpoint.folder
        from qwentitan.launch.launcher.remote import RemotePath, is_remote

        if is_remote(folder):  # on S3 (`--run-dir s3://...`): torchtitan's join keeps a URL whole
            return RemotePath(folder)  # type: ignore[return-value]  # the Path methods used
        return self.run_folder / folder

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
                "experts": self.model_shape.experts if self.model_shape else None,
                "top_k": self.model_shape.top_k if self.model_shape else None,
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


def default_instance(recipe: str) -> str:
    """The recipe's instance (trn2 recipes: a trn2.48xlarge), else this host's Target, by the
    one probe the ranks use too (`platforms.host_target`: Neuron, else CUDA, else CPU)."""
    from qwentitan.launch.recipes import recipe_info
    from qwentitan.launch.runtime.platforms import host_target

    known = recipe in recipe_names()
    return (recipe_info(recipe).instance if known else None) or host_target()


def model_shape(config: Any) -> ModelShape:
    """The shape of the recipe's model, read from its meta-device build."""
    return ModelShape.of(meta_model(config))


def resolve_plan(request: RunRequest, *, shell: Mapping[str, str] | None = None) -> LaunchPlan:
    """The checked plan of `request`. `shell`: the environment the launch starts from (default:
    this one), whose Neuron settings are checked and whose exported LNC is honoured."""
    shell = env_defaults.shell() if shell is None else shell
    instance = request.instance or default_instance(request.recipe)
    target = get_target(instance)  # before anything slower, so an unknown name is the first problem
    lnc, lnc_source = request.lnc, environment.FLAG
    if lnc is None and target.device_type == "neuron":
        lnc = environment.shell_lnc(shell)  # an exported LNC is honoured unless a flag says else
        lnc_source = environment.DEFAULT if lnc is None else environment.ENVIRONMENT
    topology = get_topology(instance, lnc=lnc, ranks_per_node=request.ranks_per_node)
    overrides = [*placement_overrides(topology), *request.trainer_overrides()]
    return plan_from_overrides(request, topology, overrides, shell=shell, lnc_source=lnc_source)


def placement_overrides(topology: Topology) -> list[str]:
    """The machine kind as config (`Trainer.Config.target` / `.lnc`): every rank builds its
    model for it."""
    words = ["--target", topology.name]
    return [*words, "--lnc", str(topology.lnc)] if topology.device_type == "neuron" else words


def plan_from_overrides(
    request: RunRequest,
    topology: Topology,
    overrides: list[str],
    *,
    shell: Mapping[str, str],
    lnc_source: str = environment.DEFAULT,
    env: tuple[dict[str, str], dict[str, str]] | None = None,
) -> LaunchPlan:
    """The plan of `request` with exactly these trainer overrides: the config every rank
    builds, checked. `env`: the ranks' variables and their sources as already planned (a plan
    file)."""
    environment.check_shell(topology, shell)  # on every node too: its shell reaches its ranks
    overrides = list(overrides)
    config = load_config(request.recipe, overrides)
    degrees, shape = _checked(request, config, topology, overrides)
    batch = _global_batch(request, config, degrees, overrides)
    if env is None:
        mlflow = getattr(config.metrics, "mlflow", None)
        env = environment.plan_env(
            topology,
            nodes=request.nodes,
            shell=shell,
            compile_cache=request.compile_cache,
            lnc_source=lnc_source,
            mlflow_timeout_s=mlflow.request_timeout_s if mlflow and mlflow.enable else None,
        )
    ac = _ac_mode(config.activation_checkpoint)
    plan = LaunchPlan(
        recipe=request.recipe,
        topology=topology,
        nodes=request.nodes,
        degrees=degrees,
        seq_len=config.training.seq_len,
        local_batch=config.training.local_batch_size,
        global_batch=batch,
        steps=config.training.steps,
        activation_checkpoint=ac,
        overrides=_subcommand_last(overrides),
        env=env[0],
        env_sources=env[1],
        memory=estimate_for(config, shape, degrees, topology, ac),
        config=config,
        model_shape=shape,
        rdzv_endpoint=request.rdzv_endpoint or "localhost:0",
        max_restarts=request.max_restarts,
        resume=request.resume,
    )
    if not plan.memory.fits:
        raise LaunchError(_memory_refusal(plan), field=_memory_knob(plan)[0])
    return plan


def _checked(
    request: RunRequest, config: Any, topology: Topology, overrides: list[str]
) -> tuple[ParallelDegrees, ModelShape]:
    """The plan's rules applied to the config every rank builds: its degrees and model shape."""
    world = request.nodes * topology.ranks_per_node
    check_ranges(config)
    degrees = resolve_degrees(config.parallelism, world, topology)
    check_layout(config, degrees, topology, request.recipe)
    seq_len = config.training.seq_len
    topology.target.check_seq_len(seq_len, topology.lnc, max_positions(config.model_spec.model))
    check_loss_chunks(config, seq_len, degrees.context_parallel)
    check_stop_after(config, request.resume)
    check_compile_with_nki(config, topology)
    backend = compile_backend(config, topology, overrides)
    if backend is not None:
        _set_override(overrides, "--compile.backend", backend)
        config.compile.backend = backend
    shape = model_shape(config)
    if degrees.expert_parallel > 1 and not shape.experts:
        raise LaunchError(
            f"Recipe {request.recipe!r} has no experts, so expert parallelism "
            f"{degrees.expert_parallel} has nothing to shard; drop {{ep}}.",
            field="ep",
        )
    return degrees, shape


def _global_batch(
    request: RunRequest, config: Any, degrees: ParallelDegrees, overrides: list[str]
) -> int:
    """The global batch (`plan_rules.global_batch_size`), told to the ranks when it is not
    the recipe's own number."""
    pinned = request.global_batch_size
    recipe_batch = config.training.global_batch_size
    resolved = global_batch_size(
        recipe_batch if pinned is None else pinned,
        local=config.training.local_batch_size,
        batch_ranks=degrees.data_parallel_shard * degrees.data_parallel_replicate,
        nodes=request.nodes,
        pinned=pinned is not None,
    )
    if pinned is not None or (recipe_batch > 0 and resolved != recipe_batch):
        # Pinned or scaled with the nodes: the ranks load the recipe too, so they are told.
        _set_override(overrides, "--training.global-batch-size", str(resolved))
        config.training.global_batch_size = resolved
    return resolved


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


def _ac_mode(ac_config: Any) -> str:
    if ac_config is None:
        return "none"
    name = type(ac_config).__qualname__.split(".")[0]
    return {"FullAC": "full", "SelectiveAC": "selective", "MemoryBudgetAC": "selective"}.get(
        name, "selective"
    )


def _memory_knob(plan: LaunchPlan) -> tuple[str, str]:
    """(the request field to change, how) for a plan that does not fit."""
    m = plan.memory
    cores = plan.topology.target.max_ranks() if plan.topology.device_type == "cpu" else 0
    if plan.ranks_per_node > cores > 0:
        return "ranks_per_node", f"pass {{ranks_per_node}} {cores} or fewer"
    if m.activations + m.logits >= m.sharded_state + m.unsharded_transient:
        if plan.activation_checkpoint != "full":
            return "ac", "turn on full activation checkpointing with {ac} full"
        if plan.local_batch > 1:
            return "local_batch_size", f"lower {{local_batch_size}} below {plan.local_batch}"
        return "seq_len", f"lower {{seq_len}} below {plan.seq_len} or raise {{tp}}"
    return (
        "nodes",
        f"shard the weights over more ranks with {{nodes}} {plan.nodes * 2} or raise {{tp}}",
    )


def _memory_refusal(plan: LaunchPlan) -> str:
    m = plan.memory
    where = f"a {plan.topology.name} rank"
    if plan.topology.device_type == "neuron":
        where += f" at LNC {plan.lnc}"
    return (
        f"Recipe {plan.recipe!r} needs about {m.total / GIB:.1f} GiB per rank but {where} has "
        f"{m.available / GIB:.1f} GiB ({USABLE_FRACTION:.0%} usable); {_memory_knob(plan)[1]}."
    )
