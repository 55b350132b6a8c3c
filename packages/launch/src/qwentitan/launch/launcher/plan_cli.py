"""Command-line flags shared by the commands that resolve a plan, and its human-readable form."""

from __future__ import annotations

from typing import Any

from qwentitan.launch.base.errors import LaunchError
from qwentitan.launch.base.target import TARGETS
from qwentitan.launch.launcher.flags import positive
from qwentitan.launch.launcher.plan import (
    AC_MODES,
    DEFAULT_COMPILE_CACHE,
    RESUME_MODES,
    LaunchPlan,
    resolve_plan,
)
from qwentitan.launch.launcher.plan_file import load_plan


def add_plan_arguments(parser: Any, *, recipe_required: bool = True) -> None:
    """The flags every command that resolves a plan accepts (plan, run, slurm, preflight)."""
    parser.add_argument("--recipe", required=recipe_required, help="recipe function name")
    parser.add_argument(
        "--instance",
        help=f"one of {', '.join(TARGETS)} (default: trn2.48xlarge for trn2 recipes, "
        "else this host)",
    )
    parser.add_argument(
        "--nodes",
        "--nnodes",
        dest="nodes",
        type=positive,
        default=1,
        help="number of nodes (default 1)",
    )
    parser.add_argument(
        "--lnc", type=positive, help="logical NeuronCore size, 1 or 2 (trn2 default 2)"
    )
    parser.add_argument("--ranks-per-node", type=positive, help="default: every logical core / GPU")
    parser.add_argument("--fsdp", type=positive, help="FSDP degree (default: the remaining ranks)")
    parser.add_argument("--tp", type=positive, help="tensor-parallel degree")
    parser.add_argument("--ep", type=positive, help="expert-parallel degree (MoE recipes)")
    parser.add_argument("--seq-len", type=positive, help="override the recipe's sequence length")
    parser.add_argument("--local-batch-size", type=positive, help="override the local batch size")
    parser.add_argument(
        "--global-batch-size",
        type=positive,
        help="samples per optimizer step over all ranks (default: the recipe's per node, times "
        "--nodes); a multiple of local batch x data-parallel ranks",
    )
    parser.add_argument("--ac", choices=AC_MODES, help="activation checkpointing mode")
    parser.add_argument("--steps", type=positive, help="override the number of training steps")
    parser.add_argument(
        "--dump-folder", help="run folder for checkpoints and logs (shared by nodes)"
    )
    parser.add_argument(
        "--checkpoint-interval", type=positive, help="save a checkpoint every N steps"
    )
    parser.add_argument(
        "--compile-cache",
        help="Neuron compile (NEFF) cache folder, kept across runs (default: "
        f"$TORCH_NEURONX_NEFF_CACHE_DIR, else {DEFAULT_COMPILE_CACHE})",
    )
    parser.add_argument(
        "overrides",
        nargs="*",
        metavar="-- OVERRIDE",
        help="after `--`: torchtitan config overrides for every rank, checked by the plan, "
        "e.g. `-- --compile.enable`",
    )


def add_resume_argument(parser: Any) -> None:
    """`--resume` of the commands that launch or show a plan for one dump folder (plan, run)."""
    parser.add_argument(
        "--resume",
        choices=RESUME_MODES,
        default="auto",
        help="the dump folder's checkpoints: fresh (refuse any), latest (continue the newest, "
        "which must exist) or auto (latest if there is one: what a requeued job needs; default)",
    )


def plan_from_args(args: Any, **extra: Any) -> LaunchPlan:
    """The plan the command line asks for: resolved from the flags, or read from `--plan FILE`
    (a plan `slurm` wrote: every node runs exactly it)."""
    if getattr(args, "plan", None):
        if args.recipe:
            raise LaunchError(
                "--plan FILE already names the recipe and every setting; drop --recipe and the "
                "other plan flags, or drop --plan."
            )
        return load_plan(args.plan, **extra)
    if not args.recipe:
        raise LaunchError("Name the run: pass --recipe NAME (or --plan FILE).")
    extra = {k: v for k, v in extra.items() if v is not None}  # unset: resolve_plan's default
    return resolve_plan(
        args.recipe,
        instance=args.instance,
        nodes=args.nodes,
        lnc=args.lnc,
        ranks_per_node=args.ranks_per_node,
        fsdp=args.fsdp,
        tp=args.tp,
        ep=args.ep,
        seq_len=args.seq_len,
        local_batch=args.local_batch_size,
        global_batch=args.global_batch_size,
        activation_checkpoint=args.ac,
        steps=args.steps,
        compile_cache=args.compile_cache,
        dump_folder=args.dump_folder,
        checkpoint_interval=args.checkpoint_interval,
        extra_overrides=list(getattr(args, "overrides", None) or []),
        resume=getattr(args, "resume", "auto"),
        **extra,
    )


def describe(plan: LaunchPlan) -> str:
    """The plan as a short human-readable block."""
    d = plan.to_dict()
    t = plan.topology
    p = d["parallelism"]
    m = d["memory_per_rank"]
    rule = d["seq_len_rule"]
    lines = [
        f"recipe        {plan.recipe}  ({d['model']['name']} {d['model']['flavor']}, "
        f"{(plan.model_shape.params if plan.model_shape else 0) / 1e9:.2f}B params)",
        f"instance      {t.name} x {plan.nodes} node(s): {t.target.description}",
        f"ranks         {plan.world_size} = {plan.nodes} x {plan.ranks_per_node} per node, "
        f"{t.device_type} / {t.backend}"
        + (f", LNC {plan.lnc}" if t.device_type == "neuron" else ""),
        f"parallelism   FSDP {p['fsdp']}  TP {p['tp']}  EP {p['ep']}  CP {p['cp']}  PP {p['pp']}"
        f"  DP-replicate {p['dp_replicate']}",
        f"batch         seq len {plan.seq_len} (multiple of {rule['multiple_of']}: "
        f"{'ok' if rule['ok'] else 'NO'}), local {plan.local_batch}, global {plan.global_batch}, "
        f"{plan.steps} steps, activation checkpointing {plan.activation_checkpoint}",
        f"run folder    {plan.run_folder} (resume: {plan.resume})",
        *(
            [f"compile       torch.compile, backend {plan.config.compile.backend}"]
            if plan.config.compile.enable
            else []
        ),
        f"memory/rank   {m['total_gib']:.2f} GiB of {m['available_gib']:.2f} GiB "
        f"(state {m['sharded_state_gib']:.2f}, gathered {m['unsharded_transient_gib']:.2f}, "
        f"activations {m['activations_gib']:.2f}, logits {m['logits_gib']:.2f})",
    ]
    lines += [
        f"env           {k}={v}  ({plan.env_sources.get(k, 'plan')})" for k, v in plan.env.items()
    ]
    lines.append(f"command       {plan.command()}")
    return "\n".join(lines)
