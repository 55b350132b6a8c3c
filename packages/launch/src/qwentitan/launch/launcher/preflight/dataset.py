"""Preflight: open the run's training dataset offline and read its first batch.

A trn2 run reads its data on every rank; a dataset that is not on the host (a Hub name, or
torchtitan's `c4_test`, a folder of torchtitan's source tree that no wheel ships) would be
streamed by all of them, or not found at all, an hour into a rented machine. This check reads
with the Hub switched off, so it passes only for data that is on this host.
"""

from __future__ import annotations

from pathlib import Path

from qwentitan.launch.base.errors import LaunchError
from qwentitan.launch.base.scoped_env import hub_offline
from qwentitan.launch.launcher.plan import LaunchPlan
from qwentitan.launch.launcher.preflight.report import CheckResult
from qwentitan.launch.launcher.start import check_local_dataset

# Measured on the offline corpus with Qwen3's tokenizer (1,535,872 bytes -> 336,957 tokens);
# used only to say about how many times a run goes over local data.
BYTES_PER_TOKEN = 4.5
# Above this many passes over local data the check says to bring more (it still passes).
REPEATS_NOTED = 10


def _tokenizer_folder(plan: LaunchPlan) -> tuple[str, str]:
    """The recipe's tokenizer folder when it is on the host, else the bundled Qwen3 one (the
    same vocabulary for every Qwen3 model the recipes train)."""
    folder = Path(plan.config.hf_assets_path or "").expanduser()
    if (folder / "tokenizer.json").is_file():
        return str(folder), "the recipe's tokenizer"
    from qwentitan.launch.runtime.data import qwen_tokenizer_folder

    return str(qwen_tokenizer_folder()), "the bundled Qwen3 tokenizer (recipe folder absent)"


def first_batch_shape(plan: LaunchPlan) -> tuple[tuple[int, ...], str]:
    """The shape of rank 0's first training batch, and which tokenizer read it."""
    config = plan.config
    folder, which = _tokenizer_folder(plan)
    tokenizer = config.tokenizer.build(tokenizer_path=folder)
    loader = config.dataloader.build(
        dp_world_size=plan.batch_ranks,
        dp_rank=0,
        tokenizer=tokenizer,
        seq_len=plan.seq_len,
        local_batch_size=plan.local_batch,
    )
    inputs, _labels = next(iter(loader))
    tokens = inputs["input"] if isinstance(inputs, dict) else inputs
    return tuple(tokens.shape), which


def check_dataset(plan: LaunchPlan) -> CheckResult:
    from qwentitan.launch.runtime.data import resolve_dataset

    spec = getattr(plan.config.dataloader, "dataset", None)
    if spec is None:
        return CheckResult("dataset", "fail", "the recipe's dataloader names no dataset")
    needed = plan.steps * plan.global_batch * plan.seq_len
    figures: dict[str, object] = {"dataset": spec, "tokens_needed": needed}
    try:
        with hub_offline():
            source = resolve_dataset(spec)
            if source.is_local:  # as `train` and `run` check it: file, line and byte
                check_local_dataset(plan, source)
            shape, which = first_batch_shape(plan)
    except LaunchError as error:  # a local file the ranks could not read, said as train says it
        return CheckResult("dataset", "fail", str(error).removesuffix("."), figures)
    except Exception as error:  # anything that stops the read is what the ranks would meet
        reason = f"{type(error).__name__}: {str(error).strip().splitlines()[0][:200]}"
        return CheckResult(
            "dataset",
            "fail",
            f"{spec!r} cannot be read on this host without network ({reason}); its "
            f"{plan.world_size} ranks would each stream or miss it: put JSON-lines data on the "
            "host and pass --dataloader.dataset DIR, or --dataloader.dataset offline",
            figures,
        )
    figures["first_batch"] = list(shape)
    read = f"first batch {' x '.join(map(str, shape))} tokens read offline with {which}"
    if not source.is_local:
        return CheckResult(
            "dataset",
            "pass",
            f"{spec!r} is a Hub dataset, found in this host's cache; {read}; every one of the "
            f"{plan.world_size} ranks will stream it from the Hub",
            figures,
        )
    size = sum(Path(f).stat().st_size for f in source.files)
    passes = needed / (size / BYTES_PER_TOKEN)
    figures.update(files=len(source.files), bytes=size, passes=round(passes, 1))
    name = "the offline corpus" if spec == "offline" else spec
    return CheckResult(
        "dataset",
        "pass",
        f"{name}: {len(source.files)} file(s), {size / 1e6:.1f} MB on this host; {read}; the "
        f"run reads {tokens(needed)} ({plan.steps} steps x {plan.global_batch} x "
        f"{plan.seq_len}), {_share(passes)}"
        + ("; for a run this long put more text on the host" if passes > REPEATS_NOTED else ""),
        figures,
    )


def tokens(count: int) -> str:
    """`count` tokens in a unit that shows it (3,072 tokens, 1.6M tokens, 2.1B tokens)."""
    for scale, unit in ((1e9, "B"), (1e6, "M")):
        if count >= scale:
            return f"{count / scale:.1f}{unit} tokens"
    return f"{count:,} tokens"


def _share(passes: float) -> str:
    """How much of the data the run reads: passes over it, or a percentage under a tenth."""
    return f"about {passes:.1f} passes over it" if passes >= 0.1 else f"{passes:.2%} of it"
