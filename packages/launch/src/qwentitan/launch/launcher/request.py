"""`RunRequest`: what a user asks of a run, as one typed value.

Every command that resolves a plan (`train`, `plan`, `run`, `slurm`, `preflight`) and the pilot
build one from the same flags (`plan_cli`), and `resolve_plan(request)` turns it into a checked
`LaunchPlan`. Each field means the same everywhere; `None` leaves the recipe's own value. A
value the request cannot hold is refused on construction, naming its field (`LaunchError.field`).

The request reaches the ranks as torchtitan overrides (`trainer_overrides`), which torchtitan's
own parser applies to the recipe on every rank exactly as the plan applied them.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from pathlib import Path

from qwentitan.launch.base.deadline import format_utc, parse_stop_by
from qwentitan.launch.base.errors import LaunchError
from qwentitan.launch.launcher.remote import canonical_url, is_remote, local_folder

__all__ = ["AC_MODES", "RESUME_MODES", "TRAINER_FIELDS", "RunRequest", "override_refusal"]

AC_MODES = ("none", "selective", "full")
# What the ranks do with the checkpoints already in the run folder (torchtitan itself always
# loads the newest one it finds; the launcher checks the folder against this before starting):
# "fresh" - start at step 1: a folder that already holds checkpoints is refused, never emptied;
# "latest" - continue the newest checkpoint, which must exist and be whole;
# "auto" - "latest" when there is one, else "fresh" (a requeued scheduler job).
RESUME_MODES = ("fresh", "latest", "auto")

# The request fields torchtitan's config holds, and the override that sets each on the ranks.
TRAINER_FIELDS: dict[str, tuple[str, ...]] = {
    "seq_len": ("--training.seq-len",),
    "local_batch_size": ("--training.local-batch-size",),
    "global_batch_size": ("--training.global-batch-size",),
    "steps": ("--training.steps",),
    "stop_after": ("--stop-after",),
    "stop_by": ("--stop-by",),
    "fsdp": ("--parallelism.data-parallel-shard-degree",),
    "dp_replicate": ("--parallelism.data-parallel-replicate-degree",),
    "tp": ("--parallelism.tensor-parallel-degree",),
    "pp": ("--parallelism.pipeline-parallel-degree",),
    "ep": ("--parallelism.expert-parallel-degree",),
    "run_dir": ("--dump-folder",),
    "checkpoint_interval": ("--checkpoint.interval",),
    "hf_every": ("--checkpoint.hf-every",),
    "hf_keep": ("--checkpoint.hf-keep",),
    "dataset": ("--dataloader.dataset", "--validator.dataloader.dataset"),
    "tokenizer": ("--hf-assets-path",),
    "validate_every": ("--validator.freq",),
}


# Overrides that would choose what torchtitan's parser imports and which config it builds
# (`--module` imports any installed module) or load a config file: the recipe names those.
_RESERVED = ("--module", "--config", "--job.", "--job-")
# torchtitan 0.3.0's `Trainer.__init__` imports every module `override.imports` names (its only
# other import by name, besides `--module`); a run imports no code a plan or an override names.
_IMPORTING = ("--override.", "--override-")
_IMPORTS_WHY = "torchtitan would import the module it names, and a run imports no code by name"


def override_refusal(word: str) -> str | None:
    """Why `word` may not be a trainer override (None: it may)."""
    name = word.split("=", 1)[0]
    if name in _RESERVED[:2] or name.startswith(_RESERVED[2:]):
        return "the recipe alone chooses torchtitan's module and config"
    if name.startswith(_IMPORTING):
        return _IMPORTS_WHY
    return None


@dataclass(frozen=True, slots=True, kw_only=True)
class RunRequest:
    """One run as asked for: recipe, placement, layout, sizes, run folder and overrides."""

    recipe: str
    instance: str | None = None
    """A Target name; None: the recipe's (trn2 recipes), else this host's."""
    nodes: int = 1
    ranks_per_node: int | None = None
    """None: every logical core / GPU of a node; two on the CPU host."""
    lnc: int | None = None
    """Logical NeuronCore size; None: the shell's NEURON_LOGICAL_NC_CONFIG, else the Target's."""
    tp: int | None = None
    fsdp: int | None = None
    """FSDP degree; None: the ranks the other degrees leave."""
    ep: int | None = None
    pp: int | None = None
    dp_replicate: int | None = None
    ac: str | None = None
    """Activation checkpointing, one of AC_MODES."""
    global_batch_size: int | None = None
    """Samples per optimizer step; None: the recipe's per node, times `nodes`."""
    seq_len: int | None = None
    local_batch_size: int | None = None
    steps: int | None = None
    stop_after: int | None = None
    """Stop after this step with a full checkpoint (a later run resumes it)."""
    stop_by: str | None = None
    """Stop at a step boundary with a checkpoint written before this time (`base.deadline`: ISO
    8601 UTC or +DURATION; held as the absolute UTC time, fixed when the request is made)."""
    run_dir: str | None = None
    """torchtitan's dump folder: checkpoints, logs, reports."""
    resume: str = "auto"
    """One of RESUME_MODES."""
    checkpoint_interval: int | None = None
    hf_every: int | None = None
    """Export each checkpoint at a multiple of this step, and the last, to RUN/hf/step-N."""
    hf_keep: int | None = None
    """Keep the newest this many exports (None: the recipe's, by default all)."""
    compile_cache: str | None = None
    rdzv_endpoint: str | None = None
    max_restarts: int = 0
    dataset: str | None = None
    tokenizer: str | None = None
    """A Hugging Face model folder holding tokenizer.json."""
    validate_every: int | None = None
    overrides: tuple[str, ...] = ()
    """torchtitan overrides for every rank, after the fields' own (so they win)."""

    def __post_init__(self) -> None:
        for name in _COUNTS:
            value = getattr(self, name)
            if value is not None and value < 1:
                raise LaunchError(
                    f"{{{name}}} {value} is out of range; pass a whole number of 1 or more.",
                    field=name,
                )
        if self.max_restarts < 0:
            raise LaunchError(
                f"{{max_restarts}} {self.max_restarts} is out of range; pass 0 or more.",
                field="max_restarts",
            )
        for name, what, choices in (
            ("resume", "resume mode", RESUME_MODES),
            ("ac", "activation checkpointing mode", AC_MODES),
        ):
            value = getattr(self, name)
            if value is not None and value not in choices:
                raise LaunchError(
                    f"Unknown {what} {value!r}; pass {{{name}}} with one of {', '.join(choices)}.",
                    field=name,
                )

        for word in self.overrides:
            why = override_refusal(word)
            if why:
                fix = "drop it" if why == _IMPORTS_WHY else "pass {recipe} NAME instead"
                raise LaunchError(f"The override {word} is refused: {why}; {fix}.", field="recipe")
        if self.stop_by is not None:
            object.__setattr__(self, "stop_by", _absolute_stop_by(self.stop_by))
        if self.run_dir is not None and is_remote(self.run_dir):
            object.__setattr__(self, "run_dir", canonical_url(self.run_dir))  # s3:// only

    def replace(self, **changes: object) -> RunRequest:
        return dataclasses.replace(self, **changes)

    def trainer_overrides(self) -> list[str]:
        """The fields torchtitan holds, as overrides; then `overrides`; the AC choice last."""
        words: list[str] = []
        for name, flags in TRAINER_FIELDS.items():
            value = getattr(self, name)
            if name == "tokenizer" and value is not None:
                value = Path(value).resolve()  # read by every rank, from its own directory
            if name == "run_dir" and value is not None and is_remote(value):
                # On S3: checkpoints at the URL, the rest in a local folder (launcher.remote).

                words += ["--checkpoint.folder", f"{value}/checkpoint"]
                value = local_folder(value)
            if value is not None:
                words += [word for flag in flags for word in (flag, str(value))]
        words += self.overrides
        # A tyro subcommand, so always the last word on the trainer's command line.
        if self.ac is not None:
            words.append(f"activation-checkpoint:{self.ac}")
        return words


def _absolute_stop_by(text: str) -> str:
    """`--stop-by` as an absolute UTC time, refused when it has already passed."""
    from datetime import UTC, datetime

    from qwentitan.launch.runtime.stop_clock import MARGIN_S

    now = datetime.now(UTC)
    when = parse_stop_by(text, now)
    if when <= now:
        raise LaunchError(
            f"{{stop_by}} {text} has already passed (it is {format_utc(now)} now); pass a later "
            "time in UTC, or a duration such as {stop_by} +90m.",
            field="stop_by",
        )
    left = (when - now).total_seconds()
    if left <= MARGIN_S:  # the ranks would stop before their first step, yet after the deadline
        raise LaunchError(
            f"{{stop_by}} {text} leaves {left:.0f} s, within the {MARGIN_S:.0f} s a run keeps "
            "after its last save for the ranks to exit; pass a later time, such as {stop_by} "
            "+10m.",
            field="stop_by",
        )
    return format_utc(when)


# The request's counts, each 1 or more (max_restarts, the one that may be 0, is checked apart).
_COUNTS = tuple(
    f.name
    for f in dataclasses.fields(RunRequest)
    if str(f.type).startswith("int") and f.name != "max_restarts"
)
