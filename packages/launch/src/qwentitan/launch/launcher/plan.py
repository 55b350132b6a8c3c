"""A launch plan: everything about a run that can be decided before any process starts.

`resolve_plan(request)` places the run once (the machine kind and LNC, from the flag, else the
shell's exported LNC, else the Target's default), maps the request's flags to torchtitan
overrides once (`RunRequest.trainer_overrides`, the placement and the scaled batch with them)
and returns a `LaunchPlan` (`launch_plan`): frozen data, every other fact read from the config
torchtitan's parser builds from those overrides, exactly as every rank will. `check_plan` owns
every check and changes nothing: ranges, parallel degrees (torchtitan's own `ParallelDims`),
layouts, LNC, the sequence rules, the compile backend, `--stop-after`, memory per rank. `train`,
`plan`, `run`, `slurm`, `preflight` and the pilot only ask them. Every refusal is a
`LaunchError` whose one sentence names the fix (and the request field it is about).
"""

from __future__ import annotations

from collections.abc import Mapping

from qwentitan.launch.base import env_defaults
from qwentitan.launch.base.errors import LaunchError
from qwentitan.launch.base.target import GIB, Topology, get_target, get_topology
from qwentitan.launch.launcher import environment
from qwentitan.launch.launcher.launch_plan import LaunchPlan
from qwentitan.launch.launcher.memory import USABLE_FRACTION
from qwentitan.launch.launcher.plan_rules import (
    NEURON_COMPILE_BACKEND,
    check_compile,
    check_global_batch,
    check_layout,
    check_loss_chunks,
    check_pipeline_microbatches,
    check_ranges,
    check_stop_after,
    max_positions,
    scaled_global_batch,
)
from qwentitan.launch.launcher.recipe_config import RECIPES_MODULE, load_config, recipe_names
from qwentitan.launch.launcher.request import AC_MODES, RESUME_MODES, RunRequest
from qwentitan.launch.launcher.supervisor import TRAIN_ENTRY

__all__ = [
    "AC_MODES",
    "RECIPES_MODULE",
    "RESUME_MODES",
    "TRAIN_ENTRY",
    "LaunchPlan",
    "RunRequest",
    "check_plan",
    "default_instance",
    "load_config",
    "recipe_names",
    "resolve_plan",
]

DEFAULT_COMPILE_CACHE = environment.DEFAULT_COMPILE_CACHE


def default_instance(recipe: str) -> str:
    """The recipe's instance (trn2 recipes: a trn2.48xlarge), else this host's Target, by the
    one probe the ranks use too (`platforms.host_target`: Neuron, else CUDA, else CPU)."""
    from qwentitan.launch.recipes import recipe_info
    from qwentitan.launch.runtime.platforms import host_target

    known = recipe in recipe_names()
    return (recipe_info(recipe).instance if known else None) or host_target()


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
    environment.check_shell(topology, shell)
    words = _subcommand_last([*placement_overrides(topology), *request.trainer_overrides()])
    config = load_config(request.recipe, list(words))  # the plan's own, unless scaled below
    recipe_batch = config.training.global_batch_size
    source, scaled = "{global_batch_size}", None
    if not request.global_batch_size and recipe_batch > 0:
        nodes = request.nodes
        source = f"the recipe's {recipe_batch} per node x {nodes} node{'s' * (nodes > 1)}"
        scaled = scaled_global_batch(recipe_batch, nodes)
        if scaled is not None:  # the ranks load the recipe too, so they are told
            words = _subcommand_last([*words, "--training.global-batch-size", str(scaled)])
    mlflow = getattr(config.metrics, "mlflow", None)
    env, sources = environment.plan_env(
        topology,
        nodes=request.nodes,
        shell=shell,
        compile_cache=request.compile_cache,
        lnc_source=lnc_source,
        mlflow_timeout_s=mlflow.request_timeout_s if mlflow and mlflow.enable else None,
    )
    plan = LaunchPlan(
        recipe=request.recipe,
        overrides=words,
        topology=topology,
        nodes=request.nodes,
        env=env,
        env_sources=sources,
        resume=request.resume,
        rdzv_endpoint=request.rdzv_endpoint or "localhost:0",
        max_restarts=request.max_restarts,
    )
    if scaled is None:  # else the ranks' overrides differ from the parse above: parsed again
        plan = plan.parsed_as(config)
    check_plan(plan, batch_source=source)
    return plan


def placement_overrides(topology: Topology) -> list[str]:
    """The machine kind as config (`Trainer.Config.target` / `.lnc`), resolved here once: every
    rank builds its model for it and has no fallback of its own. A Neuron run compiles with the
    `neuron` backend (torchtitan's default, inductor, does not target Neuron); an override
    after these may name another, which `check_compile` refuses."""
    words = ["--target", topology.name]
    if topology.device_type != "neuron":
        return words
    return [*words, "--lnc", str(topology.lnc), "--compile.backend", NEURON_COMPILE_BACKEND]


def check_plan(plan: LaunchPlan, *, batch_source: str = "{global_batch_size}") -> None:
    """Every rule applied to the config every rank builds; changes nothing. `batch_source`: where
    the global batch came from, as a refusal says it."""
    config, topology = plan.config, plan.topology
    check_ranges(config)
    dims = plan.dims  # torchtitan's ParallelDims: the degrees' one check
    check_layout(config, dims, topology, plan.recipe)
    seq_len = config.training.seq_len
    topology.target.check_seq_len(seq_len, topology.lnc, max_positions(config.model_spec.model))
    check_loss_chunks(config, seq_len, dims.cp)
    check_pipeline_microbatches(config, dims.pp)
    check_stop_after(config, plan.resume)
    check_compile(config, topology)
    if dims.ep > 1 and not plan.model_shape.experts:
        raise LaunchError(
            f"Recipe {plan.recipe!r} has no experts, so expert parallelism {dims.ep} has nothing "
            "to shard; drop {ep}.",
            field="ep",
        )
    check_global_batch(
        config.training.global_batch_size,
        local=plan.local_batch,
        batch_ranks=plan.batch_ranks,
        source=batch_source,
    )
    if not plan.memory.fits:
        raise LaunchError(_memory_refusal(plan), field=_memory_knob(plan)[0])


def _subcommand_last(overrides: list[str]) -> tuple[str, ...]:
    """tyro reads a subcommand (`activation-checkpoint:full`) as the end of the flags before it."""
    chosen = [word for word in overrides if word.startswith("activation-checkpoint:")]
    return (*[word for word in overrides if word not in chosen], *chosen[-1:])


def _memory_knob(plan: LaunchPlan) -> tuple[str, str]:
    """(the request field to change, how) for a plan that does not fit."""
    m = plan.memory
    cores = plan.topology.target.max_ranks() if plan.topology.device_type == "cpu" else 0
    if m.process and m.process * plan.ranks_per_node > m.available:  # the processes fill it
        fewer = max(1, int(m.available * plan.ranks_per_node * USABLE_FRACTION // m.total))
        return "ranks_per_node", f"pass {{ranks_per_node}} {fewer} or fewer"
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
