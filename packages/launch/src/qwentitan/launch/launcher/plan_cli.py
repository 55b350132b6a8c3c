"""The command line of a `RunRequest`: one table of flags, shared by every command that resolves
a plan, and the plan's human-readable form.

Each flag sets the request field of its `dest`; a flag's first name is its name, the others are
aliases kept for one release (`--ranks` for `--ranks-per-node`, `--dump-folder` for
`--run-dir`). A refusal about a field is said with the spelling the user typed (`phrasing`).
"""

from __future__ import annotations

import argparse
import dataclasses
import re
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from qwentitan.launch.base.errors import LaunchError
from qwentitan.launch.base.target import TARGETS
from qwentitan.launch.launcher.flags import OneLineErrorParser, non_negative, positive
from qwentitan.launch.launcher.plan import (
    DEFAULT_COMPILE_CACHE,
    LaunchPlan,
    resolve_plan,
)
from qwentitan.launch.launcher.remote import is_remote
from qwentitan.launch.launcher.request import AC_MODES, RESUME_MODES, TRAINER_FIELDS, RunRequest
from qwentitan.launch.recipes import recipe_names

__all__ = [
    "FLAGS",
    "LAYOUT",
    "SHARED",
    "HintingParser",
    "add_request_flags",
    "describe",
    "flag_of",
    "phrasing",
    "plan_from_args",
    "request_from_args",
]


@dataclass(frozen=True, slots=True)
class Flag:
    """One request field on the command line."""

    field: str
    names: tuple[str, ...]
    help: str
    type: Callable[[str], Any] | None = positive
    choices: tuple[str, ...] | None = None


FLAGS = {
    flag.field: flag
    for flag in (
        Flag("recipe", ("--recipe",), f"one of {', '.join(recipe_names())}", None),
        Flag(
            "instance",
            ("--instance",),
            f"one of {', '.join(TARGETS)} (default: trn2.48xlarge for trn2 recipes, else "
            "this host: Neuron, else CUDA, else CPU)",
            None,
        ),
        Flag("nodes", ("--nodes", "--nnodes"), "number of nodes (default 1)"),
        Flag(
            "ranks_per_node",
            ("--ranks-per-node", "--ranks"),
            "processes per node (default: every logical core / GPU; 2 on a CPU host, which "
            "also takes more than it has cores)",
        ),
        Flag("lnc", ("--lnc",), "logical NeuronCore size, 1 or 2 (trn2 default 2)"),
        Flag("tp", ("--tp",), "tensor-parallel degree"),
        Flag("fsdp", ("--fsdp",), "FSDP degree (default: the ranks the other degrees leave)"),
        Flag("ep", ("--ep",), "expert-parallel degree (MoE recipes; borrows FSDP's ranks)"),
        Flag("pp", ("--pp",), "pipeline-parallel degree"),
        Flag(
            "dp_replicate",
            ("--dp-replicate",),
            "data-parallel replicas, each sharded by --fsdp (HSDP)",
        ),
        Flag("ac", ("--ac",), "activation checkpointing mode", None, AC_MODES),
        Flag(
            "global_batch_size",
            ("--global-batch-size",),
            "samples per optimizer step over all ranks (default: the recipe's per node, times "
            "--nodes); a multiple of local batch x data-parallel ranks",
        ),
        Flag("seq_len", ("--seq-len",), "tokens per sample (default: the recipe's)"),
        Flag("local_batch_size", ("--local-batch-size",), "samples per rank per step"),
        Flag("steps", ("--steps",), "total steps to reach (default: the recipe's)"),
        Flag(
            "stop_after",
            ("--stop-after",),
            "stop after this step with a checkpoint (resume later)",
        ),
        Flag(
            "stop_by",
            ("--stop-by",),
            "stop at a step boundary with a checkpoint written before TIME: ISO 8601 UTC "
            "(2026-12-03T18:00:00Z) or a duration from now (+90m, +1h30m); budgets the measured "
            "save and step times plus a margin; --resume continues",
            None,
        ),
        Flag(
            "run_dir",
            ("--run-dir", "--dump-folder"),
            "run folder for checkpoints, logs and reports (shared by the nodes)",
            None,
        ),
        Flag(
            "resume",
            ("--resume",),
            "the run folder's checkpoints: fresh (refuse any), latest (continue the newest, "
            "which must exist; a bare --resume) or auto (latest if there is one, else fresh)",
            None,
            RESUME_MODES,
        ),
        Flag("checkpoint_interval", ("--checkpoint-interval",), "save a checkpoint every N steps"),
        Flag(
            "hf_every",
            ("--hf-every",),
            "export each checkpoint at a multiple of N steps, and the last, to RUN/hf/step-N as "
            "a verified Hugging Face folder, in the background",
        ),
        Flag("hf_keep", ("--hf-keep",), "keep the newest K Hugging Face exports (default: all)"),
        Flag(
            "compile_cache",
            ("--compile-cache",),
            "Neuron compile (NEFF) cache folder, kept across runs (default: "
            f"$TORCH_NEURONX_NEFF_CACHE_DIR, else {DEFAULT_COMPILE_CACHE})",
            None,
        ),
        Flag(
            "dataset",
            ("--dataset",),
            "`offline`, a c4-style JSON-lines file or folder, or a Hub dataset name",
            None,
        ),
        Flag(
            "tokenizer",
            ("--tokenizer",),
            "Hugging Face model folder holding tokenizer.json (default: the recipe's)",
            None,
        ),
        Flag(
            "validate_every",
            ("--validate-every",),
            "validation loss every N steps (default: the recipe's)",
        ),
        Flag(
            "rdzv_endpoint",
            ("--rdzv-endpoint",),
            "HOST:PORT of the c10d rendezvous, on the first node (default localhost:0, one node)",
            None,
        ),
        Flag(
            "max_restarts",
            ("--max-restarts",),
            "torchrun restarts of the whole group after a rank fails; each resumes from the "
            "last checkpoint",
            non_negative,
        ),
    )
}
# The layout of a run: one meaning on every command, the pilot's included.
LAYOUT = ("tp", "fsdp", "ep", "pp", "dp_replicate", "ac", "global_batch_size")
# What every command that resolves a plan takes (train, plan, run, slurm, preflight).
SHARED = (
    *("recipe", "instance", "nodes", "ranks_per_node", "lnc"),
    *LAYOUT,
    *("seq_len", "local_batch_size", "steps", "stop_after", "stop_by"),
    *("run_dir", "resume", "checkpoint_interval", "hf_every", "hf_keep", "compile_cache"),
    *("dataset", "tokenizer", "validate_every"),
)


class _Spelled(argparse.Action):
    """Stores the value under the field's name and remembers how the user spelled the flag."""

    def __call__(self, parser: Any, namespace: Any, values: Any, option: Any = None) -> None:
        setattr(namespace, self.dest, values)
        spelled = dict(getattr(namespace, "spelled", None) or {})
        spelled[self.dest] = option
        namespace.spelled = spelled


def add_request_flags(
    parser: argparse.ArgumentParser,
    fields: Iterable[str] = SHARED,
    *,
    defaults: Mapping[str, Any] | None = None,
    required: Iterable[str] = (),
    helps: Mapping[str, str] | None = None,
    overrides: bool = True,
) -> None:
    """Add the flags of `fields` (and, with `overrides`, the torchtitan overrides after `--`).
    Unset flags are None, so the request keeps its own defaults unless `defaults` says else;
    `helps` replaces a flag's help where the command gives it another default."""
    defaults, helps = dict(defaults or {}), dict(helps or {})
    for name in fields:
        flag = FLAGS[name]
        extra: dict[str, Any] = {"choices": flag.choices} if flag.choices else {}
        if name == "resume":
            extra.update(nargs="?", const="latest")  # a bare --resume continues the latest
        parser.add_argument(
            *flag.names,
            dest=name,
            action=_Spelled,
            type=flag.type,
            default=defaults.get(name),
            required=name in required,
            help=helps.get(name, flag.help)
            + (f" (default {defaults[name]})" if name in defaults else ""),
            **extra,
        )
    if overrides:
        parser.add_argument(
            "overrides",
            nargs="*",
            metavar="-- OVERRIDE",
            help="after `--`: torchtitan config overrides for every rank, checked by the plan, "
            "e.g. `-- --compile.enable`",
        )


def request_from_args(args: argparse.Namespace, **changes: Any) -> RunRequest:
    """The request the parsed flags ask for; `changes` are the command's own choices."""
    given = {
        field.name: getattr(args, field.name)
        for field in dataclasses.fields(RunRequest)
        if getattr(args, field.name, None) is not None
    }
    given["overrides"] = tuple(getattr(args, "overrides", None) or ())
    return RunRequest(**{**given, **changes})


def flag_of(field: str) -> str:
    """The flag that sets request field `field`."""
    flag = FLAGS.get(field)
    return flag.names[0] if flag else "--" + field.replace("_", "-")


def phrasing(args: argparse.Namespace | None) -> Callable[[str], str]:
    """How the command line names a request field: as the user spelled its flag, else its flag."""
    spelled = getattr(args, "spelled", None) or {}
    return lambda field: spelled.get(field) or flag_of(field)


def plan_from_args(args: argparse.Namespace, **changes: Any) -> LaunchPlan:
    """The plan the command line asks for: resolved from the flags, or read from `--plan FILE`
    (a plan `slurm` wrote: every node runs exactly it)."""
    if getattr(args, "plan", None):
        from qwentitan.launch.launcher.plan_file import load_plan

        if args.recipe:
            raise LaunchError(
                "--plan FILE already names the recipe and every setting; drop {recipe} and the "
                "other plan flags, or drop --plan.",
                field="recipe",
            )
        return load_plan(args.plan, **changes)
    if not getattr(args, "recipe", None):
        raise LaunchError(
            f"Name the run: pass {{recipe}} NAME (or --plan FILE); NAME is one of "
            f"{', '.join(_recipes_for(getattr(args, 'instance', None)))}.",
            field="recipe",
        )
    changes = {k: v for k, v in changes.items() if v is not None}  # unset: the request's default
    return resolve_plan(request_from_args(args, **changes))


def _measured(plan: LaunchPlan) -> str:
    """What a step line's memory measures on the plan's device."""
    from qwentitan.launch.runtime.platforms import MEMORY_MEASURED

    device = plan.topology.device_type
    return MEMORY_MEASURED.get(device, MEMORY_MEASURED["neuron"])


def _recipes_for(instance: str | None) -> list[str]:
    """The recipes written for `instance` (all of them when none is named)."""
    from qwentitan.launch.recipes import recipe_info

    every = recipe_names()
    if instance is None:
        return every
    return [name for name in every if recipe_info(name).instance == instance] or every


def describe(plan: LaunchPlan) -> str:
    """The plan as a short human-readable block."""
    t, dims, m = plan.topology, plan.dims, plan.memory.to_dict()
    multiple = t.seq_len_multiple
    spec = plan.config.model_spec
    lines = [
        f"recipe        {plan.recipe}  ({getattr(spec, 'name', None)} "
        f"{getattr(spec, 'flavor', None)}, {plan.model_shape.params / 1e9:.2f}B params)",
        f"instance      {t.name} x {plan.nodes} node(s): {t.target.description}",
        f"ranks         {plan.world_size} = {plan.nodes} x {plan.ranks_per_node} per node, "
        f"{t.device_type} / {t.backend}"
        + (f", LNC {plan.lnc}" if t.device_type == "neuron" else ""),
        *([f"note          {plan.note}"] if plan.note else []),
        f"parallelism   FSDP {dims.dp_shard}  TP {dims.tp}  EP {dims.ep}  CP {dims.cp}  "
        f"PP {dims.pp}  DP-replicate {dims.dp_replicate}",
        f"batch         seq len {plan.seq_len} (multiple of {multiple}: "
        f"{'ok' if plan.seq_len % multiple == 0 else 'NO'}), local {plan.local_batch}, "
        f"global {plan.global_batch}, {plan.steps} steps, activation checkpointing "
        f"{plan.activation_checkpoint}",
        f"run folder    {plan.run_folder} (resume: {plan.resume})"
        + (
            f", checkpoints in {plan.checkpoint_folder}"
            if is_remote(plan.checkpoint_folder)
            else ""
        ),
        *(
            [f"compile       torch.compile, backend {plan.compile_backend}"]
            if plan.compile_backend
            else []
        ),
        f"memory/rank   {m['total_gib']:.2f} GiB of {m['available_gib']:.2f} GiB, estimated: "
        f"model and optimizer state {m['sharded_state_gib']:.2f}, gathered weights "
        f"{m['unsharded_transient_gib']:.2f}, activations {m['activations_gib']:.2f}, logits "
        f"{m['logits_gib']:.2f} (a step line's memory: {_measured(plan)})",
    ]
    lines += [
        f"env           {k}={v}  ({plan.env_sources.get(k, 'plan')})" for k, v in plan.env.items()
    ]
    lines.append(f"command       {plan.command()}")
    return "\n".join(lines)


def torchtitan_hint(message: str) -> str:
    """For argparse's `unrecognized arguments: --training.steps 5`, a torchtitan option typed
    where a qwentitan flag goes: the flag of ours that sets it, or the `--` passthrough."""
    found = re.fullmatch(r"unrecognized arguments: (.*)", message)
    words = found.group(1).split() if found else []
    dotted = [w.split("=", 1)[0] for w in words if w.startswith("--") and "." in w.split("=")[0]]
    if not dotted:
        return ""
    ours = {
        option.replace("_", "-"): FLAGS[field].names[0]
        for field, options in TRAINER_FIELDS.items()
        if field in FLAGS
        for option in options
    }
    flags = [ours[name.replace("_", "-")] for name in dotted if name.replace("_", "-") in ours]
    example = " ".join(f"{name} VALUE" for name in dotted)
    passthrough = f"torchtitan's options go after `--`, as `-- {example}`"
    return f"use {', '.join(flags)} (or {passthrough})" if flags else passthrough


class HintingParser(OneLineErrorParser):
    """The CLI's parser: a torchtitan option typed where a flag goes gets `torchtitan_hint`."""

    def hint(self, message: str) -> str:
        return torchtitan_hint(message)
