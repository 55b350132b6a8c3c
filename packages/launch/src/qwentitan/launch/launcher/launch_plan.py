"""`LaunchPlan`: one run as frozen data, and the one JSON form of it.

A run is the recipe, the torchtitan overrides every rank gets (the machine kind among them:
`--target`, `--lnc`), the topology of a node and the ranks' environment, plus the launch facts
torchrun needs (nodes, rendezvous, restarts, resume mode). Nothing else is stored: every derived
fact (the parsed `Trainer.Config`, torchtitan's `ParallelDims`, the model's shape, memory per
rank, the console rank, the batch) is a property read from the config that torchtitan's parser
builds from exactly these overrides, computed once. `to_json` / `from_json` are the plan's one
codec; the plan file `slurm` writes is that JSON (`plan_file`), checked field by field on read.
"""

from __future__ import annotations

import json
import shlex
import sys
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, fields
from functools import cached_property
from pathlib import Path
from typing import TYPE_CHECKING, Any

from qwentitan.launch.base.errors import LaunchError
from qwentitan.launch.base.target import TARGETS, Topology, get_topology
from qwentitan.launch.launcher import environment
from qwentitan.launch.launcher.recipe_config import RECIPES_MODULE, load_config
from qwentitan.launch.launcher.request import RESUME_MODES, override_refusal
from qwentitan.launch.launcher.supervisor import TRAIN_ENTRY

if TYPE_CHECKING:
    from torchtitan.distributed.parallel_dims import ParallelDims

    from qwentitan.launch.launcher.memory import MemoryEstimate, ModelShape

__all__ = ["FORMAT", "LaunchPlan"]

FORMAT = "qwentitan-plan/1"
# RUN_DIR/logs: torchrun's whole output of every rank (`--log-dir`), whatever the console shows.
LOGS_FOLDER = "logs"
# Derived facts a pickled plan keeps (the plan's child process hands the plan to `train`, which
# must not import torch to read them); the config and the torch objects stay behind.
_PLAIN_FACTS = ("console_rank", "run_folder", "checkpoints", "summary_file", "hf_export_file")


@dataclass(frozen=True, kw_only=True)
class LaunchPlan:
    """A resolved run: recipe, overrides, topology, environment; all else derived from them."""

    recipe: str
    overrides: tuple[str, ...]
    topology: Topology
    nodes: int = 1
    env: dict[str, str] = field(default_factory=dict)
    env_sources: dict[str, str] = field(default_factory=dict)
    """Where each value of `env` came from: flag, environment, default or plan."""
    resume: str = "auto"  # one of RESUME_MODES
    rdzv_endpoint: str = "localhost:0"
    max_restarts: int = 0

    def __post_init__(self) -> None:
        object.__setattr__(self, "overrides", tuple(self.overrides))  # frozen, as the rest

    # -- derived from the config every rank builds -------------------------------------------

    @cached_property
    def config(self) -> Any:
        """The recipe's torchtitan Trainer.Config with the overrides applied, as every rank
        builds it; parsed once per plan, and read only."""
        return load_config(self.recipe, list(self.overrides))

    def parsed_as(self, config: Any) -> LaunchPlan:
        """This plan, its config the one already parsed from exactly its recipe and overrides
        (`resolve_plan` parses before it knows the environment), so it is not parsed again."""
        self.__dict__["config"] = config
        return self

    @cached_property
    def dims(self) -> ParallelDims:
        """torchtitan's ParallelDims of this run: built (and so checked) as every rank builds it."""
        from qwentitan.launch.launcher.plan_rules import parallel_dims

        return parallel_dims(self.config.parallelism, self.world_size, self.topology)

    @cached_property
    def model_shape(self) -> ModelShape:
        """The shape of the recipe's model, read from its meta-device build."""
        from qwentitan.launch.launcher.memory import ModelShape, meta_model

        return ModelShape.of(meta_model(self.config))

    @cached_property
    def memory(self) -> MemoryEstimate:
        from qwentitan.launch.launcher.memory import estimate_for

        return estimate_for(
            self.config, self.model_shape, self.dims, self.topology, self.activation_checkpoint
        )

    @cached_property
    def console_rank(self) -> int:
        """The local rank whose lines the console shows (torchrun's `--local-ranks-filter`):
        torchtitan's metrics rank, on its node (under PP the first rank of the last stage, the
        only one that has the loss)."""
        from torchtitan.components.metrics import _get_metrics_rank

        schedule = self.config.parallelism.pipeline_parallel_schedule
        rank = _get_metrics_rank(parallel_dims=self.dims, pp_schedule=schedule)
        return rank % self.ranks_per_node

    @cached_property
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

    @cached_property
    def checkpoints(self) -> str | None:
        """Where the run saves its checkpoints, None when it saves none."""
        return str(self.checkpoint_folder) if self.config.checkpoint.enable else None

    @cached_property
    def summary_file(self) -> Path:
        """RUN_DIR/reports/summary.json, which the metrics rank writes at close."""
        from qwentitan.launch.tracking.logger import REPORTS_FOLDER, SUMMARY

        return self.run_folder / REPORTS_FOLDER / f"{SUMMARY}.json"

    @cached_property
    def hf_export_file(self) -> Path:
        """RUN_DIR/reports/hf_export.json: rank 0's last Hugging Face export (`--hf-every`)."""
        from qwentitan.launch.tracking.logger import HF_EXPORT, REPORTS_FOLDER

        return self.run_folder / REPORTS_FOLDER / f"{HF_EXPORT}.json"

    @property
    def seq_len(self) -> int:
        return self.config.training.seq_len

    @property
    def local_batch(self) -> int:
        return self.config.training.local_batch_size

    @property
    def batch_ranks(self) -> int:
        """The data-parallel ranks: each reads its own local batch."""
        return self.dims.dp_shard * self.dims.dp_replicate

    @property
    def global_batch(self) -> int:
        """Samples per optimizer step (-1 in the config: one local batch per data-parallel rank)."""
        batch = self.config.training.global_batch_size
        return batch if batch > 0 else self.local_batch * self.batch_ranks

    @property
    def steps(self) -> int:
        return self.config.training.steps

    @property
    def activation_checkpoint(self) -> str:
        ac = self.config.activation_checkpoint
        if ac is None:
            return "none"
        return "full" if type(ac).__qualname__.split(".")[0] == "FullAC" else "selective"

    @property
    def compile_backend(self) -> str | None:
        return self.config.compile.backend if self.config.compile.enable else None

    # -- the node ------------------------------------------------------------------------------

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
        # every rank's whole output in the run folder; the console rank's also on the console
        args += [f"--local-ranks-filter={self.console_rank}", "--role=rank", "--tee=3"]
        args.append(f"--log-dir={self.run_folder / LOGS_FOLDER}")
        return [*args, "-m", TRAIN_ENTRY, *self.trainer_args()]

    def launch_argv(self) -> list[str]:
        """What `train` and `run` execute: `torchrun_args()` through this Python's torchrun
        (`qwentitan.launch.launcher.agent`: torchrun's own parser and run, a failed rank in one
        line)."""
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

    def __getstate__(self) -> dict[str, Any]:
        """The fields and the plain facts (computed here if need be), never the config."""
        names = [f.name for f in fields(self)]
        return {name: getattr(self, name) for name in (*names, *_PLAIN_FACTS)}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)

    # -- the codec -----------------------------------------------------------------------------

    def to_json(self) -> dict[str, Any]:
        """The plan as JSON data: what a plan file holds, and what `from_json` reads back."""
        return {
            "format": FORMAT,
            "recipe": self.recipe,
            "instance": self.topology.name,
            "lnc": self.lnc,
            "ranks_per_node": self.ranks_per_node,
            "nodes": self.nodes,
            "overrides": list(self.overrides),
            "env": dict(self.env),
            "env_sources": dict(self.env_sources),
            "resume": self.resume,
            "rdzv_endpoint": self.rdzv_endpoint,
            "max_restarts": self.max_restarts,
        }

    @classmethod
    def from_json(cls, record: Any, where: str = "The plan") -> LaunchPlan:
        """The plan `to_json` wrote, every field checked before any value reaches torchtitan's
        parser (which imports the module an `--module` override names), torchrun or the ranks'
        environment; `where` opens a refusal (`The plan file PATH`)."""
        fix = "write it again with `slurm`"
        if not isinstance(record, dict) or record.get("format") != FORMAT:
            raise LaunchError(f"{where} is not a plan of this qwentitan ({FORMAT}); {fix}.")
        for name, check in _SCHEMA.items():
            if name not in record:
                raise LaunchError(f"{where} has no {name!r} field; {fix}.")
            why = check(record[name])
            if why:
                value = record[name]
                shown = "" if isinstance(value, dict | list) else f" {_shown(value)}"
                raise LaunchError(f"{where} is refused: its {name!r}{shown} {why}; {fix}.")
        topology = get_topology(
            record["instance"], lnc=record["lnc"], ranks_per_node=record["ranks_per_node"]
        )
        return cls(
            recipe=record["recipe"],
            overrides=tuple(record["overrides"]),
            topology=topology,
            nodes=record["nodes"],
            env=dict(record["env"]),
            env_sources=dict(record["env_sources"]),
            resume=record["resume"],
            rdzv_endpoint=record["rdzv_endpoint"],
            max_restarts=record["max_restarts"],
        )

    def facts(self) -> dict[str, Any]:
        """The plan as `plan --json` prints it: its JSON and the facts derived from its config."""
        dims, cfg = self.dims, self.config
        return {
            **self.to_json(),
            "topology": self.topology.to_dict(),
            "world_size": self.world_size,
            "parallelism": {"fsdp": dims.dp_shard, "dp_replicate": dims.dp_replicate,
                            "tp": dims.tp, "cp": dims.cp, "pp": dims.pp, "ep": dims.ep},
            "seq_len": self.seq_len,
            "seq_len_rule": {
                "multiple_of": self.topology.seq_len_multiple,
                "rule": "NKI attention" if self.topology.device_type == "neuron" else "none",
                "ok": self.seq_len % self.topology.seq_len_multiple == 0,
            },
            "local_batch": self.local_batch,
            "global_batch": self.global_batch,
            "gradient_accumulation_steps": self.global_batch
            // (self.local_batch * self.batch_ranks),
            "steps": self.steps,
            "activation_checkpoint": self.activation_checkpoint,
            "model": {"name": getattr(cfg.model_spec, "name", None),
                      "flavor": getattr(cfg.model_spec, "flavor", None),
                      "params": self.model_shape.params,
                      "experts": self.model_shape.experts,
                      "top_k": self.model_shape.top_k},
            "config": {"hf_assets_path": cfg.hf_assets_path, "dump_folder": cfg.dump_folder,
                       "dataset": getattr(cfg.dataloader, "dataset", None),
                       "training_dtype": cfg.training.dtype,
                       "checkpoint_enabled": getattr(cfg.checkpoint, "enable", None),
                       "checkpoint_folder": getattr(cfg.checkpoint, "folder", None),
                       "checkpoint_interval": getattr(cfg.checkpoint, "interval", None),
                       "initial_load_in_hf": getattr(cfg.checkpoint, "initial_load_in_hf", None),
                       "last_save_in_hf": getattr(cfg.checkpoint, "last_save_in_hf", None),
                       "compile": cfg.compile.enable, "compile_backend": self.compile_backend},
            "torchrun": self.torchrun_args(),
            "memory_per_rank": self.memory.to_dict(),
        }  # fmt: skip


# -- the schema of `from_json`: each field's check (None: good; else why not, after the value) --


def _shown(value: Any) -> str:
    """A value as the JSON file spells it (`null`, `"two"`), cut short."""
    text = json.dumps(value, default=str)
    return text if len(text) <= 60 else text[:56] + " ..."


def _whole(low: int) -> Callable[[Any], str | None]:
    def check(value: Any) -> str | None:
        if type(value) is not int:
            return "is not a whole number"
        return None if value >= low else f"is below {low}"

    return check


def _one_of(choices: tuple[Any, ...]) -> Callable[[Any], str | None]:
    def check(value: Any) -> str | None:
        ok = value in choices and type(value) in {type(c) for c in choices}
        return None if ok else f"is not one of {', '.join(map(str, choices))}"

    return check


def _overrides(value: Any) -> str | None:
    if not isinstance(value, list):
        return "is not a list of torchtitan overrides (one string per word)"
    for word in value:
        if not isinstance(word, str) or "\0" in word:
            return f"holds {_shown(word)}, which is not an override word"
        why = override_refusal(word)
        if why:
            return f"holds {word.split('=', 1)[0]} ({why})"
    return None


def _env(value: Any) -> str | None:
    if not isinstance(value, dict):
        return f"is not a table of variable names and values ({environment.PLAN_ENV_RULE})"
    for name, setting in value.items():
        why = environment.plan_env_refusal(name, setting)
        if why:
            return f"holds {_shown(name)}, {why}"
    return None


def _env_sources(value: Any) -> str | None:
    sources = environment.SOURCES
    ok = isinstance(value, dict) and all(
        isinstance(k, str) and v in sources for k, v in value.items()
    )
    return None if ok else f"is not a table of variable names and {', '.join(sources)}"


def _endpoint(value: Any) -> str | None:
    ok = isinstance(value, str) and value and not any(c.isspace() or c == "\0" for c in value)
    return None if ok else "is not HOST:PORT"


_SCHEMA: dict[str, Callable[[Any], str | None]] = {
    "recipe": lambda v: None if isinstance(v, str) and v.isidentifier() else "is no recipe name",
    "instance": _one_of(tuple(TARGETS)),
    "lnc": _one_of((1, 2)),
    "ranks_per_node": _whole(1),
    "nodes": _whole(1),
    "overrides": _overrides,
    "env": _env,
    "env_sources": _env_sources,
    "resume": _one_of(RESUME_MODES),
    "rdzv_endpoint": _endpoint,
    "max_restarts": _whole(0),
}
